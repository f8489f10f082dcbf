"""The `tensorrt` backend: an engine directory's TensorRT plans behind `graph_steps`' faces.

`load_trt_engine` returns the `LoadedEngine` whose target, MTP head and drafters are
`graph_steps.GraphTarget`, `GraphMTP` and `GraphDrafter` over one `trt_runner.EngineRunner`
each (the plan of this GPU's SM), with caches as torch CUDA tensors in the profile's opt and
max past sizes (see `graph_steps` for the step interface, chunking and the drafter's queue).

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

import logging
from pathlib import Path

import torch

from metrale.runtime.backends import resolve_backend
from metrale.runtime.backends.graph_steps import load_graph_engine
from metrale.runtime.backends.trt_runner import EngineRunner, gpu_sm, import_trt, pick_engine_sm
from metrale.runtime.artifact.engine import LoadedEngine
from metrale.runtime.errors import ConfigError, EngineDirError

log = logging.getLogger(__name__)


def load_trt_engine(engine_dir: str | Path, *, device: str | torch.device = "cuda",
                    graphs: bool = True) -> LoadedEngine:
    """Verify the directory and load every component's engine for this GPU's SM."""
    from metrale.plugins.trt_plugin import KernelLibrary, plugin_kernel_keys, register_plugins
    from metrale.runtime.artifact.tokenizer import Tokenizer

    from metrale.runtime.artifact.engine import check_engine_dir

    resolve_backend("tensorrt", str(device))
    path = Path(engine_dir)
    manifest = check_engine_dir(path)
    dev = torch.device(device)
    dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    comps = manifest.components
    sharded = sorted(n for n, c in comps.items() if c.tp_size > 1)
    if sharded:
        raise ConfigError(
            f"--backend tensorrt: engine directory {path} holds tensor-parallel drafter engines "
            f"({', '.join(sharded)}, built with --draft-tp-size > 1), which this backend does not run; "
            "rebuild with --draft-tp-size 1 or use --backend torch")
    sm = pick_engine_sm({n: c.engines for n, c in comps.items()}, gpu_sm(dev), path)
    flavor = manifest.build.get("trt_flavor")
    trt = import_trt(flavor, path)
    with torch.cuda.device(dev):
        stream = torch.cuda.Stream(dev)
        plugins = None
        entries = [c.engines[str(sm)] for c in comps.values()]
        if any(e.plugins for e in entries):
            try:
                library = KernelLibrary.from_dir(path / "plugins")
                missing = library.missing(plugin_kernel_keys([(e.plugins, e.plugin_acts) for e in entries], sm))
            except (OSError, ValueError, KeyError) as exc:
                raise EngineDirError(f"engine directory {path}: plugins/ cannot be read ({exc})") from None
            if missing:  # refused now, not at the first launch mid-request
                raise EngineDirError(f"engine directory {path}: plugins/ has no kernel "
                                     f"{', '.join(missing)} for the SM{sm} engines' plugin layers; "
                                     "rebuild the directory")
            plugins = register_plugins(trt, sm, library)  # before deserializing plugin layers

        def runner(name: str) -> EngineRunner:
            rel = comps[name].engines[str(sm)].file
            what = f"engine directory {path}: {rel}"
            return EngineRunner(trt, flavor, (path / rel).read_bytes(), what, dev, stream, graphs)

        loaded = load_graph_engine(path, manifest, Tokenizer.from_dir(path / "tokenizer"), runner, dev)
        loaded.backend = "tensorrt"
        target = loaded.target
    # the plugin creators must outlive every engine holding plugin layers
    target.keep_alive = (plugins, stream)
    log.info("loaded %s for SM%d (TensorRT %s)", path, sm, flavor)
    return loaded


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
