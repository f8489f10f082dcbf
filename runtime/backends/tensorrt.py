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

Tensor-parallel drafters (`--draft-tp-size N` builds): a world of N ranks (`--nproc N`, one GPU
each) runs them, each rank its own drafter engine (`plan_file`), whose AllReduce / AllGather
plugin layers use an NCCL communicator made from the process group, beside the one-rank target
and head engines that every rank runs alike (`world_plan` refuses any other pairing).

Precision: the engines compute in the dtype they were built with (the ONNX graphs' dtype:
`metrale build --trt-dtype`, bfloat16 by default); `--dtype auto` takes it, and another
explicit `--dtype` is refused naming both (`builder.requantize.check_plans`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from metrale.runtime.backend_registry import BACKENDS
from metrale.runtime.backends import resolve_backend
from metrale.runtime.backends.graph_steps import load_graph_engine
from metrale.runtime.backends.trt_runner import EngineRunner, gpu_sm, import_trt, pick_engine_sm
from metrale.runtime.artifact.engine import LoadedEngine
from metrale.runtime.errors import ConfigError, EngineDirError

log = logging.getLogger(__name__)


def world_plan(components, tp, path) -> tuple[int, int]:
    """(rank, size) this process loads the engines of: (0, 1) alone; under a tensor-parallel
    world (`tp`: rank, size), every tensor-parallel drafter must have been built for exactly
    that many ranks (each rank runs its own drafter engine, whose collectives span the world,
    beside the one-rank target and head engines, which every rank runs alike)."""
    sharded = {n: c.tp_size for n, c in components.items() if c.tp_size > 1}
    if tp is None:
        if sharded:
            raise ConfigError(
                f"--backend tensorrt: engine directory {path} holds tensor-parallel drafter engines "
                f"({', '.join(f'{n}: {k} ranks' for n, k in sorted(sharded.items()))}); run them "
                f"with --nproc {max(sharded.values())} (one GPU per rank)")
        return 0, 1
    wrong = {n: k for n, k in sharded.items() if k != tp.size}
    if not sharded or wrong:
        built = ", ".join(f"{n}: {k} ranks" for n, k in sorted((wrong or sharded).items()))
        raise ConfigError(
            f"--backend tensorrt on {tp.size} ranks: engine directory {path} has "
            f"{'no tensor-parallel drafter engines' if not sharded else 'drafter engines of ' + built}; "
            f"the TensorRT engines of a world of {tp.size} are a --draft-tp-size {tp.size} build")
    return tp.rank, tp.size


def plan_file(plan, rank: int) -> str:
    """The engine file of `rank` in one SM's plan entry (a one-rank plan: its one file)."""
    files = plan.plan_files()
    return files[rank] if len(files) > 1 else files[0]


def load_trt_engine(engine_dir: str | Path, *, device: str | torch.device = "cuda",
                    graphs: bool = True, tp=None) -> LoadedEngine:
    """Verify the directory and load every component's engine for this GPU's SM (this rank's
    engine for a tensor-parallel drafter, `tp` the world's rank and size: see `world_plan`)."""
    from metrale.plugins.trt_plugin import KernelLibrary, plugin_kernel_keys, register_plugins
    from metrale.runtime.artifact.tokenizer import Tokenizer

    from metrale.runtime.artifact.engine import check_engine_dir

    resolve_backend("tensorrt", str(device))
    path = Path(engine_dir)
    manifest = check_engine_dir(path)
    dev = torch.device(device)
    dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    comps = manifest.components
    rank, size = world_plan(comps, tp, path)
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
            comm = None
            if size > 1:  # the drafter engines' AllReduce / AllGather plugin layers
                from metrale.plugins.trt_collectives import NcclCommunicator

                comm = NcclCommunicator.from_process_group()
            plugins = register_plugins(trt, sm, library, comm)  # before deserializing plugin layers

        def runner(name: str) -> EngineRunner:
            rel = plan_file(comps[name].engines[str(sm)], rank)
            what = f"engine directory {path}: {rel}"
            return EngineRunner(trt, flavor, (path / rel).read_bytes(), what, dev, stream, graphs)

        loaded = load_graph_engine(path, manifest, Tokenizer.from_dir(path / "tokenizer"), runner, dev,
                                   BACKENDS["tensorrt"], rank=rank)
        target = loaded.target
    # the plugin creators must outlive every engine holding plugin layers
    target.keep_alive = (plugins, stream)
    log.info("loaded %s for SM%d (TensorRT %s%s)", path, sm, flavor,
             f", rank {rank} of {size}" if size > 1 else "")
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
