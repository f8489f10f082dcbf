"""TensorRT engines for an engine directory: one per component, rank and target SM.

`export_and_build` is the build step: for every component it writes the portable ONNX graph
(`<component>/rank0.onnx`, metrale-domain nodes for the quantized linears; see `onnx_export`),
then, with a TensorRT flavour (`trt_env`), lowers the graph for each SM of `--target-sm` and
builds `<component>/rank0.sm<NN>.engine`. TensorRT-RTX builds with no GPU for the SMs in
`trt.ComputeCapability`; full TensorRT builds for the local GPU's SM only. Quantized linears the
SM has no native path for reach the TensorRT plugins of `plugins.trt_plugin` (registered for the
SM before parsing); the manifest records which plugin ops each engine holds (`plugins`: op ->
node count) and the activation dtypes its kernel plugin layers run in (`plugin_acts`: op -> sorted
fp32/fp16/bf16), from which the build compiles exactly the cubins the engines launch.

A drafter built with `--draft-tp-size N > 1` gets one graph and one engine per rank and SM
(`<drafter>/rank{r}.onnx`, `<drafter>/rank{r}.sm<NN>.engine`; `tp_export`), whose AllReduce /
AllGather nodes become NCCL plugin layers (`plugins.trt_collectives`). Its manifest entry lists
them per rank: `onnx_ranks` [rank order], and per SM `engines[sm] = {"plugins": {op: count},
"plugin_acts", "ranks": [{"file", "seconds", "bytes"} per rank]}` — no single `file`, since one rank's engine
alone cannot run (every rank's plugin ops are the same and checked to be).

Networks are strongly typed (the ONNX graph's dtypes are the engine's), with one optimization
profile whose ranges come from `EngineProfile`: new tokens 1..max_tokens, past 1..max_context,
the drafter's context 1..max_tokens and block 1..block_size (opt: the whole block).

Invariants: an engine is written only after TensorRT built it; a parse or build failure raises
`EngineBuildError` carrying TensorRT's own error messages and naming the component and SM.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import onnx
from torch import nn

from metrale.builder import onnx_export as ox
from metrale.plugins import onnx_lowering as lw
from metrale.builder.trt_env import TrtFlavor, TrtModule, load_trt, rtx_compute_capabilities
from metrale.runtime.components import KINDS, Role, kind_named, kind_of
from metrale.runtime.errors import ConfigError, MetraleError
from metrale.runtime.backends.trt_runner import shared_logger

log = logging.getLogger(__name__)


class EngineBuildError(MetraleError):
    """TensorRT could not parse or build a component's graph."""


@dataclass(frozen=True)
class EngineProfile:
    """Upper bounds of the dynamic axes the engines accept (the optimization profile)."""

    max_tokens: int = 256  # new tokens per target/MTP step and new context per propose
    max_context: int = 4096  # past entries (capped by the model's max_position_embeddings)

    def ranges(self, kind: str, module: nn.Module) -> dict[str, tuple[int, int, int]]:
        """Axis label -> (min, opt, max) for one component: new rows (`tokens`, and a drafter's
        new `context`) and the `past`, and a drafter's `block` (at most its block size)."""
        k = kind_named(kind)
        cfg = k.decoder(module.config)
        ctx = max(1, min(self.max_context, cfg.max_position_embeddings))
        tokens = max(1, min(self.max_tokens, ctx))
        out = {"tokens": (1, min(8, tokens), tokens), "past": (1, max(1, ctx // 2), ctx),
               "context": (1, min(8, tokens), tokens)}
        block = getattr(module.config, "block_size", None)
        if block is not None:
            out["block"] = (1, block, block)
        labels = k.graph_io(module.config, (0,)).axis_labels()
        return {label: r for label, r in out.items() if label in labels}


@dataclass(frozen=True)
class BuiltEngine:
    path: Path
    sm: int
    seconds: float
    size: int
    plugin_ops: dict[str, int]  # metrale op type -> node count left for plugins
    plugin_acts: dict[str, list[str]] = field(default_factory=dict)  # kernel op -> x dtypes


def plugin_activations(trt, network, model: onnx.ModelProto, what: str) -> dict[str, list[str]]:
    """Per metrale kernel op type (GEMMs, MoE, conv) in the parsed (strongly typed) `network`:
    the activation dtypes (`fp32`, `fp16`, `bf16`, sorted) its plugin layers' x inputs have, i.e.
    which cubins they launch. Every such node of `model` must have become a plugin layer
    (checked by count)."""
    from metrale.plugins.trt_plugin import KERNELS_OF_OP, act_of

    want = sum(1 for n in model.graph.node if n.domain == lw.DOMAIN and n.op_type in KERNELS_OF_OP)
    out: dict[str, set[str]] = {}
    found = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type != trt.LayerType.PLUGIN_V3:
            continue
        layer.__class__ = trt.IPluginV3Layer  # get_layer returns the base class
        op = layer.plugin.plugin_name
        if op in KERNELS_OF_OP:
            found += 1
            out.setdefault(op, set()).add(act_of(layer.get_input(0).dtype))
    if found != want:
        raise EngineBuildError(f"{what}: {want} metrale kernel nodes became {found} plugin layers")
    return {op: sorted(acts) for op, acts in sorted(out.items())}


def check_sms(tm: TrtModule, sms: tuple[int, ...], explicit: bool) -> tuple[int, ...]:
    """The SMs of `--target-sm` this flavour can build here; refuses (explicit) or skips (auto)."""
    can = tm.supported_sms()
    bad = [sm for sm in sms if sm not in can]
    if bad and explicit:
        raise ConfigError(
            f"--target-sm {','.join(map(str, sms))}: --trt-flavor {tm.flavor.value} cannot build for "
            f"SM {', '.join(map(str, bad))} here (it can build for: {', '.join(map(str, can)) or 'none'})")
    for sm in bad:
        log.warning("skipping SM%d: TensorRT %s cannot build for it here", sm, tm.flavor.value)
    return tuple(sm for sm in sms if sm in can)


def build_engine_bytes(tm: TrtModule, model: onnx.ModelProto, sm: int,
                       ranges: Mapping[str, tuple[int, int, int]], gio: ox.GraphIO,
                       what: str) -> tuple[bytes, dict[str, list[str]]]:
    """Parse the (SM-lowered) graph and build a serialized engine for `sm`; returns it with the
    kernel plugin layers' activation dtypes (`plugin_activations`)."""
    from metrale.plugins.trt_plugin import register_plugins

    trt = tm.trt
    logger = shared_logger(trt)  # TensorRT keeps the first logger: read this build's errors
    mark = logger.mark()
    plugins = register_plugins(trt, sm)  # held until the build ends
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString()):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineBuildError(f"{what}: TensorRT {tm.flavor.value} could not parse the ONNX graph "
                               f"for SM{sm}: {'; '.join(errors + logger.errors_since(mark))}")
    acts = plugin_activations(trt, network, model, what)
    config = builder.create_builder_config()
    if tm.flavor is TrtFlavor.RTX:
        config.num_compute_capabilities = 1
        config.set_compute_capability(rtx_compute_capabilities(trt)[sm], 0)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        axes = gio.dynamic.get(tensor.name, {})
        dims = list(tensor.shape)
        shapes = []
        for pick in range(3):  # min, opt, max
            shapes.append([ranges[axes[a]][pick] if a in axes else d for a, d in enumerate(dims)])
        profile.set_shape(tensor.name, *shapes)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    del plugins
    if serialized is None:
        raise EngineBuildError(f"{what}: TensorRT {tm.flavor.value} could not build for SM{sm}: "
                               f"{'; '.join(logger.errors_since(mark)) or 'no message'}")
    return bytes(serialized), acts


def save_onnx(model: onnx.ModelProto, path: Path) -> None:
    """Write `model`; past 2 GB (protobuf's limit) the weights go to `<name>.data` beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if model.ByteSize() < (1 << 31) - (1 << 26):
        onnx.save_model(model, str(path))
    else:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data")


# -- the build step ------------------------------------------------------------------------


def components_of(models) -> list[tuple[str, str, nn.Module]]:
    """(name, kind, module) for a LoadedEngine-like object: `.target`, `.mtp`, `.drafters`
    (a None target or head is skipped: building only some components); kinds from `.kinds`
    where it records them (name -> kind), else each role's one kind."""
    recorded = getattr(models, "kinds", {})
    by_role = {k.role: k.name for k in KINDS.values()}
    out = [("target", "target", models.target)] if models.target is not None else []
    if getattr(models, "mtp", None) is not None:
        out.append(("mtp", recorded.get("mtp", by_role[Role.HEAD]), models.mtp))
    out += [(name, recorded.get(name, by_role[Role.DRAFTER]), d)
            for name, d in getattr(models, "drafters", {}).items()]
    return out


def target_taps(models) -> tuple[int, ...]:
    """The target layer ids every drafter reads, in first-seen order (one `taps` output)."""
    taps: list[int] = []
    for d in getattr(models, "drafters", {}).values():
        taps += [i for i in d.config.target_layer_ids if i not in taps]
    return tuple(taps)


@dataclass
class StagedModels:
    """The torch models of components already written to a (staging) directory."""

    target: nn.Module
    mtp: nn.Module | None = None
    drafters: dict[str, nn.Module] = field(default_factory=dict)
    # tensor-parallel drafters: name -> the rank modules in rank order (drafters[name] is rank 0)
    drafter_ranks: dict[str, list[nn.Module]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # name -> its manifest kind


def load_staged(root: Path, components: Mapping, dtype=None) -> StagedModels:
    """Load `<name>/config.json` + `<name>/rank0.safetensors` for each name -> manifest entry
    (`ComponentEntry`) exactly as the torch backend would; a drafter of `tp_size` > 1 loads
    each rank's shard as `load_engine(tp=...)` does."""
    import json

    import torch
    from safetensors.torch import load_file

    from metrale.runtime.artifact.engine import fill_engine_state

    dtype = dtype or torch.float32
    staged = StagedModels(target=None)
    for name, info in components.items():
        kind = kind_of(info, f"component {name}")
        staged.kinds[name] = kind.name
        size = info.tp_size
        if kind.role is Role.DRAFTER and size > 1:
            from metrale.builder.tp_export import load_rank_drafters

            staged.drafter_ranks[name] = load_rank_drafters(root, name, size, dtype)
            staged.drafters[name] = staged.drafter_ranks[name][0]
            continue
        cfg = kind.parse(json.loads((root / name / "config.json").read_text()), f"{name}/config.json", info)
        tensors = load_file(str(root / name / "rank0.safetensors"))
        module = fill_engine_state(kind.build(cfg).to(dtype), tensors, f"{name}/rank0.safetensors")
        if kind.role is Role.TARGET:
            staged.target = module
        elif kind.role is Role.HEAD:
            staged.mtp = module
        else:
            staged.drafters[name] = module
    return staged


def export_and_build(writer, models, opts, progress: Callable[[str], None] = lambda msg: None,
                     profile: EngineProfile = EngineProfile()) -> dict[str, Any]:
    """The build step: ONNX graphs and engines into an open `EngineDirWriter` (`writer.path`),
    for `opts.trt_flavor` and `opts.target_sm` (a `BuildOptions`). See `write_engines`."""
    return write_engines(writer.path, models, flavor=opts.trt_flavor, target_sm=opts.target_sm,
                         profile=profile, progress=progress)


def write_engines(root: Path, models, *, flavor: str = "auto", target_sm=(89, 120),
                  profile: EngineProfile = EngineProfile(),
                  progress: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """Write every component's ONNX graph and engines under `root` (the staging directory).

    Returns {"trt_flavor", "trt_version", "target_sm" (built), "skipped_sm", "components":
    {name: {"onnx", "io", "files", "engines": {sm: {file, seconds, bytes, plugins, plugin_acts}},
    ...}}}:
    the manifest additions (every path relative to `root`).
    """
    tm = load_trt(flavor)
    explicit = TrtFlavor.parse(flavor) in (TrtFlavor.RTX, TrtFlavor.TENSORRT)
    sms = check_sms(tm, tuple(target_sm), explicit) if tm is not None else ()
    taps = target_taps(models)
    result: dict[str, Any] = {
        "trt_flavor": tm.flavor.value if tm else "none",
        "trt_version": tm.version if tm else None,
        "target_sm": list(sms),
        "skipped_sm": [sm for sm in target_sm if sm not in sms] if tm else list(target_sm),
        "components": {},
    }
    for name, kind, module in components_of(models):
        role = kind_named(kind).role
        ranks = getattr(models, "drafter_ranks", {}).get(name) if role is Role.DRAFTER else None
        if ranks:
            result["components"][name] = _write_rank_engines(tm, sms, root, name, kind, ranks, taps,
                                                              profile, progress)
            continue
        progress(f"exporting {name} to ONNX")
        tap_ids = taps if role is Role.TARGET else ()
        gio = ox.graph_io(kind, module, tap_ids)
        t0 = time.time()
        portable = ox.export_component(kind, module, taps=tap_ids)
        rel = f"{name}/rank0.onnx"
        save_onnx(portable, root / rel)
        files = [p.relative_to(root).as_posix() for p in sorted((root / name).glob("rank0.onnx*"))]
        info: dict[str, Any] = {
            "onnx": rel, "onnx_seconds": round(time.time() - t0, 3),
            "io": {"inputs": list(gio.inputs), "outputs": list(gio.outputs),
                   "dynamic": {k: {str(a): v for a, v in ax.items()} for k, ax in gio.dynamic.items()}},
            "plugin_ops": lw.metrale_ops(portable), "engines": {},
        }
        if role is Role.TARGET and taps:
            info["taps"] = list(taps)
        if role is Role.DRAFTER:
            info["tap_index"] = [taps.index(i) for i in module.config.target_layer_ids]
        ranges = profile.ranges(kind, module)
        info["profile"] = {k: list(v) for k, v in ranges.items() if k in gio.axis_labels()}
        for sm in sms:
            progress(f"building {name} engine for SM{sm} ({tm.flavor.value})")
            built = build_one(tm, portable, sm, kind, module, gio, ranges, root, name)
            info["engines"][str(sm)] = {"file": built.path.relative_to(root).as_posix(),
                                        "seconds": round(built.seconds, 3), "bytes": built.size,
                                        "plugins": built.plugin_ops,
                                        "plugin_acts": built.plugin_acts}
            files.append(built.path.relative_to(root).as_posix())
        info["files"] = files
        result["components"][name] = info
    return result


def _write_rank_engines(tm, sms, root: Path, name: str, kind: str, ranks: list[nn.Module], taps,
                        profile: EngineProfile, progress) -> dict[str, Any]:
    """A tensor-parallel drafter: per rank its graph, then per SM every rank's engine."""
    from metrale.builder import tp_export

    gio = tp_export.rank_graph_io(ranks[0])
    graphs, onnx_files, t0 = [], [], time.time()
    for r, module in enumerate(ranks):
        progress(f"exporting {name} rank {r} of {len(ranks)} to ONNX")
        graphs.append(tp_export.export_rank(module))
        onnx_files.append(f"{name}/rank{r}.onnx")
        save_onnx(graphs[-1], root / onnx_files[-1])
    ops = [lw.metrale_ops(g) for g in graphs]
    if any(o != ops[0] for o in ops):  # the ranks' collectives must pair up one to one
        raise EngineBuildError(f"component {name}: the rank graphs hold different metrale ops: {ops}")
    files = [p.relative_to(root).as_posix() for r in range(len(ranks))
             for p in sorted((root / name).glob(f"rank{r}.onnx*"))]
    ranges = profile.ranges(kind, ranks[0])
    info: dict[str, Any] = {
        "onnx": onnx_files[0], "onnx_ranks": onnx_files, "onnx_seconds": round(time.time() - t0, 3),
        "io": {"inputs": list(gio.inputs), "outputs": list(gio.outputs),
               "dynamic": {k: {str(a): v for a, v in ax.items()} for k, ax in gio.dynamic.items()}},
        "plugin_ops": ops[0], "tap_index": [taps.index(i) for i in ranks[0].config.target_layer_ids],
        "profile": {k: list(v) for k, v in ranges.items() if k in gio.axis_labels()}, "engines": {},
    }
    for sm in sms:
        entry: dict[str, Any] = {"plugins": None, "plugin_acts": None, "ranks": []}
        for r, (module, graph) in enumerate(zip(ranks, graphs)):
            progress(f"building {name} rank {r} engine for SM{sm} ({tm.flavor.value})")
            built = build_one(tm, graph, sm, kind, module, gio, ranges, root, name, rank=r)
            if entry["plugins"] not in (None, built.plugin_ops):
                raise EngineBuildError(f"component {name}: SM{sm} rank {r} holds plugin ops "
                                       f"{built.plugin_ops}, rank 0 {entry['plugins']}")
            entry["plugins"], entry["plugin_acts"] = built.plugin_ops, built.plugin_acts
            rel = built.path.relative_to(root).as_posix()
            entry["ranks"].append({"file": rel, "seconds": round(built.seconds, 3),
                                   "bytes": built.size})
            files.append(rel)
        info["engines"][str(sm)] = entry
    info["files"] = files
    return info


def build_one(tm: TrtModule, portable: onnx.ModelProto, sm: int, kind: str, module: nn.Module,
              gio: ox.GraphIO, ranges, root: Path, name: str, rank: int = 0) -> BuiltEngine:
    t0 = time.time()
    lowered = lw.lower_for_sm(portable, sm)
    data, acts = build_engine_bytes(tm, lowered, sm, ranges, gio, f"component {name} (rank {rank})")
    path = root / name / f"rank{rank}.sm{sm}.engine"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return BuiltEngine(path, sm, time.time() - t0, len(data), lw.metrale_ops(lowered), acts)
