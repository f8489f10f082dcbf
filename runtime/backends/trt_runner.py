"""Running one TensorRT engine from PyTorch: import, SM choice, eager execution and CUDA graphs.

The serving side of the engines `metrale build` writes. Nothing here imports TensorRT (or the
builder) at module import time: `import_trt(flavor)` imports `tensorrt_rtx` (`rtx`) or
`tensorrt` (`tensorrt`) on demand, the flavour being the one the manifest says built the engines.

`pick_engine_sm` is the pure rule for which engine file a GPU runs: an engine runs only on the
SM it was built for (TensorRT-RTX and full TensorRT alike), so the GPU's SM must be built for
every component; anything else is refused naming the engine directory and the SMs it has.

Logging: TensorRT keeps the first logger it is given for the whole process (later loggers passed
to a Builder or Runtime are ignored), so every builder and runtime here gets the one
`shared_logger(trt)` of its module, and a caller reads the errors logged since its own `mark()`.

`EngineRunner` owns one deserialized engine:
- eager execution (`run(feeds)`): every input's shape is set on the context (the engines have one
  optimization profile, index 0), every input and output is bound by address as a torch CUDA
  tensor (`set_tensor_address`), and `execute_async_v3` runs on the runner's CUDA stream, ordered
  after and before the caller's current stream (`wait_stream` both ways), so callers use plain
  torch ops on the outputs;
- CUDA graphs (`run(feeds, graph_key=..., persistent=...)`): a fixed-shape call is captured once
  per key with `torch.cuda.graph` and replayed afterwards. Each graph gets an execution context of
  its own that nothing else ever touches (a captured graph is valid only for the shapes and
  addresses bound at capture, so no later call may change them). Graph contexts use
  `USER_MANAGED` activation memory sized for the bound shapes
  (`update_device_memory_size_for_shapes`, at least `device_memory_size_v2`): they share one
  buffer, grown (a new buffer for later contexts; earlier graphs keep theirs) when a shape needs
  more, safe because every call is serialized on one stream. Inputs named in `persistent` (the
  KV caches) are bound by address and must be the same tensors at replay; the others are copied
  into the graph's static buffers. Outputs are cloned out of the static buffers, so a caller may
  keep them across calls. Before capture the context runs twice eagerly (TensorRT flushes
  deferred shape updates and, on TensorRT-RTX, compiles its shape-specialized kernels).
- Kernel specialisation (TensorRT-RTX): every context, eager ones included, uses the EAGER
  strategy with one shared runtime cache: a new shape's specialised kernel is compiled before
  that call runs, so a given shape always runs the same kernel, in whichever context (LAZY would
  run a fallback kernel until the specialised one is ready, changing results between calls —
  at odds with `--exact-verify`'s byte-identical greedy output).
- Fallbacks, all recorded in `stats` and logged: a context TensorRT reports as not
  stream-capturable, or any error while capturing, turns graphs off for that runner (on
  TensorRT-RTX the eager context then uses its built-in CUDA graphs) and every call runs
  eagerly: the results are the same either way. A shape outside the profile is the caller's
  error and is raised as `ShapeOutsideProfile`, graphs staying on. Past `max_graphs` captured
  graphs a new key runs eagerly, counted in `stats.graph_limit_hits` (noted once).
The device calls go through `CudaOps` (torch.cuda), so this bookkeeping runs on CPU in tests
with a stand-in device and TensorRT module.
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.util
import logging
import os
import threading
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


@functools.lru_cache(maxsize=None)
def shared_logger(trt: ModuleType):
    """The one TensorRT logger of module `trt` (TensorRT keeps the first logger it is given,
    process-wide): keeps the latest error messages, numbered, and sends the rest to logging.
    `mark()` then `errors_since(mark)` gives a caller the errors of its own calls."""

    class Shared(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self._lock = threading.Lock()
            self._count = 0
            self._recent: collections.deque = collections.deque(maxlen=256)  # (number, message)

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                with self._lock:
                    self._recent.append((self._count, msg))
                    self._count += 1
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.debug("TensorRT warning: %s", msg)

        def mark(self) -> int:
            with self._lock:
                return self._count

        def errors_since(self, mark: int) -> list[str]:
            with self._lock:
                return [msg for n, msg in self._recent if n >= mark]

    return Shared()


def _said(logger, mark: int, last: int = 3) -> str:
    return "; ".join(logger.errors_since(mark)[-last:]) or "no message"


class ShapeOutsideProfile(ValueError):
    """An input's shape is outside the engine's optimization profile (the caller's error)."""


class CudaOps:
    """The device calls `EngineRunner` makes, on torch.cuda (a test passes a CPU stand-in)."""

    def device(self, device):
        return torch.cuda.device(device)

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def synchronize(self, device) -> None:
        torch.cuda.synchronize(device)

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def capture(self, graph, stream):
        return torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local")

    def replay(self, graph, stream) -> None:
        with torch.cuda.stream(stream):
            graph.replay()


# -- running ---------------------------------------------------------------------------------


@dataclass
class _Graph:
    context: object
    graph: object  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static input buffers (persistent ones are the callers')
    outputs: dict[str, torch.Tensor]  # static output buffers
    persistent: frozenset[str]
    scratch: torch.Tensor  # the activation memory bound to the context at capture


@dataclass
class RunnerStats:
    eager_runs: int = 0
    graph_replays: int = 0
    graph_captures: int = 0
    graph_limit_hits: int = 0  # calls with a new graph key past `max_graphs`: run eagerly
    scratch_bytes: int = 0  # the graph contexts' current activation buffer
    graph_mode: str = "manual"  # "manual", "rtx-native" or "off: <reason>"
    notes: list[str] = field(default_factory=list)


class EngineRunner:
    """One engine on one CUDA device; see the module docstring for the execution contract."""

    def __init__(self, trt: ModuleType, flavor: str, data: bytes, what: str, device: torch.device,
                 stream, graphs: bool = True, max_graphs: int = MAX_GRAPHS,
                 cuda: CudaOps | None = None):
        self.trt, self.flavor, self.what, self.device, self.stream = trt, flavor, what, device, stream
        self.cuda = cuda or CudaOps()
        self.max_graphs = max_graphs
        self.logger = shared_logger(trt)
        mark = self.logger.mark()
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise EngineDirError(f"{what}: TensorRT {flavor} could not deserialize it: "
                                 f"{_said(self.logger, mark, 10)}")
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
        mark = self.logger.mark()
        if self.flavor == "rtx":
            cfg = engine.create_runtime_config()
            cfg.cuda_graph_strategy = (trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE if native
                                       else trt.CudaGraphStrategy.DISABLED)
            # every context: a shape's specialised kernel is ready before its first call, so a
            # shape always runs the same kernel (see the module docstring)
            cfg.dynamic_shapes_kernel_specialization_strategy = \
                trt.DynamicShapesKernelSpecializationStrategy.EAGER
            if graph:
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
                                 f"{_said(self.logger, mark, 10)}")
        return ctx

    def _attach_scratch(self, ctx) -> torch.Tensor:
        """Give a user-managed context activation memory for the shapes bound on it: the shared
        buffer, or a larger one (then shared by later contexts) when these shapes need more."""
        size = getattr(self.engine, "device_memory_size_v2", None)
        size = int(self.engine.device_memory_size if size is None else size)
        update = getattr(ctx, "update_device_memory_size_for_shapes", None)
        if update is not None:  # the bound shapes' own need (shape-specialised kernels included)
            size = max(size, int(update()))
        if self._scratch is None or self._scratch.numel() < size:
            # torch's allocations are 512-byte aligned; TensorRT asks for 256
            self._scratch = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
            self.stats.scratch_bytes = self._scratch.numel()
        if hasattr(ctx, "set_device_memory"):
            ctx.set_device_memory(self._scratch.data_ptr(), self._scratch.numel())
        else:  # TensorRT 10.0
            ctx.device_memory = self._scratch.data_ptr()
        return self._scratch

    # -- eager ----------------------------------------------------------------------------
    def _as_input(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtypes[name]).contiguous()

    def _bind(self, ctx, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Set every input's shape and address, allocate and bind every output."""
        for name in self.inputs:
            t = feeds[name]
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise ShapeOutsideProfile(
                    f"{self.what}: input {name} of shape {list(t.shape)} is outside the engine's "
                    f"optimization profile "
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
        current = self.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # inputs written on the caller's stream come first
        mark = self.logger.mark()
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"{self.what}: TensorRT execution failed: {_said(self.logger, mark)}")
        current.wait_stream(self.stream)  # the caller's next ops see the outputs

    def run(self, feeds: Mapping[str, torch.Tensor], graph_key=None,
            persistent: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        """Outputs by name for `feeds` (every input by name). With a `graph_key` the call is
        replayed from the CUDA graph captured for that key (captured on first use)."""
        with self.cuda.device(self.device):  # TensorRT works on the current device
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
        if len(self._graphs) >= self.max_graphs:
            if not self.stats.graph_limit_hits:
                reason = (f"graph limit {self.max_graphs} reached: calls with a new graph key "
                          f"(first: {key!r}) run eagerly")
                self.stats.notes.append(reason)
                log.warning("%s: %s", self.what, reason)
            self.stats.graph_limit_hits += 1
            return None
        try:
            ctx = self._new_context(graph=True, native=False)
            static = {n: (t if n in persistent else t.clone()) for n, t in feeds.items()}
            outs = self._bind(ctx, static)
            scratch = self._attach_scratch(ctx)
            for _ in range(2):  # flush deferred updates; JIT the specialized kernels
                self._enqueue(ctx)
            self.cuda.synchronize(self.device)
            capturable = getattr(ctx, "is_stream_capturable", None)
            if capturable is not None and not capturable(self.stream.cuda_stream):
                self._graphs_off("TensorRT reports the context as not stream-capturable")
                return None
            graph = self.cuda.new_graph()
            self.stream.wait_stream(self.cuda.current_stream(self.device))
            mark = self.logger.mark()
            with self.cuda.capture(graph, self.stream):
                ok = ctx.execute_async_v3(self.stream.cuda_stream)
            if not ok:
                raise RuntimeError(f"execute_async_v3 failed under capture: {_said(self.logger, mark)}")
        except ShapeOutsideProfile:
            raise  # the eager path would refuse it too: the caller's error, not the graphs'
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager runs
            self._graphs_off(f"capture failed ({type(exc).__name__}: {exc})")
            return None
        g = _Graph(ctx, graph, static, outs, persistent, scratch)
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
        current = self.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        self.cuda.replay(g.graph, self.stream)
        current.wait_stream(self.stream)
        self.stats.graph_replays += 1
        return {name: t.clone() for name, t in g.outputs.items()}

    def close(self) -> None:
        """Drop the graphs, contexts and engine (before the plugins' resources they use)."""
        self._graphs.clear()
        self._eager = None
        self._configs.clear()
        self._jit_cache = self._scratch = None
        self.engine = self.runtime = None
        self.graphs_on = False

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
