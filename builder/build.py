"""`metrale build`: Hugging Face checkpoints -> an engine directory.

Order of work (each step can refuse; nothing is written before the staging directory exists and
nothing reaches the final path unless every step succeeded):
1. Resolve the recipe and the flag overrides into `BuildOptions` (validated).
2. Load every checkpoint strictly (every tensor consumed, every shape checked) and refuse
   quantization requests the checkpoints cannot honour, before any quantizing.
3. Per component, derive the engine state in module naming — the drafters' and the head's draft
   LM head (a copy of the target's) and the drafters' stacked context K/V projection — then
   quantize it with ModelOpt as the tier asks; with `--draft-tp-size N` cut each drafter's
   quantized state into N rank files (`builder.shard`; the target and MTP head stay rank0).
4. Write weights, configs, tokenizer and the manifest (with the memory estimate) through
   `EngineDirWriter`, which renames the staging directory into place only when complete.
5. With a TensorRT flavour, ONNX graphs and engines per component and SM (`trt_build`); a
   sharded drafter gets one graph and one engine per rank and SM (`tp_export`).
6. With `--cpu-engines aoti` (the default), the decode loop's steps (target, MTP head, drafters)
   as AOTInductor packages for this CPU (`cpu_build`), checked against the eager models and,
   for the target, row by row against one-row steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from metrale.builder import quantize as q
from metrale.builder import shard
from metrale.builder.recipe import BuildOptions, Recipe
from metrale.runtime.models.configs import read_config
from metrale.runtime.artifact.digests import checkpoint_digest
from metrale.runtime.artifact.engine_dir import EngineDirWriter, Manifest
from metrale.runtime.errors import CheckpointError, ConfigError
from metrale.runtime.components import KINDS
from metrale.runtime.models.loader import read_safetensors, rename
from metrale.runtime.artifact.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


@dataclass
class BuildReport:
    engine_dir: Path
    manifest: Manifest
    seconds: float
    memory_estimate: dict = field(default_factory=dict)


def _bf16_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()}


def build_engine(recipe: Recipe, engine_dir: Path | None = None, *, overwrite: bool = True,
                 progress: Callable[[str], None] = lambda msg: None) -> BuildReport:
    t0 = time.time()
    opts = recipe.build
    out = Path(engine_dir) if engine_dir is not None else Path(recipe.engine_dir)
    tp = shard.resolve_build_tp(opts.draft_tp_size)

    tier_format = q.DraftWeightQuantization.parse(opts.draft_weight_quantization).format
    for name, src in recipe.drafters.items():  # from the configs: refused before any loading
        cfg = KINDS[src.kind].parse(read_config(src.checkpoint), f"{src.checkpoint}/config.json", None)
        shard.check_drafter_tp(cfg, tp, tier_format, name)

    progress("loading checkpoints")
    loader = {name: k.checkpoint for name, k in KINDS.items()}  # by kind: the registry's
    target = loader["target"](recipe.target.checkpoint)
    check_tokenizer(recipe.target.checkpoint, target.config.vocab_size)
    lm_head = target.lm_head.weight.detach()
    head = None
    if recipe.mtp is not None:
        head = loader["mtp"](recipe.mtp.checkpoint, lm_head)
        naming = head.config.naming
        raw, _ = rename(read_safetensors(recipe.mtp.checkpoint), f"mtp.{naming}", head.config.layer_index)
        q.check_mtp_request(raw, experts_nvfp4=opts.mtp_experts_nvfp4,
                            mtp_quantization=opts.mtp_quantization, ffn_kind=head.config.ffn_kind)
        del raw
    drafters = {name: loader[src.kind](src.checkpoint, lm_head) for name, src in recipe.drafters.items()}

    memory: dict[str, dict] = {}
    with EngineDirWriter(out, overwrite=overwrite) as w:
        progress("writing target")
        _write_component(w, "target", recipe.target.checkpoint, [_bf16_state(target)],
                         {"kind": "target"})
        _copy_tokenizer(w, recipe.target.checkpoint)
        sources = {"target": {"path": str(recipe.target.checkpoint),
                              "sha256": checkpoint_digest(recipe.target.checkpoint)}}
        if head is not None:
            progress("quantizing the MTP head")
            state = _bf16_state(head)
            qstate, section = q.quantize_mtp(state, experts_nvfp4=opts.mtp_experts_nvfp4,
                                             mtp_quantization=opts.mtp_quantization,
                                             ffn_kind=head.config.ffn_kind)
            memory["mtp"] = mtp_memory(state, head.config.ffn_kind)
            _write_component(w, "mtp", recipe.mtp.checkpoint, [qstate],
                             {"kind": "mtp", "naming": head.config.naming, "quantization": section,
                              "weight_bytes": q.weight_bytes(qstate)}, declared=state)
            sources["mtp"] = {"path": str(recipe.mtp.checkpoint),
                              "sha256": checkpoint_digest(recipe.mtp.checkpoint)}
        for name, drafter in drafters.items():
            progress(f"quantizing drafter {name} ({opts.draft_weight_quantization})")
            state = drafter.engine_state()  # the drafter's module says what its engine stores
            qstate, section = q.quantize_drafter(state, opts.draft_weight_quantization)
            memory[name] = {tier: q.estimate_bytes(state, tier) for tier in q.DRAFT_TIERS}
            src = recipe.drafters[name].checkpoint
            shards = shard.shard_drafter(qstate, drafter.config, tp)
            _write_component(w, name, src, shards,
                             {"kind": recipe.drafters[name].kind, "version": drafter.config.version,
                              "quantization": section, "weight_bytes": q.weight_bytes(qstate),
                              "tp_size": tp, "rank_weight_bytes": shard.shard_bytes(shards)},
                             declared=state)
            sources[name] = {"path": str(src), "sha256": checkpoint_digest(src)}
        engines = build_engines(w, opts, progress) if opts.onnx else {}
        if opts.cpu_engines == "aoti":
            from metrale.builder.cpu_build import build_cpu_packages

            taps = tuple(dict.fromkeys(i for d in drafters.values() for i in d.config.target_layer_ids))
            for name, cpu in build_cpu_packages(w, w.components, taps, progress).items():
                info = w.components[name]
                w.component(name, info.merged(cpu=cpu, files=info.files + [p.file for p in cpu.packages]))
        w.set(sources=sources, tp_size=tp, memory_estimate=memory,
              plugins=engines.get("plugins", []),
              build={"recipe": recipe.name, "draft_weight_quantization": opts.draft_weight_quantization,
                     "mtp_quantization": opts.mtp_quantization,
                     "mtp_experts_nvfp4": opts.mtp_experts_nvfp4,
                     "trt_flavor": engines.get("trt_flavor", "none"),
                     "trt_dtype": opts.trt_dtype,
                     "trt_version": engines.get("trt_version"),
                     "target_sm": list(opts.target_sm),
                     "engine_sm": engines.get("target_sm", []),
                     "skipped_sm": engines.get("skipped_sm", []),
                     "cpu_engines": opts.cpu_engines, "onnx": opts.onnx})
        progress("hashing and installing")
    return BuildReport(out, w.manifest, time.time() - t0, memory)


def build_engines(w: EngineDirWriter, opts, progress) -> dict:
    """ONNX graphs, TensorRT engines and the plugins' cubins for the components written so far
    (loaded back from the staging directory exactly as serve loads them; a tensor-parallel
    drafter rank by rank, one graph and engine per rank)."""
    from metrale.builder.trt_build import export_and_build, load_staged
    from metrale.plugins.trt_plugin import KERNELS_OF_OP

    infos = w.components
    models = load_staged(w.path, infos, dtype=getattr(torch, opts.trt_dtype))
    extra = export_and_build(w, models, opts, progress)
    for name, add in extra["components"].items():
        w.component(name, infos[name].merged(**{**add, "files": infos[name].files + add["files"]}))
    jobs = cubin_jobs(extra["components"], KERNELS_OF_OP)
    if jobs:
        extra["plugins"] = compile_cubins(w, jobs, progress)
    return extra


def cubin_jobs(components: dict, kernels_of_op: dict) -> list[tuple[str, int, str]]:
    """(kernel function, sm, act) for every kernel plugin layer of every engine: the op's
    kernels (`kernels_of_op`: op -> kernel base names; the GEMMs', the MoE's two, the conv's)
    for that engine's SM and each activation dtype its layers run in (`plugin_acts`), sorted,
    once each. The collectives launch no Triton kernel (they call NCCL)."""
    jobs = set()
    for name, comp in components.items():
        for sm, engine in comp["engines"].items():
            acts = engine.get("plugin_acts") or {}
            for op in engine.get("plugins") or {}:
                if op not in kernels_of_op:
                    continue
                if not acts.get(op):
                    raise ConfigError(f"component {name}: the SM{sm} engine has {op} plugin "
                                      "layers of no recorded activation dtype")
                jobs.update((kernel + "_kernel", int(sm), act) for kernel in kernels_of_op[op]
                            for act in acts[op])
    return sorted(jobs)


def compile_cubins(w: EngineDirWriter, jobs: list[tuple[str, int, str]], progress) -> list[dict]:
    """The Triton kernels behind the engines' plugin layers: one cubin per kernel, SM and
    activation dtype the engines use."""
    try:
        from metrale.plugins.aot import compile_jobs_in_subprocess
    except ImportError as exc:  # pragma: no cover - the module imports triton lazily
        raise ConfigError(f"engines with plugin layers need the kernels extra: {exc}") from None
    progress("compiling plugin kernels: " + ", ".join(f"{k.removesuffix('_kernel')} SM{sm} {act}"
                                                      for k, sm, act in jobs))
    return compile_jobs_in_subprocess(w.path / "plugins", jobs)


def mtp_memory(state: dict[str, torch.Tensor], ffn_kind: str) -> dict[str, int]:
    est = {"bf16": q.weight_bytes(state)}
    if ffn_kind == "moe":
        est["experts-nvfp4"] = q.estimate_mtp_bytes(state)
    return est


def _write_component(w: EngineDirWriter, name: str, checkpoint: Path, states: list[dict],
                     info: dict, declared: dict | None = None) -> None:
    """The component's config and one `rank{r}.safetensors` per state (rank order).

    `declared`: the component's weights before quantizing (engine names, BF16), kept so that
    a serve can requantize them at load to another tier; its file is `declared.safetensors`,
    or `rank0.safetensors` itself where that already holds exactly these tensors."""
    w.copy_file(Path(checkpoint) / "config.json", f"{name}/config.json")
    files = [f"{name}/rank{r}.safetensors" for r in range(len(states))]
    for f, state in zip(files, states):
        w.save_safetensors(f, state, metadata={"format": "pt"})
    if declared is not None:
        same = len(states) == 1 and states[0].keys() == declared.keys() and all(
            states[0][k] is declared[k] or torch.equal(states[0][k], declared[k]) for k in declared)
        info = {**info, "declared": files[0] if same else f"{name}/declared.safetensors"}
        if not same:
            w.save_safetensors(info["declared"], declared, metadata={"format": "pt"})
            files = files + [info["declared"]]
    w.component(name, {**info, "config": f"{name}/config.json", "files": files})


def check_tokenizer(checkpoint: Path, vocab_size: int) -> None:
    """Load the target's tokenizer as serving will, and refuse one the model cannot serve:
    no tokens, ids beyond the model's vocabulary, a chat template that does not compile."""
    tok = Tokenizer.from_dir(checkpoint)
    where = f"target checkpoint {checkpoint}: tokenizer.json"
    if tok.vocab_size < 1:
        raise CheckpointError(f"{where} holds no tokens")
    if tok.vocab_size > vocab_size:
        raise CheckpointError(f"{where} has {tok.vocab_size} tokens; the model's vocab_size is "
                              f"{vocab_size}, so some ids would have no embedding")
    if tok.chat_template is not None:
        try:
            tok.apply_chat_template([{"role": "user", "content": "x"}])
        except ConfigError:  # the template refused these messages (raise_exception): it compiles
            pass


def _copy_tokenizer(w: EngineDirWriter, checkpoint: Path) -> None:
    found = [f for f in TOKENIZER_FILES if (Path(checkpoint) / f).is_file()]
    if "tokenizer.json" not in found or "tokenizer_config.json" not in found:
        raise ConfigError(f"target checkpoint {checkpoint}: tokenizer.json and tokenizer_config.json are required")
    for f in found:
        w.copy_file(Path(checkpoint) / f, f"tokenizer/{f}")

