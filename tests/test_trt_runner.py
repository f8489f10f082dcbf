"""`EngineRunner`'s bookkeeping on CPU: a stand-in TensorRT module whose engine computes
y = 2·x + 1 through the bound addresses (as a real engine reads and writes device memory), and a
stand-in device whose "CUDA graph" records the enqueues made under capture and replays them.

Checked: every TensorRT-RTX context specialises kernels eagerly; graph contexts get activation
memory sized for their bound shapes (`update_device_memory_size_for_shapes`, at least
`device_memory_size_v2`), grown for a larger need while earlier graphs keep theirs; any capture
failure (not only RuntimeError) falls back to eager runs with the reason in the stats; a shape
outside the profile is the caller's error and leaves graphs on; past `max_graphs` a new key runs
eagerly and is counted; one logger per TensorRT module, errors read since a mark.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import types

import pytest
import torch

from metrale.runtime.errors import EngineDirError
from metrale.runtime.backends.trt_runner import EngineRunner, ShapeOutsideProfile, shared_logger

MAX_ROWS = 8  # the stand-in engine's profile: x [1..8]


def _floats(ptr: int, n: int):
    return (ctypes.c_float * n).from_address(ptr)


def fake_trt(need_per_row: int = 100, static_size: int = 300) -> types.ModuleType:
    """A TensorRT-like module: one engine, input x [n] f32, output y [n] f32 = 2x + 1."""
    trt = types.ModuleType("fake_tensorrt")
    trt.made = {"contexts": [], "configs": []}

    class Severity(enum.Enum):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    class ILogger:
        def __init__(self):
            pass

    ILogger.Severity = Severity
    trt.ILogger = ILogger
    trt.TensorIOMode = enum.Enum("TensorIOMode", "INPUT OUTPUT")
    trt.DataType = enum.Enum("DataType", "FLOAT HALF BF16 INT32 INT64 INT8 UINT8 BOOL")
    trt.ExecutionContextAllocationStrategy = enum.Enum("Strategy", "STATIC USER_MANAGED")
    trt.CudaGraphStrategy = enum.Enum("CudaGraphStrategy", "DISABLED WHOLE_GRAPH_CAPTURE")
    trt.DynamicShapesKernelSpecializationStrategy = enum.Enum("Spec", "LAZY EAGER NONE")

    class Config:
        def __init__(self):
            self.cuda_graph_strategy = None
            self.dynamic_shapes_kernel_specialization_strategy = \
                trt.DynamicShapesKernelSpecializationStrategy.LAZY  # TensorRT-RTX's default
            self.strategy = trt.ExecutionContextAllocationStrategy.STATIC
            trt.made["configs"].append(self)

        def set_execution_context_allocation_strategy(self, s):
            self.strategy = s

        def create_runtime_cache(self):
            return object()

        def set_runtime_cache(self, cache):
            self.cache = cache

    class Context:
        def __init__(self, engine, cfg):
            self.engine, self.cfg = engine, cfg
            self.shapes, self.addr, self.memory = {}, {}, None
            self.executions = 0
            trt.made["contexts"].append(self)

        def set_input_shape(self, name, shape):
            if not 1 <= shape[0] <= MAX_ROWS:
                return False
            self.shapes[name] = shape
            return True

        def set_tensor_address(self, name, ptr):
            self.addr[name] = ptr

        def get_tensor_shape(self, name):
            return self.shapes["x"]

        def update_device_memory_size_for_shapes(self):
            return need_per_row * self.shapes["x"][0]

        def set_device_memory(self, ptr, size):
            self.memory = (ptr, size)

        def execute_async_v3(self, stream):
            if self.cfg is not None and \
                    self.cfg.strategy is trt.ExecutionContextAllocationStrategy.USER_MANAGED:
                need = self.update_device_memory_size_for_shapes()
                assert self.memory and self.memory[1] >= max(need, static_size), "scratch too small"
            n = self.shapes["x"][0]
            x, y = self.addr["x"], self.addr["y"]

            def compute():
                xs, ys = _floats(x, n), _floats(y, n)
                for i in range(n):
                    ys[i] = 2 * xs[i] + 1
                self.executions += 1

            if stream_state.capturing is not None:
                stream_state.capturing.ops.append(compute)
            else:
                compute()
            return True

    class Engine:
        num_io_tensors = 2
        device_memory_size_v2 = static_size

        def get_tensor_name(self, i):
            return ("x", "y")[i]

        def get_tensor_mode(self, name):
            return trt.TensorIOMode.INPUT if name == "x" else trt.TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name):
            return trt.DataType.FLOAT

        def is_shape_inference_io(self, name):
            return False

        def get_tensor_profile_shape(self, name, profile):
            return [(1,), (4,), (MAX_ROWS,)]

        def create_runtime_config(self):
            return Config()

        def create_execution_context(self, cfg=None):
            return Context(self, cfg if isinstance(cfg, Config) else None)

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data):
            if data == b"bad":
                self.logger.log(Severity.ERROR, "engine bytes are corrupt")
                return None
            return Engine()

    trt.Runtime = Runtime
    return trt


class _StreamState:
    capturing = None


stream_state = _StreamState()


class FakeStream:
    cuda_stream = 7

    def wait_stream(self, other):
        pass


class FakeGraph:
    def __init__(self):
        self.ops = []


class FakeCuda:
    """`CudaOps` on CPU: capture records the enqueues, replay runs them."""

    def __init__(self, fail_capture: Exception | None = None):
        self.fail_capture = fail_capture

    def device(self, device):
        return contextlib.nullcontext()

    def current_stream(self, device):
        return FakeStream()

    def synchronize(self, device):
        pass

    def new_graph(self):
        return FakeGraph()

    @contextlib.contextmanager
    def capture(self, graph, stream):
        if self.fail_capture is not None:
            raise self.fail_capture
        stream_state.capturing = graph
        try:
            yield
        finally:
            stream_state.capturing = None

    def replay(self, graph, stream):
        for op in graph.ops:
            op()


def runner(trt, flavor="rtx", data=b"engine", **kw) -> EngineRunner:
    return EngineRunner(trt, flavor, data, "test engine", torch.device("cpu"), FakeStream(),
                        cuda=kw.pop("cuda", FakeCuda()), **kw)


def x(n: int, start: float = 0.0) -> dict:
    return {"x": torch.arange(n, dtype=torch.float32) + start}


def test_eager_and_graph_runs_compute_through_the_bound_buffers():
    r = runner(fake_trt())
    assert r.run(x(3))["y"].tolist() == [1.0, 3.0, 5.0]
    first = r.run(x(3), graph_key="k")["y"]  # captured (after two warm-up runs), then replayed
    again = r.run(x(3, start=10.0), graph_key="k")["y"]  # new values copied into the static input
    assert first.tolist() == [1.0, 3.0, 5.0] and again.tolist() == [21.0, 23.0, 25.0]
    assert first.tolist() == [1.0, 3.0, 5.0]  # outputs are clones: a replay does not change them
    s = r.stats
    assert (s.eager_runs, s.graph_captures, s.graph_replays, s.graph_mode) == (1, 1, 2, "manual")
    with pytest.raises(RuntimeError, match=r"x has shape \[4\], the graph was captured for \[3\]"):
        r.run(x(4), graph_key="k")


def test_every_rtx_context_specialises_kernels_eagerly():
    trt = fake_trt()
    r = runner(trt)
    r.run(x(2), graph_key="a")
    r._graphs_off("forced")  # the TensorRT-RTX native-graph eager context
    eager, graph, native = trt.made["configs"]
    eager_kind = trt.DynamicShapesKernelSpecializationStrategy.EAGER
    assert all(c.dynamic_shapes_kernel_specialization_strategy is eager_kind
               for c in (eager, graph, native))
    assert eager.cuda_graph_strategy is trt.CudaGraphStrategy.DISABLED
    assert native.cuda_graph_strategy is trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE
    user = trt.ExecutionContextAllocationStrategy.USER_MANAGED
    assert graph.strategy is user and eager.strategy is not user and native.strategy is not user
    assert len({id(c.cache) for c in (eager, graph, native)}) == 1  # one runtime cache


def test_graph_contexts_get_memory_sized_for_their_shapes():
    trt = fake_trt(need_per_row=100, static_size=300)
    r = runner(trt)
    r.run(x(2), graph_key="two")  # needs 200 < the engine's static 300: 300
    assert r.stats.scratch_bytes == 300
    r.run(x(5), graph_key="five")  # needs 500: a larger buffer for this and later contexts
    assert r.stats.scratch_bytes == 500
    two, five = r._graphs["two"], r._graphs["five"]
    assert two.context.memory[1] == 300 and five.context.memory[1] == 500
    assert two.scratch.data_ptr() != five.scratch.data_ptr()  # the earlier graph keeps its own
    r.run(x(4), graph_key="four")  # 400 fits: shares the current buffer
    assert r._graphs["four"].context.memory == five.context.memory
    # replays still compute (the stand-in asserts the memory suffices on every execution)
    assert r.run(x(2, 1.0), graph_key="two")["y"].tolist() == [3.0, 5.0]


@pytest.mark.parametrize("flavor, mode", [("rtx", "rtx-native"), ("tensorrt", "off: capture failed")])
def test_any_capture_error_falls_back_to_eager_runs(flavor, mode):
    r = runner(fake_trt(), flavor, cuda=FakeCuda(fail_capture=TypeError("no capture here")))
    out = r.run(x(3), graph_key="k")  # not a RuntimeError: still caught, the call still served
    assert out["y"].tolist() == [1.0, 3.0, 5.0]
    assert r.stats.graph_mode.startswith(mode) and not r.graphs_on
    assert r.stats.notes == ["capture failed (TypeError: no capture here)"]
    r.run(x(3), graph_key="k")
    assert (r.stats.graph_captures, r.stats.eager_runs) == (0, 2)


def test_a_shape_outside_the_profile_is_the_callers_error_and_keeps_graphs_on():
    r = runner(fake_trt())
    with pytest.raises(ShapeOutsideProfile, match=r"input x of shape \[9\] is outside"):
        r.run(x(9), graph_key="k")
    assert r.graphs_on and r.stats.graph_mode == "manual" and not r.stats.notes
    with pytest.raises(ValueError, match="outside the engine's optimization profile"):
        r.run(x(9))  # eager: the same refusal
    r.run(x(2), graph_key="k")
    assert r.stats.graph_captures == 1


def test_past_the_graph_limit_new_keys_run_eagerly_and_are_counted():
    r = runner(fake_trt(), max_graphs=2)
    for key in ("a", "b", "c", "d", "a"):
        assert r.run(x(2), graph_key=key)["y"].tolist() == [1.0, 3.0]
    s = r.stats
    assert (s.graph_captures, s.graph_limit_hits, s.eager_runs, s.graph_replays) == (2, 2, 2, 3)
    assert s.notes == ["graph limit 2 reached: calls with a new graph key (first: 'c') run eagerly"]
    assert s.graph_mode == "manual" and r.graphs_on  # the captured graphs keep replaying


def test_one_logger_per_tensorrt_module_and_errors_since_a_mark():
    trt = fake_trt()
    logger = shared_logger(trt)
    assert shared_logger(trt) is logger and shared_logger(fake_trt()) is not logger
    logger.log(trt.ILogger.Severity.ERROR, "an earlier failure")
    with pytest.raises(EngineDirError, match=r"could not deserialize it: engine bytes are corrupt$"):
        runner(trt, data=b"bad")  # only this call's errors, not the earlier one
    mark = logger.mark()
    logger.log(trt.ILogger.Severity.WARNING, "not an error")
    logger.log(trt.ILogger.Severity.INTERNAL_ERROR, "late")
    assert logger.errors_since(mark) == ["late"]
    assert runner(trt).logger is logger  # every runner of the module shares it


def test_close_drops_graphs_contexts_and_engine():
    r = runner(fake_trt())
    r.run(x(2), graph_key="k")
    r.close()
    assert (r._graphs, r._eager, r.engine, r.graphs_on) == ({}, None, None, False)
