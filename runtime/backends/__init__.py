"""Backends: what runs the decode loop's three steps for an engine directory.

The decode loop (`spec.decode`) and the proposers (`spec.mtp_proposer`, `spec.dflash_proposer`)
call three faces and nothing else; every backend gives each component one of them (`TargetSteps`, `MTPSteps`,
`DrafterSteps` below, the protocol), in a `LoadedEngine`:

    backend       target                  MTP head / drafters        runs
    torch         the eager model         the eager models           safetensors, CPU or GPU
    aoti          aoti_batched target     aoti_batched head, drafters the CPU packages (.pt2)
    cuda-graphs   cuda_graphs target      the eager models           the eager model, captured
    onnxruntime   graph_steps.GraphTarget GraphMTP / GraphDrafter    the ONNX graphs, on a CPU
    tensorrt      graph_steps.GraphTarget GraphMTP / GraphDrafter    the TensorRT plans, on a GPU

onnxruntime and tensorrt run the same exported step graphs (`builder.onnx_export`'s interface),
so one set of faces (`graph_steps`) serves both, over a `GraphRunner` each (`onnxruntime.OrtRunner`,
`trt_runner.EngineRunner`). `--backend auto` takes aoti on a CPU whose packages fit (else eager
torch) and CUDA graphs on a GPU.
"""

from __future__ import annotations

from typing import Protocol

import torch

from metrale.runtime.backend_registry import BACKENDS
from metrale.runtime.errors import ConfigError, FlagChoice
from metrale.runtime.models.kv_cache import KVCache
from metrale.runtime.models.step_caches import TreeKV
from metrale.runtime.steps import BatchedFace, run_each


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of logits [N, V] (the first of equal maxima, as torch's), as ids. A
    float32 CPU tensor goes through numpy's vectorized argmax: torch's CPU argmax tracks an
    index per element, many times slower over a batch's rows."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def run_forwards(target, needs: list) -> list:
    """Each model step's output, in order (`steps`): the target's `Forward`s on `target`, every
    other step on its own face; a `BatchedFace` runs all of its steps in one call (the aoti
    backend's `aoti_batched` faces, a graph target's lanes), any other face one step after
    another. The batched calls go last: where a step fails, the scheduler runs every step again
    alone, and a batched call that had already run (a lanes' replay moves every lane on) would
    have run twice."""
    out: list = [None] * len(needs)
    groups: dict[int, tuple[object, list[int]]] = {}
    for i, need in enumerate(needs):
        face = need.face
        if face is None:
            face = target
        groups.setdefault(id(face), (face, []))[1].append(i)
    for face, members in sorted(groups.values(), key=lambda g: isinstance(g[0], BatchedFace)):
        mine = [needs[i] for i in members]
        if isinstance(face, BatchedFace):
            results = face.forward_many(mine)
        elif face is target:
            results = [target(f.ids, f.cache, taps=f.taps) if f.tree is None else tree_forward(target, f)
                       for f in mine]
        else:
            results = run_each(mine)
        for i, r in zip(members, results):
            out[i] = r
    return out


class TreeRows:
    """A compiled target face that runs a draft tree's rows in one forward itself
    (`forward_tree(f)` of a `Forward` with its `tree`; `tree_rows`: whether it can)."""

    tree_rows = False

    def forward_tree(self, f):
        raise NotImplementedError


def tree_forward(target, f):
    """A draft tree's rows (`Forward.tree`) in one forward: a `TreeRows` face's own, or the
    eager model over its `KVCache`, as `step_caches.TreeKV` places and masks them."""
    if isinstance(target, TreeRows) and target.tree_rows:
        return target.forward_tree(f)
    if not isinstance(f.cache, KVCache):
        raise TypeError(f"a draft tree's rows in one forward need the eager target's KVCache, not "
                        f"{type(f.cache).__name__} (a backend without tree attention walks paths)")
    return target(f.ids, TreeKV(f.cache, f.tree), taps=f.taps)


class TargetSteps(Protocol):
    """The target: `config` (its `DecoderConfig`, `max_position_embeddings` = usable context),
    `model.embed_tokens` (the drafters and the head embed with it), `dtype`. A target that is a
    `steps.BatchedFace` runs the rows of many sequences' `Forward`s in one call (`run_forwards`)."""

    def new_cache(self, batch: int, max_len: int): ...

    def __call__(self, ids: torch.Tensor, cache, start: int | None = None, taps: tuple[int, ...] = ()):
        """ids [1, T] at positions start.. (default cache.length) -> `TargetOutput` (logits
        [1, T, V], last_hidden [1, T, H], taps [1, T, n·H] of the `taps` layers or None); the
        cache's length becomes start + T."""


class MTPSteps(Protocol):
    """The MTP head: `config` (`.decoder` its `DecoderConfig`). A head that is a
    `steps.BatchedFace` runs the entries of many sequences' `HeadForward`s in one call."""

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None): ...

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, cache, start: int | None = None):
        """embeds, hidden [1, T, H] at positions start.. -> (logits [1, T, V], h [1, T, H] pre-norm)."""


class DrafterSteps(Protocol):
    """A DFlash/DFlash2 drafter: `config` (its `DFlashConfig`). A drafter that is a
    `steps.BatchedFace` proposes the blocks of many sequences' `DraftForward`s in one call."""

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None): ...

    def add_context(self, features: torch.Tensor, cache) -> None:
        """Features [1, C, n·Ht] (target taps) of the next C accepted positions."""

    def propose(self, anchor: torch.Tensor, embed, cache, gamma: int, tree_nodes: int = 0):
        """anchor [1] (the last accepted token) -> `dflash.Proposal` of γ−1 drafts. `tree_nodes`: the
        nodes of a draft tree to be built from the block (0: none); a face whose logits are a
        vocabulary slice then gathers every slot's global top candidates for it with the
        propose's own (`Proposal.top`), a face of the whole vocabulary gives its logits."""


class Backend(FlagChoice):
    AUTO = "auto"  # aoti on a CPU with fitting packages, CUDA graphs on a GPU, else torch
    TORCH = "torch"
    AOTI = "aoti"
    ONNXRUNTIME = "onnxruntime"
    TENSORRT = "tensorrt"

    @classmethod
    def flag(cls) -> str:
        return "--backend"

    @property
    def runs_graphs(self) -> bool:
        """Runs the engine directory's exported step graphs (not its safetensors)."""
        return self in (Backend.ONNXRUNTIME, Backend.TENSORRT)


def resolve_backend(backend: str, device: str | None, dtype: str = "float32",
                    nproc: int | None = None, cuda_available: bool | None = None) -> tuple[Backend, str]:
    """Check `--backend` against `--device`, `--dtype` and `--nproc` before anything loads;
    returns the backend and the device (default: cpu, cuda for tensorrt)."""
    b = Backend.parse(backend)
    if b in (Backend.TORCH, Backend.AUTO):
        return b, device or "cpu"
    if b in (Backend.AOTI, Backend.ONNXRUNTIME):
        device = device or "cpu"
        runs = "the engine's CPU packages" if b is Backend.AOTI else "the engine's ONNX graphs on a CPU"
        if torch.device(device).type != "cpu":
            raise ConfigError(f"--backend {b.value} runs {runs}; --device {device} is not a CPU "
                              "(use --backend torch there)")
        if b is Backend.ONNXRUNTIME:
            if dtype not in ("auto", "float32"):
                raise ConfigError(f"--backend onnxruntime computes in float32 (onnxruntime's CPU "
                                  f"kernels have no bfloat16 math); --dtype {dtype} is not allowed "
                                  "with it (use auto or float32)")
            if nproc is not None and nproc > 1:
                raise ConfigError(f"--nproc {nproc}: the onnxruntime backend runs one process; use "
                                  "--backend torch for tensor parallelism")
        return b, device
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        raise ConfigError("--backend tensorrt runs TensorRT engines on an NVIDIA GPU, and CUDA is "
                          "not available here; use --backend auto (the default) or torch")
    device = device or "cuda"
    if torch.device(device).type != "cuda":
        raise ConfigError(f"--backend tensorrt needs --device cuda or cuda:N, got --device {device}")
    return b, device  # --nproc N: the ranks of a --draft-tp-size N build (`tensorrt.world_plan`)


def engine_rope_tables(engine) -> None:
    """The shared rotary tables (`rotary.rope_tables`) of every decoder of `engine` (target,
    drafters, MTP head) in its dtype on its device: what its GPU steps gather from."""
    from metrale.runtime.models.rotary import rope_tables

    rope_tables([engine.target.config, *(m.config.decoder for m in engine.drafters.values()),
                 *([engine.mtp.config.decoder] if engine.mtp is not None else [])], engine.dtype, engine.device)


def load_engine(engine_dir, *, backend: str | Backend = "torch", dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", components: tuple[str, ...] | None = None,
                tp=None, states: dict | None = None):
    """Verify an engine directory and load it for `backend` -> `LoadedEngine`.

    torch: the eager models (`engine.load_models`). aoti: their target, MTP head and one-rank
    drafters swapped for the directory's CPU packages (refused when none fit this process). auto:
    aoti on a CPU where it can, the target's steps replayed as CUDA graphs on a CUDA device, eager
    torch otherwise (`backend_note` says why). onnxruntime, tensorrt: the directory's graphs
    (`graph_steps`; the built weights, so `components` and `states` must be unset; `tp`
    only for tensorrt, whose tensor-parallel drafter engines run one per rank). `states`: weights requantized at load (see `builder.requantize`)."""
    from metrale.runtime.artifact.engine import load_models

    b = Backend.parse(backend) if isinstance(backend, str) else backend
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        # events, current-stream syncs and Triton launches follow the current device
        torch.cuda.set_device(dev)
    if b.runs_graphs:
        if states or (tp is not None and b is not Backend.TENSORRT):
            raise ConfigError(f"--backend {b.value} runs the graphs of the built weights on one rank")
        if b is Backend.TENSORRT:
            from metrale.runtime.backends.tensorrt import load_trt_engine

            return load_trt_engine(engine_dir, device=dev, tp=tp)
        from metrale.runtime.backends.onnxruntime import load_ort_engine

        return load_ort_engine(engine_dir)
    engine = load_models(engine_dir, dtype=dtype, device=dev, components=components, tp=tp,
                         states=states)
    kernels = ""
    if dev.type == "cuda":  # the eager models' small ops as one launch each, where they check out
        from metrale.runtime.backends.step_check import prepare

        kernels = prepare(dev, engine.dtype)
        engine_rope_tables(engine)
    if b is Backend.AOTI or (b is Backend.AUTO and dev.type != "cuda"):
        from metrale.runtime.backends import aoti

        aoti.use_cpu_packages(engine, engine.manifest.components["target"], b is Backend.AOTI)
        if engine.backend is BACKENDS["aoti"]:
            aoti.use_cpu_drafters(engine, b is Backend.AOTI)
    elif b is Backend.AUTO:
        from metrale.runtime.backends.cuda_graphs import use_cuda_graphs

        use_cuda_graphs(engine)  # after the drafters: their taps are captured with the steps
    if kernels:
        engine.backend_note = "; ".join(n for n in (engine.backend_note, kernels) if n)
    return engine
