"""The `onnxruntime` backend: the engine directory's exported ONNX graphs (`<component>/rank0.onnx`,
the very graphs TensorRT compiles) run the whole speculative loop on a CPU.

Each component's portable graph is rewritten for onnxruntime's CPU kernels at load
(`plugins.onnx_lowering.lower_for_onnxruntime`: FP8 linears as DequantizeLinear + MatMul, NVFP4
weights dequantized once through `formats`, a bfloat16 graph widened to float32, exactly) and
driven by `graph_steps`' faces through an `OrtRunner`, so prompt chunking, the drafter's context
queue and the cache protocol are the tensorrt backend's. It computes in float32 (onnxruntime has
no bfloat16 CPU math), with one session per component on `torch.get_num_threads()` threads.
Caches are CPU tensors whose slot count doubles from 64 as a sequence grows (attention runs over
the whole cache, masked), up to the graph profile's max past.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from metrale.runtime.backend_registry import BACKENDS
from metrale.runtime.backends import resolve_backend
from metrale.runtime.backends.graph_steps import load_graph_engine
from metrale.runtime.artifact.engine import LoadedEngine
from metrale.runtime.errors import ConfigError, EngineDirError

log = logging.getLogger(__name__)

FIRST_SLOTS = 64  # a cache's first size; each next size doubles it

_TORCH_TYPES = {"tensor(float)": torch.float32, "tensor(int64)": torch.int64,
                "tensor(bool)": torch.bool, "tensor(int32)": torch.int32}


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError("--backend onnxruntime needs the onnxruntime package: pip install "
                          "'metrale[onnxruntime]' (or onnxruntime)") from None
    return onnxruntime


class OrtRunner:
    """A `graph_steps.GraphRunner` over one onnxruntime session (CPU)."""

    def __init__(self, model, what: str, threads: int | None = None):
        ort = import_onnxruntime()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3  # warnings about unused initializers are not the user's
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), opts,
                                                providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise EngineDirError(f"{what}: onnxruntime cannot load the graph ({exc})") from None
        io = [*self.session.get_inputs(), *self.session.get_outputs()]
        unknown = [(v.name, v.type) for v in io if v.type not in _TORCH_TYPES]
        if unknown:
            raise EngineDirError(f"{what}: {unknown[0][0]} is of type {unknown[0][1]}, which the "
                                 "onnxruntime backend does not feed")
        self.dtypes = {v.name: _TORCH_TYPES[v.type] for v in io}
        self.inputs = [v.name for v in self.session.get_inputs()]
        self.outputs = [v.name for v in self.session.get_outputs()]
        self.device = torch.device("cpu")
        self.stats = SimpleNamespace(runs=0)

    @staticmethod
    def past_sizes(opt: int, top: int) -> list[int]:
        sizes, s = [], min(FIRST_SLOTS, top)
        while s < top:
            sizes.append(s)
            s *= 2
        return sizes + [top]

    def run(self, feeds: dict[str, torch.Tensor], graph_key=None, persistent=()) -> dict[str, torch.Tensor]:
        # numpy views of the tensors (no copies); the cache is read whole, never written here
        arrays = {n: feeds[n].detach().contiguous().numpy() for n in self.inputs}
        outs = self.session.run(self.outputs, arrays)
        self.stats.runs += 1
        return {n: torch.from_numpy(o) for n, o in zip(self.outputs, outs)}

    def close(self) -> None:
        self.session = None


def ort_graph(path: Path, name: str, info: dict):
    """Component `name`'s portable graph, lowered for onnxruntime."""
    import onnx

    from metrale.plugins.onnx_lowering import lower_for_onnxruntime

    where = f"engine directory {path}"
    rel = info.onnx
    if not rel:
        raise EngineDirError(f"{where}: component {name} has no ONNX graph (built with onnx = false); "
                             "rebuild it with metrale build to run --backend onnxruntime")
    if info.tp_size > 1:
        raise ConfigError(f"--backend onnxruntime: {where}: drafter {name} was built with "
                          f"--draft-tp-size {info.tp_size}; its rank graphs need torch.distributed "
                          "(use --backend torch) or rebuild with --draft-tp-size 1")
    try:
        model = onnx.load(str(path / rel))
        return lower_for_onnxruntime(model, f"{where}: {rel}")
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError among others
        raise EngineDirError(f"{where}: {rel} cannot be read as an ONNX graph ({exc})") from None


def load_ort_engine(engine_dir: str | Path, *, threads: int | None = None) -> LoadedEngine:
    """Verify the directory and load every component's graph into an onnxruntime session."""
    from metrale.runtime.artifact.engine import check_engine_dir
    from metrale.runtime.artifact.tokenizer import Tokenizer

    resolve_backend("onnxruntime", "cpu")
    import_onnxruntime()
    path = Path(engine_dir)
    manifest = check_engine_dir(path)
    comps = manifest.components

    def runner(name: str) -> OrtRunner:
        return OrtRunner(ort_graph(path, name, comps[name]),
                         f"engine directory {path}: {comps[name].onnx}", threads)

    loaded = load_graph_engine(path, manifest, Tokenizer.from_dir(path / "tokenizer"), runner,
                               torch.device("cpu"), BACKENDS["onnxruntime"])
    log.info("loaded %s into onnxruntime", path)
    return loaded
