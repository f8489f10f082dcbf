"""The `tensorrt` backend: an engine directory's TensorRT engines behind the torch models' calls.

`load_trt_engine` returns the same `LoadedEngine` the torch backend's `engine.load_engine` does,
with engine-backed stand-ins for the three model kinds, each answering exactly the calls the
decode loop and the proposers make, with the same signatures and outputs (`decode`,
`spec_mtp`, `spec_dflash` run unchanged):
- `TrtTarget(ids, cache, start=None, taps=())` -> `TargetOutput`, `new_cache`, `.config`,
  `.model.embed_tokens` (the one torch module kept: the MTP head and the drafters embed with it);
- `TrtMTPHead(embeds, hidden, cache, start=None)` -> (logits, h), `new_cache`;
- `TrtDrafter.add_context(features, cache)`, `.propose(anchor, embed, cache, gamma)` ->
  `Proposal`, `new_cache`, `.config`.
The graphs' interface is `builder.onnx_export`'s: each step takes the whole preallocated KV cache
as `past_key`/`past_value` with `position` (the first new position = the number of valid past
entries; slots at or after it are masked), and returns only the new K/V, which the caller writes
at `position`. Caches (`EngineCache`) are torch CUDA tensors [L, 1, nkv, S, hd] in two sizes per
component: S = the profile's opt past (the shape TensorRT tuned for) and S = its max. A cache
starts at the smaller and moves to the larger (its valid positions copied) only when a call
would write past it, so short requests attend over opt slots, not max (attention costs grow
with S); a sequence's steps change shape at most once, at the same position in plain and
exact-verify decoding. The target's
`config.max_position_embeddings` is capped (`position_limit`) at the smallest max past of all
components (target, MTP head, drafters) less the rows one speculative step may write beyond
the budget, so the decode loop outgrows no component's cache.

The drafter engine adds context and proposes in one call (new context features C ≥ 1, then the
block): `add_context` only queues features on the cache, and `propose` sends them with the block.
Context K/V of a position depend on that position alone, so where the queue outgrows the
profile's context range the surplus is sent ahead with a one-slot dummy block.

CUDA graphs (`trt_runner`): the target and head steps with one new token, and each propose of a
block of γ ≤ block_size slots (the drafter's block, or `--dflash-gamma` below it) whose context
count C ≤ γ, are captured per cache buffer and replayed. Cache buffers come from a per-component,
per-size pool and return to it when their cache is collected (or moves to the larger size), so
consecutive requests reuse buffers and their graphs; two caches alive at once never share one.

Precision: the engines compute in the dtype they were built with (the ONNX graphs' dtype:
`metrale build --trt-dtype`, bfloat16 by default); `--dtype auto` takes it, and another
explicit `--dtype` is refused naming both (`builder.requantize.check_plans`).
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from metrale.runtime.configs import DecoderConfig, DFlashConfig
from metrale.runtime.dflash import CandidateSelector, Proposal
from metrale.runtime.engine import LoadedEngine
from metrale.runtime.errors import ConfigError, EngineDirError
from metrale.runtime.qwen3 import TargetOutput
from metrale.runtime.trt_cache import CacheSizes, EngineCache, position_limit
from metrale.runtime.trt_runner import EngineRunner, gpu_sm, import_trt, pick_engine_sm

log = logging.getLogger(__name__)

KV = ("past_key", "past_value")


class Backend(str, enum.Enum):
    AUTO = "auto"  # aoti on a CPU with fitting packages, CUDA graphs on a GPU, else torch
    TORCH = "torch"
    AOTI = "aoti"
    TENSORRT = "tensorrt"

    @classmethod
    def parse(cls, s: str) -> "Backend":
        try:
            return cls(s)
        except ValueError:
            raise ConfigError(f"--backend {s!r}: allowed values are auto, torch, aoti, tensorrt") from None


def resolve_backend(backend: str, device: str | None, dtype: str = "float32",
                    nproc: int | None = None, cuda_available: bool | None = None) -> tuple[Backend, str]:
    """Check `--backend` against `--device`, `--dtype` and `--nproc` before anything loads;
    returns the backend and the device (default: cpu for torch, cuda for tensorrt)."""
    b = Backend.parse(backend)
    if b in (Backend.TORCH, Backend.AUTO):
        return b, device or "cpu"
    if b is Backend.AOTI:
        device = device or "cpu"
        if torch.device(device).type != "cpu":
            raise ConfigError(f"--backend aoti runs the engine's CPU packages; --device {device} is not "
                              "a CPU (use --backend torch there)")
        return b, device
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        raise ConfigError("--backend tensorrt runs TensorRT engines on an NVIDIA GPU, and CUDA is "
                          "not available here; use --backend torch (the default)")
    device = device or "cuda"
    if torch.device(device).type != "cuda":
        raise ConfigError(f"--backend tensorrt needs --device cuda or cuda:N, got --device {device}")
    if nproc is not None and nproc > 1:
        raise ConfigError(f"--nproc {nproc}: the tensorrt backend runs one process (its engines "
                          "are built for one rank); use --backend torch for tensor parallelism")
    return b, device


# -- caches ----------------------------------------------------------------------------------


class _Component:
    """What the three stand-ins share: the runner, the profile ranges and the cache sizes."""

    def __init__(self, runner: EngineRunner, profile: dict, layers: int, cfg: DecoderConfig):
        self.runner, self.profile = runner, profile
        self.max_new = int(profile.get("tokens", profile.get("context", (1, 1, 1)))[2])
        _, opt, top = (int(v) for v in profile["past"])
        self.kv_dtype = runner.dtypes["past_key"]
        self.sizes = CacheSizes(layers, cfg.num_key_value_heads, cfg.head_dim, [opt, top],
                                 self.kv_dtype, runner.device)

    def _cache(self, batch: int) -> EngineCache:
        if batch != 1:
            raise ValueError(f"the tensorrt backend decodes one sequence per cache, got batch {batch}")
        return self.sizes.cache()

    def _position(self, pos: int) -> torch.Tensor:
        return torch.full((1,), pos, dtype=torch.int64, device=self.runner.device)


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# -- the stand-ins ---------------------------------------------------------------------------


class TrtTarget(_Component):
    def __init__(self, runner: EngineRunner, profile: dict, cfg: DecoderConfig,
                 embed: nn.Embedding, engine_taps: tuple[int, ...], max_positions: int | None = None):
        """`max_positions`: the usable context (`position_limit` over every component's
        profile; default: this engine's own)."""
        super().__init__(runner, profile, cfg.num_hidden_layers, cfg)
        if max_positions is None:
            max_positions = position_limit(cfg.max_position_embeddings, [int(profile["past"][2])])
        self.config = replace(cfg, max_position_embeddings=min(cfg.max_position_embeddings,
                                                               max_positions))
        self.model = SimpleNamespace(embed_tokens=embed)
        self.engine_taps = engine_taps

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> EngineCache:
        return self._cache(batch)

    def __call__(self, ids: torch.Tensor, cache: EngineCache | None = None, start: int | None = None,
                 taps: tuple[int, ...] = ()) -> TargetOutput:
        """ids [1, T] at positions start.. (default cache.length); the cache length becomes start+T."""
        if cache is None:
            if start:
                raise ValueError("a target step after position 0 needs the cache of the positions before it")
            cache = self.new_cache(1, ids.shape[1])
        start = cache.length if start is None else start
        cache.reserve(start + ids.shape[1])  # before any call: graph keys name the final buffer
        parts = []
        for lo in range(0, ids.shape[1], self.max_new):  # the profile's most new tokens per call
            chunk = ids[:, lo:lo + self.max_new]  # [1, t]
            feeds = {"input_ids": chunk, "past_key": cache.k, "past_value": cache.v,
                     "position": self._position(start + lo)}
            key = ("step", cache.slot_id) if chunk.shape[1] == 1 else None
            out = self.runner.run(feeds, graph_key=key, persistent=KV)
            cache.write_new(start + lo, out["new_key"], out["new_value"])
            parts.append(out)
        cache.length = start + ids.shape[1]
        tapped = _cat([p.get("taps") for p in parts]) if taps else None
        return TargetOutput(logits=_cat([p["logits"] for p in parts]),
                            last_hidden=_cat([p["last_hidden"] for p in parts]),
                            taps=self.select_taps(tapped, taps))

    forward = __call__

    def select_taps(self, tapped: torch.Tensor | None, wanted: tuple[int, ...]) -> torch.Tensor | None:
        """The engine's `taps` [1, T, n·H] (layers `engine_taps`) -> the `wanted` layers' [1, T, m·H]."""
        if not wanted:
            return None
        missing = [i for i in wanted if i not in self.engine_taps]
        if tapped is None or missing:
            raise EngineDirError(f"the target engine taps layers {list(self.engine_taps)}, not "
                                 f"{missing or list(wanted)}; rebuild the engine directory")
        h = self.config.hidden_size
        idx = [self.engine_taps.index(i) for i in wanted]
        if idx == list(range(len(self.engine_taps))):
            return tapped
        return torch.cat([tapped[..., i * h:(i + 1) * h] for i in idx], dim=-1)


class TrtMTPHead(_Component):
    def __init__(self, runner: EngineRunner, profile: dict, cfg: DecoderConfig):
        super().__init__(runner, profile, 1, cfg)
        self.config = SimpleNamespace(decoder=cfg)

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None) -> EngineCache:
        return self._cache(batch)

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: EngineCache,
                 start: int | None = None):
        """Entries start.. : embeds, hidden [1, T, H] -> (logits [1, T, V], h [1, T, H] pre-norm)."""
        start = cache.length if start is None else start
        cache.reserve(start + embeds.shape[1])
        logits, hs = [], []
        for lo in range(0, embeds.shape[1], self.max_new):
            e, h = embeds[:, lo:lo + self.max_new], hidden[:, lo:lo + self.max_new]
            feeds = {"embeds": e, "hidden": h, "past_key": cache.k, "past_value": cache.v,
                     "position": self._position(start + lo)}
            key = ("step", cache.slot_id) if e.shape[1] == 1 else None
            out = self.runner.run(feeds, graph_key=key, persistent=KV)
            cache.write_new(start + lo, out["new_key"], out["new_value"])
            logits.append(out["logits"])
            hs.append(out["hidden_out"])
        cache.length = start + embeds.shape[1]
        return _cat(logits), _cat(hs)

    forward = __call__


def propose_graph_key(slot_id: int, context: int, gamma: int, block_size: int):
    """The CUDA-graph key of a drafter call, or None (eager): a block of γ ≤ block_size slots
    (`--dflash-gamma` may lower γ) with at most γ new context positions — what every step after
    the first brings (accepted drafts + the bonus token), so the keys per buffer stay ≤ γ. A
    longer context (the prompt's) or a one-slot flush block runs eagerly."""
    if 1 < gamma <= block_size and 1 <= context <= gamma:
        return ("propose", slot_id, context, gamma)
    return None


class TrtDrafter(_Component):
    def __init__(self, runner: EngineRunner, profile: dict, cfg: DFlashConfig,
                 codebooks: tuple[torch.Tensor, torch.Tensor] | None):
        super().__init__(runner, profile, cfg.decoder.num_hidden_layers, cfg.decoder)
        self.config = cfg
        self.max_context = int(profile["context"][2])
        self.selector = None
        if cfg.version == 2:
            d = cfg.decoder
            sel = CandidateSelector(d.hidden_size, d.vocab_size, cfg.selector_dim, cfg.num_candidates)
            # the engine's `selector_query` is hidden_projection(hidden) already
            sel.hidden_projection = nn.Identity()
            dtype = runner.dtypes["selector_query"]
            sel.predecessor_codebook = nn.Parameter(codebooks[0].to(runner.device, dtype), False)
            sel.successor_codebook = nn.Parameter(codebooks[1].to(runner.device, dtype), False)
            self.selector = sel

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None) -> EngineCache:
        return self._cache(batch)

    def add_context(self, features: torch.Tensor, cache: EngineCache) -> None:
        """Queue the features [1, C, n·Ht] of the next C accepted positions (sent with the next
        propose; a queue longer than the profile allows is sent ahead in profile-sized chunks)."""
        cache.pending = features if cache.pending is None else torch.cat([cache.pending, features], 1)
        while cache.pending.shape[1] > self.max_context:
            ahead, cache.pending = cache.pending[:, :self.max_context], cache.pending[:, self.max_context:]
            dummy = torch.zeros(1, 1, self.config.decoder.hidden_size,
                                dtype=self.runner.dtypes["block_embeds"], device=self.runner.device)
            self._run(ahead, dummy, cache)

    def _run(self, context: torch.Tensor, block: torch.Tensor, cache: EngineCache) -> dict:
        c, g = context.shape[1], block.shape[1]
        cache.reserve(cache.length + c)
        feeds = {"context_features": context, "past_key": cache.k, "past_value": cache.v,
                 "position": self._position(cache.length), "block_embeds": block}
        out = self.runner.run(feeds, graph_key=propose_graph_key(cache.slot_id, c, g,
                                                                 self.config.block_size),
                              persistent=KV)
        cache.write_new(cache.length, out["new_key"], out["new_value"])
        cache.length += c
        return out

    def propose(self, anchor: torch.Tensor, embed: nn.Embedding, cache: EngineCache, gamma: int) -> Proposal:
        """anchor [1] (the last accepted token, at position cache.length + queued) -> γ−1 drafts."""
        if cache.pending is None or cache.pending.shape[1] == 0:
            raise RuntimeError("propose needs the context of at least one accepted position first")
        block = torch.full((anchor.shape[0], gamma), self.config.mask_token_id, dtype=torch.long,
                           device=anchor.device)
        block[:, 0] = anchor
        out = self._run(cache.pending, embed(block), cache)
        cache.pending = None
        logits = out["logits"][:, 1:]  # [1, γ−1, V]: slot j predicts position anchor+j
        if self.selector is not None:
            tokens = self.selector.select(out["selector_query"][:, 1:], logits, anchor)
        else:
            tokens = logits.argmax(-1)
        return Proposal(tokens=tokens, logits=logits)


# -- loading ---------------------------------------------------------------------------------


def _tensors(path: Path, names: tuple[str, ...], where: str) -> list[torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing = [n for n in names if n not in keys]
        if missing:
            raise EngineDirError(f"{where}: {path.name} has no tensor {missing[0]}")
        return [f.get_tensor(n) for n in names]


def load_trt_engine(engine_dir: str | Path, *, device: str | torch.device = "cuda",
                    graphs: bool = True) -> LoadedEngine:
    """Verify the directory and load every component's engine for this GPU's SM."""
    from metrale.plugins.trt_plugin import KernelLibrary, plugin_kernel_keys, register_plugins
    from metrale.runtime.tokenizer import Tokenizer

    from metrale.runtime.engine import check_engine_dir

    resolve_backend("tensorrt", str(device))
    path = Path(engine_dir)
    manifest = check_engine_dir(path)
    dev = torch.device(device)
    dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    comps = manifest.components
    sharded = sorted(n for n, c in comps.items() if c.get("tp_size", 1) > 1)
    if sharded:
        raise ConfigError(
            f"--backend tensorrt: engine directory {path} holds tensor-parallel drafter engines "
            f"({', '.join(sharded)}, built with --draft-tp-size > 1), which this backend does not run; "
            "rebuild with --draft-tp-size 1 or use --backend torch")
    sm = pick_engine_sm({n: c.get("engines", {}) for n, c in comps.items()}, gpu_sm(dev), path)
    flavor = manifest.build.get("trt_flavor")
    trt = import_trt(flavor, path)
    with torch.cuda.device(dev):
        stream = torch.cuda.Stream(dev)
        plugins = None
        entries = [c["engines"][str(sm)] for c in comps.values()]
        if any(e.get("plugins") for e in entries):
            try:
                library = KernelLibrary.from_dir(path / "plugins")
                missing = library.missing(plugin_kernel_keys(entries, sm))
            except (OSError, ValueError, KeyError) as exc:
                raise EngineDirError(f"engine directory {path}: plugins/ cannot be read ({exc})") from None
            if missing:  # refused now, not at the first launch mid-request
                raise EngineDirError(f"engine directory {path}: plugins/ has no kernel "
                                     f"{', '.join(missing)} for the SM{sm} engines' plugin layers; "
                                     "rebuild the directory")
            plugins = register_plugins(trt, sm, library)  # before deserializing plugin layers

        def runner(name: str) -> EngineRunner:
            rel = comps[name]["engines"][str(sm)]["file"]
            what = f"engine directory {path}: {rel}"
            return EngineRunner(trt, flavor, (path / rel).read_bytes(), what, dev, stream, graphs)

        def config(name: str) -> dict:
            return json.loads((path / name / "config.json").read_text())

        tcfg = DecoderConfig.from_hf(config("target"), "target/config.json")
        # the usable context: every component's cache must hold it (plus one step's rows)
        limit = position_limit(tcfg.max_position_embeddings,
                               [int(c["profile"]["past"][2]) for c in comps.values()])
        tgt = runner("target")
        (weight,) = _tensors(path / "target" / "rank0.safetensors", ("model.embed_tokens.weight",),
                             f"engine directory {path}")
        embed = nn.Embedding.from_pretrained(weight.to(dev, tgt.dtypes["last_hidden"]), freeze=True)
        engine_taps = tuple(comps["target"].get("taps", ()))
        target = TrtTarget(tgt, comps["target"]["profile"], tcfg, embed, engine_taps, limit)
        loaded = LoadedEngine(path, manifest, Tokenizer.from_dir(path / "tokenizer"), target,
                              dtype=embed.weight.dtype, device=dev,
                              packed=True)  # the plans hold their own weights: nothing to pack
        for name, info in comps.items():
            if name == "target":
                continue
            if info.get("kind") == "mtp":
                mcfg = DecoderConfig.from_hf(config(name), f"{name}/config.json")
                loaded.mtp = TrtMTPHead(runner(name), info["profile"], mcfg)
            elif info.get("kind") == "dflash":
                dcfg = DFlashConfig.from_hf(config(name), f"{name}/config.json")
                if any(i not in engine_taps for i in dcfg.target_layer_ids):
                    raise EngineDirError(f"engine directory {path}: drafter {name} reads target "
                                         f"layers {list(dcfg.target_layer_ids)}, the target engine "
                                         f"taps {list(engine_taps)}; rebuild the directory")
                books = None
                if dcfg.version == 2:
                    books = tuple(_tensors(path / name / "rank0.safetensors",
                                           ("candidate_selector.predecessor_codebook",
                                            "candidate_selector.successor_codebook"),
                                           f"engine directory {path}"))
                loaded.drafters[name] = TrtDrafter(runner(name), info["profile"], dcfg, books)
            else:
                raise EngineDirError(f"engine directory {path}: component {name} has unknown kind "
                                     f"{info.get('kind')!r}")
    # the plugin creators must outlive every engine holding plugin layers
    target.keep_alive = (plugins, stream)
    log.info("loaded %s for SM%d (TensorRT %s)", path, sm, flavor)
    return loaded


def load_trt_generator(engine_dir: str | Path, spec, *, device: str = "cuda"):
    """`service.load_generator` for the tensorrt backend: one process, one rank."""
    import os

    from metrale.runtime.service import EngineGenerator

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ConfigError(f"--backend tensorrt runs in one process, not {world} torchrun ranks")
    tp = getattr(spec.draft_tp_size, "ranks", None)
    if tp is not None and tp > 1:
        raise ConfigError(f"--draft-tp-size {tp}: the tensorrt backend runs one-rank engines; "
                          "use --backend torch for tensor-parallel drafters")
    return EngineGenerator(load_trt_engine(engine_dir, device=device), spec)


def close_trt_engine(engine: LoadedEngine) -> None:
    """Release a loaded engine's GPU resources in order: every runner (graphs, contexts,
    engines) first, then the plugins' kernel modules and NCCL communicator they used."""
    parts = [engine.target, engine.mtp, *engine.drafters.values()]
    for part in parts:
        if part is not None:
            part.runner.close()
    plugins, _ = getattr(engine.target, "keep_alive", (None, None))
    if plugins is not None:
        plugins.close()


def runner_stats(engine: LoadedEngine) -> dict:
    """Per component: eager runs, graph captures and replays, and the graph mode (for checks)."""
    parts = {"target": engine.target, "mtp": engine.mtp, **engine.drafters}
    return {name: vars(part.runner.stats) for name, part in parts.items() if part is not None}
