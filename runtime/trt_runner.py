"""Running one TensorRT engine from PyTorch: import, SM choice, eager execution and CUDA graphs.

The serving side of the engines `metrale build` writes. Nothing here imports TensorRT (or the
builder) at module import time: `import_trt(flavor)` imports `tensorrt_rtx` (`rtx`) or
`tensorrt` (`tensorrt`) on demand, the flavour being the one the manifest says built the engines.

`pick_engine_sm` is the pure rule for which engine file a GPU runs: an engine runs only on the
SM it was built for (TensorRT-RTX and full TensorRT alike), so the GPU's SM must be built for
every component; anything else is refused naming the engine directory and the SMs it has.

`EngineRunner` owns one deserialized engine:
- eager execution (`run(feeds)`): every input's shape is set on the context (the engines have one
  optimization profile, index 0), every input and output is bound by address as a torch CUDA
  tensor (`set_tensor_address`), and `execute_async_v3` runs on the runner's CUDA stream, ordered
  after and before the caller's current stream (`wait_stream` both ways), so callers use plain
  torch ops on the outputs;
- CUDA graphs (`run(feeds, graph_key=..., persistent=...)`): a fixed-shape call is captured once
  per key with `torch.cuda.graph` and replayed afterwards. Each graph gets an execution context of
  its own that nothing else ever touches (a captured graph is valid only for the shapes and
  addresses bound at capture, so no later call may change them); the graph contexts share one
  activation buffer (`USER_MANAGED`), safe because every call is serialized on one stream.
  Inputs named in `persistent` (the KV caches) are bound by address and must be the same tensors
  at replay; the others are copied into the graph's static buffers. Outputs are cloned out of the
  static buffers, so a caller may keep them across calls. Before capture the context runs twice
  eagerly (TensorRT flushes deferred shape updates and, on TensorRT-RTX, compiles its
  shape-specialized kernels: the graph contexts use the EAGER specialization so no kernel is
  swapped in after capture). A context TensorRT reports as not stream-capturable, or a failed
  capture, turns graphs off for that runner (logged; on TensorRT-RTX the eager context then uses
  its built-in CUDA graphs) and every call runs eagerly: the results are the same either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Iterable, Mapping

import torch

from metrale.runtime.errors import ConfigError, EngineDirError

log = logging.getLogger(__name__)

FLAVOR_MODULES = {"rtx": "tensorrt_rtx", "tensorrt": "tensorrt"}
INSTALL_HINTS = {"rtx": "pip install tensorrt-rtx-cu13==1.7.1.116",
                 "tensorrt": "install NVIDIA's tensorrt package for this CUDA version"}
MAX_GRAPHS = 32  # per engine: bounds the contexts (and captures) one runner may hold


# -- choosing and importing ------------------------------------------------------------------


def pick_engine_sm(engines: Mapping[str, Iterable], gpu_sm: int, engine_dir: str | Path) -> int:
    """The SM whose engine files to load: `gpu_sm` when every component has an engine for it.

    `engines` maps a component name to the SMs it has engines for (manifest keys, str or int).
    """
    have = {name: sorted(int(sm) for sm in sms) for name, sms in engines.items()}
    if not have:
        raise EngineDirError(f"engine directory {engine_dir}: no components to run")
    empty = sorted(name for name, sms in have.items() if not sms)
    if len(empty) == len(have):
        raise EngineDirError(
            f"engine directory {engine_dir} holds no TensorRT engines (built with --trt-flavor "
            f"none); rebuild it with --trt-flavor rtx|tensorrt --target-sm {gpu_sm}, or use "
            "--backend torch")
    missing = sorted(name for name, sms in have.items() if gpu_sm not in sms)
    if missing:
        built = sorted(set().union(*map(set, have.values())))
        raise EngineDirError(
            f"engine directory {engine_dir} has no TensorRT engine for this GPU's SM{gpu_sm} "
            f"(component {missing[0]} has engines for SM "
            f"{', '.join(map(str, have[missing[0]])) or 'none'}; the directory has SM "
            f"{', '.join(map(str, built))}); rebuild it with --target-sm {gpu_sm}, or use "
            "--backend torch")
    return gpu_sm


def gpu_sm(device: torch.device) -> int:
    """The SM of a CUDA device (89 for compute capability 8.9)."""
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _ensure_rtx_soname_link() -> None:
    """The TensorRT-RTX libs wheel ships only `libtensorrt_rtx.so.1`, and a plugin lookup dlopens
    `libtensorrt_rtx.so` (a failed dlopen ends the process): add the link when it is missing."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = Path(next(iter(spec.submodule_search_locations)))
    link, versioned = folder / "libtensorrt_rtx.so", folder / "libtensorrt_rtx.so.1"
    if link.exists() or not versioned.exists():
        return
    try:
        if link.is_symlink():  # dangling
            link.unlink()
        os.symlink(versioned.name, link)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"TensorRT-RTX: {link} is missing and cannot be created ({exc}); create "
                          f"it once with: ln -s {versioned.name} {link}") from None


def import_trt(flavor: str, engine_dir: str | Path) -> ModuleType:
    """The TensorRT module that runs engines built by `flavor` (the manifest's `trt_flavor`)."""
    if flavor not in FLAVOR_MODULES:
        raise EngineDirError(f"engine directory {engine_dir}: build.trt_flavor is {flavor!r}; "
                             f"the tensorrt backend runs engines built by {', '.join(FLAVOR_MODULES)}")
    name = FLAVOR_MODULES[flavor]
    if importlib.util.find_spec(name) is None:
        raise ConfigError(f"--backend tensorrt: the engines of {engine_dir} were built by TensorRT "
                          f"{flavor} and the `{name}` module is not installed ({INSTALL_HINTS[flavor]})")
    if flavor == "rtx":
        _ensure_rtx_soname_link()
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as exc:
        raise ConfigError(f"--backend tensorrt: `{name}` is installed but does not import ({exc})") from None


def torch_dtype(trt: ModuleType, dt) -> torch.dtype:
    """torch dtype of a TensorRT DataType member (the I/O types metrale's graphs use)."""
    table = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16,
             "INT32": torch.int32, "INT64": torch.int64, "INT8": torch.int8, "UINT8": torch.uint8,
             "BOOL": torch.bool}
    for name, dtype in table.items():
        if getattr(trt.DataType, name, None) == dt:
            return dtype
    raise EngineDirError(f"TensorRT tensor type {dt} has no torch equivalent here")


def collecting_logger(trt: ModuleType):
    """A TensorRT logger that keeps error messages (`.errors`) and sends the rest to logging."""
    class Collect(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.debug("TensorRT warning: %s", msg)

    return Collect()


# -- running ---------------------------------------------------------------------------------


@dataclass
class _Graph:
    context: object
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static input buffers (persistent ones are the callers')
    outputs: dict[str, torch.Tensor]  # static output buffers
    persistent: frozenset[str]


@dataclass
class RunnerStats:
    eager_runs: int = 0
    graph_replays: int = 0
    graph_captures: int = 0
    graph_mode: str = "manual"  # "manual", "rtx-native" or "off: <reason>"
    notes: list[str] = field(default_factory=list)


class EngineRunner:
    """One engine on one CUDA device; see the module docstring for the execution contract."""

    def __init__(self, trt: ModuleType, flavor: str, data: bytes, what: str, device: torch.device,
                 stream: torch.cuda.Stream, graphs: bool = True):
        self.trt, self.flavor, self.what, self.device, self.stream = trt, flavor, what, device, stream
        self.logger = collecting_logger(trt)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise EngineDirError(f"{what}: TensorRT {flavor} could not deserialize it: "
                                 f"{'; '.join(self.logger.errors) or 'no message'}")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtypes = {n: torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        host = [n for n in self.inputs if self.engine.is_shape_inference_io(n)]
        if host:  # metrale's graphs read no input on the host; one that does needs another binding
            raise EngineDirError(f"{what}: input {host[0]} is a shape tensor; the engine does not "
                                 "follow metrale's graph interface")
        self.stats = RunnerStats()
        self.graphs_on = graphs
        if not graphs:
            self.stats.graph_mode = "off: disabled"
        self._configs: list = []  # runtime configs outlive their contexts
        self._jit_cache = None  # TensorRT-RTX's runtime cache, shared by this engine's contexts
        self._eager = self._new_context(graph=False, native=False)
        self._graphs: dict[object, _Graph] = {}
        self._scratch: torch.Tensor | None = None

    def _new_context(self, graph: bool, native: bool):
        trt, engine = self.trt, self.engine
        user = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        if self.flavor == "rtx":
            cfg = engine.create_runtime_config()
            cfg.cuda_graph_strategy = (trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE if native
                                       else trt.CudaGraphStrategy.DISABLED)
            if graph:
                cfg.dynamic_shapes_kernel_specialization_strategy = \
                    trt.DynamicShapesKernelSpecializationStrategy.EAGER
                cfg.set_execution_context_allocation_strategy(user)
            if self._jit_cache is None:  # one cache of JIT-compiled kernels for all contexts
                self._jit_cache = cfg.create_runtime_cache()
            cfg.set_runtime_cache(self._jit_cache)
            self._configs.append(cfg)
            ctx = engine.create_execution_context(cfg)
        elif graph:
            ctx = engine.create_execution_context(user)
        else:
            ctx = engine.create_execution_context()
        if ctx is None:
            raise EngineDirError(f"{self.what}: TensorRT could not create an execution context: "
                                 f"{'; '.join(self.logger.errors) or 'no message'}")
        if graph:
            scratch = self._shared_scratch()
            if hasattr(ctx, "set_device_memory"):
                ctx.set_device_memory(scratch.data_ptr(), scratch.numel())
            else:  # TensorRT 10.0
                ctx.device_memory = scratch.data_ptr()
        return ctx

    def _shared_scratch(self) -> torch.Tensor:
        if self._scratch is None:
            size = getattr(self.engine, "device_memory_size_v2", None)
            size = self.engine.device_memory_size if size is None else size
            # torch's allocations are 512-byte aligned; TensorRT asks for 256
            self._scratch = torch.empty(max(int(size), 1), dtype=torch.uint8, device=self.device)
        return self._scratch

    # -- eager ----------------------------------------------------------------------------
    def _as_input(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtypes[name]).contiguous()

    def _bind(self, ctx, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Set every input's shape and address, allocate and bind every output."""
        for name in self.inputs:
            t = feeds[name]
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise ValueError(f"{self.what}: input {name} of shape {list(t.shape)} is outside "
                                 f"the engine's optimization profile "
                                 f"{[list(s) for s in self.engine.get_tensor_profile_shape(name, 0)]}")
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            assert all(d >= 0 for d in shape), f"{self.what}: output {name} shape {shape} unresolved"
            outs[name] = torch.empty(shape, dtype=self.dtypes[name], device=self.device)
            ctx.set_tensor_address(name, outs[name].data_ptr())
        return outs

    def _enqueue(self, ctx) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # inputs written on the caller's stream come first
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"{self.what}: TensorRT execution failed: "
                               f"{'; '.join(self.logger.errors[-3:]) or 'no message'}")
        current.wait_stream(self.stream)  # the caller's next ops see the outputs

    def run(self, feeds: Mapping[str, torch.Tensor], graph_key=None,
            persistent: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        """Outputs by name for `feeds` (every input by name). With a `graph_key` the call is
        replayed from the CUDA graph captured for that key (captured on first use)."""
        with torch.cuda.device(self.device):  # TensorRT works on the current device
            feeds = {name: self._as_input(name, feeds[name]) for name in self.inputs}
            if graph_key is not None and self.graphs_on:
                g = self._graphs.get(graph_key)
                if g is None:
                    g = self._capture(graph_key, feeds, frozenset(persistent))
                if g is not None:
                    return self._replay(g, feeds)
            outs = self._bind(self._eager, feeds)
            self._enqueue(self._eager)
            self.stats.eager_runs += 1
            return outs

    # -- graphs ---------------------------------------------------------------------------
    def _capture(self, key, feeds: dict[str, torch.Tensor], persistent: frozenset[str]) -> _Graph | None:
        if len(self._graphs) >= MAX_GRAPHS:
            return None
        try:
            ctx = self._new_context(graph=True, native=False)
            static = {n: (t if n in persistent else t.clone()) for n, t in feeds.items()}
            outs = self._bind(ctx, static)
            for _ in range(2):  # flush deferred updates; JIT the specialized kernels
                self._enqueue(ctx)
            torch.cuda.synchronize(self.device)
            capturable = getattr(ctx, "is_stream_capturable", None)
            if capturable is not None and not capturable(self.stream.cuda_stream):
                self._graphs_off("TensorRT reports the context as not stream-capturable")
                return None
            graph = torch.cuda.CUDAGraph()
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                ok = ctx.execute_async_v3(self.stream.cuda_stream)
            if not ok:
                raise RuntimeError(f"execute_async_v3 failed under capture: "
                                   f"{'; '.join(self.logger.errors[-3:]) or 'no message'}")
        except RuntimeError as exc:
            self._graphs_off(f"capture failed ({exc})")
            return None
        g = _Graph(ctx, graph, static, outs, persistent)
        self._graphs[key] = g
        self.stats.graph_captures += 1
        log.debug("%s: captured a CUDA graph for %s", self.what, key)
        return g

    def _replay(self, g: _Graph, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, t in feeds.items():
            buf = g.inputs[name]
            if name in g.persistent:
                if t.data_ptr() != buf.data_ptr():
                    raise RuntimeError(f"{self.what}: {name} is not the tensor the graph was "
                                       "captured with")
            elif tuple(t.shape) != tuple(buf.shape):
                raise RuntimeError(f"{self.what}: {name} has shape {list(t.shape)}, the graph "
                                   f"was captured for {list(buf.shape)}")
            else:
                buf.copy_(t)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            g.graph.replay()
        current.wait_stream(self.stream)
        self.stats.graph_replays += 1
        return {name: t.clone() for name, t in g.outputs.items()}

    def _graphs_off(self, reason: str) -> None:
        self.graphs_on = False
        if self.flavor == "rtx":
            # TensorRT-RTX captures and replays internally, per shape, when asked
            self._eager = self._new_context(graph=False, native=True)
            self.stats.graph_mode = "rtx-native"
        else:
            self.stats.graph_mode = f"off: {reason}"
        self.stats.notes.append(reason)
        log.warning("%s: CUDA graphs off (%s); running %s", self.what, reason,
                    "with TensorRT-RTX's own graphs" if self.flavor == "rtx" else "eagerly")
