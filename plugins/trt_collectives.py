"""The TensorRT face of the tensor-parallel drafter's collectives: `AllReduce` / `AllGather`
IPluginV3 plugins over NCCL, written in Python like the GEMM plugins of `plugins.trt_plugin`.

A per-rank drafter graph (`builder.tp_export`) holds `metrale`-domain nodes
    AllReduce(x [...]) -> y [...]               sum over the group, y has x's dtype and shape
    AllGather(x [...]) -> y [group_size, ...]   every rank's x on a new leading rank axis
with INT attributes `group_size` and `rank`. TensorRT's ONNX parser hands the attributes to the
creator as plugin fields; the plugin serializes both into the engine, so an engine is one rank's.
Activations: float32, float16 or bfloat16 (one per node; the output has the input's dtype).

Build time (CPU-only works): the plugins answer shapes, types and formats; they never run.
Run time (GPU only): `enqueue` calls `ncclAllReduce` (sum) / `ncclAllGather` on TensorRT's
stream with the `NcclCommunicator` given to `register_plugins` (`Collectives.comm`), whose rank
and size must be the engine's; NCCL's all-gather output is rank-major, which is the node's
[group_size, ...] layout. No communicator, or one of another rank or size, is an error at the
first launch, never a silent no-op. The communicator is created once per process, after
`torch.distributed` joined the ranks (`NcclCommunicator.from_process_group`), from
`libnccl.so.2` (the `nvidia-nccl-cu*` wheel that CUDA builds of torch depend on) via ctypes, and
destroyed exactly once: by `close()` (`Collectives.close`, `RegisteredPlugins.close`, or leaving
its `with` block), or else when it is garbage-collected or the process exits.
An empty input (zero elements) calls no collective: every rank sees the same shapes, so all
skip it together.

Invariant: this module imports no TensorRT flavour itself; `collective_classes(trt)` builds the
classes for the module it is given, once per module.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import weakref
from dataclasses import dataclass, field
from types import ModuleType

from metrale.plugins.trt_common import Keeper, PluginDefaults, init_plugin

COLLECTIVE_OPS = ("AllReduce", "AllGather")
ACTIVATION_TYPES = ("FLOAT", "HALF", "BF16")
# TensorRT DataType member name -> ncclDataType_t (nccl.h: ncclFloat16 6, ncclFloat32 7, ncclBfloat16 9)
NCCL_TYPES = {"FLOAT": 7, "HALF": 6, "BF16": 9}
NCCL_SUM = 0  # ncclRedOp_t ncclSum
NCCL_UNIQUE_ID_BYTES = 128


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


def _nccl_library_paths() -> list[str]:
    """libnccl.so.2 candidates: the `nvidia.nccl` wheel's lib folder first, then the loader's."""
    found = []
    try:
        import nvidia.nccl as pkg  # namespace package of the nvidia-nccl-cu* wheels

        for folder in pkg.__path__:
            found += sorted(glob.glob(os.path.join(folder, "lib", "libnccl.so*")))
    except ImportError:
        pass
    return found + ["libnccl.so.2"]


@functools.lru_cache(maxsize=None)
def load_nccl() -> ctypes.CDLL:
    """The NCCL library with the signatures used here declared (GPU hosts only)."""
    errors = []
    for path in _nccl_library_paths():
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    else:
        raise RuntimeError("the AllReduce/AllGather TensorRT plugins need NCCL (libnccl.so.2): "
                           "pip install nvidia-nccl-cu12 (or -cu13); " + "; ".join(errors))
    vp, sz, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetErrorString.argtypes = [i32]
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i32, _UniqueId, i32]
    lib.ncclAllReduce.argtypes = [vp, vp, sz, i32, i32, vp, vp]
    lib.ncclAllGather.argtypes = [vp, vp, sz, i32, vp, vp]
    lib.ncclCommDestroy.argtypes = [vp]
    return lib


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed: NCCL error {code} ({lib.ncclGetErrorString(code).decode()})")


def _destroy_comm(lib: ctypes.CDLL, comm: ctypes.c_void_p) -> None:
    """ncclCommDestroy once (the finalizer of an `NcclCommunicator`; a local call in NCCL)."""
    if comm:
        handle, comm.value = comm.value, None
        _check(lib, lib.ncclCommDestroy(handle), "ncclCommDestroy")


class NcclCommunicator:
    """One rank's NCCL communicator over `size` ranks (one GPU per rank; GPU only)."""

    def __init__(self, rank: int, size: int, unique_id: bytes):
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        if not 0 <= rank < size:
            raise ValueError(f"NCCL rank {rank} of {size}: expected 0 <= rank < size")
        self.rank, self.size = rank, size
        self.lib = load_nccl()
        self.comm = ctypes.c_void_p()
        uid = _UniqueId.from_buffer_copy(unique_id)
        _check(self.lib, self.lib.ncclCommInitRank(ctypes.byref(self.comm), size, uid, rank),
               f"ncclCommInitRank(rank {rank} of {size})")
        # destroyed once: by close(), or when collected / at exit if nobody closed it
        self._finalizer = weakref.finalize(self, _destroy_comm, self.lib, self.comm)

    def __enter__(self) -> "NcclCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def new_unique_id() -> bytes:
        lib, uid = load_nccl(), _UniqueId()
        _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    @classmethod
    def from_process_group(cls) -> "NcclCommunicator":
        """Rank 0 makes the unique id and `torch.distributed` (already joined) broadcasts it;
        the caller has selected this rank's GPU (`torch.cuda.set_device`) before."""
        import torch.distributed as dist

        box = [cls.new_unique_id() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return cls(dist.get_rank(), dist.get_world_size(), box[0])

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        _check(self.lib, self.lib.ncclAllReduce(send, recv, count, dtype, NCCL_SUM, self.comm,
                                                stream), "ncclAllReduce")

    def all_gather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        _check(self.lib, self.lib.ncclAllGather(send, recv, count, dtype, self.comm, stream),
               "ncclAllGather")

    @property
    def closed(self) -> bool:
        return not self.comm

    def close(self) -> None:
        """Destroy the communicator (idempotent)."""
        self._finalizer()


@dataclass
class Collectives:
    """What the collective plugins share: the communicator (None while building) and the Python
    plugin objects TensorRT holds by borrowed pointers (they must outlive the engines)."""

    comm: NcclCommunicator | None = None
    keep_alive: Keeper = field(default_factory=Keeper, repr=False)

    def close(self) -> None:
        """Destroy the communicator, if any (after the engines that use it are gone)."""
        if self.comm is not None:
            self.comm.close()

    def communicator(self, op: str, group_size: int, rank: int) -> NcclCommunicator:
        if self.comm is None or getattr(self.comm, "closed", False):
            raise RuntimeError(f"TensorRT plugin {op}: no NCCL communicator is open (none was "
                               "given to register_plugins, or it was closed); a tensor-parallel "
                               "engine runs with one per rank")
        if (self.comm.size, self.comm.rank) != (group_size, rank):
            raise RuntimeError(f"TensorRT plugin {op}: the engine is rank {rank} of {group_size}, "
                               f"the communicator rank {self.comm.rank} of {self.comm.size}")
        return self.comm


def _volume(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _fields(trt: ModuleType, group_size: int, rank: int):
    import numpy as np

    i32 = trt.PluginFieldType.INT32
    return [trt.PluginField("group_size", np.array([group_size], dtype=np.int32), i32),
            trt.PluginField("rank", np.array([rank], dtype=np.int32), i32)]


@functools.lru_cache(maxsize=None)
def collective_classes(trt: ModuleType):
    """(plugin class, creator class) implemented against the TensorRT module `trt`."""

    class MetraleCollectivePlugin(PluginDefaults, trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild,
                                  trt.IPluginV3OneRuntime):
        """One AllReduce or AllGather node of one rank. Serialized fields: group_size, rank."""

        def __init__(self, op: str, group_size: int, rank: int, shared: Collectives):
            init_plugin(self, trt, op)
            self.op, self.group_size, self.rank, self.shared = op, group_size, rank, shared

        def clone(self):
            return self.shared.keep_alive.hold(
                MetraleCollectivePlugin(self.op, self.group_size, self.rank, self.shared))

        # -- build --
        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            x = inputs[0]
            if self.op == "AllReduce":
                return [trt.DimsExprs(x)]
            dims = [expr_builder.constant(self.group_size)] + [x[i] for i in range(len(x))]
            return [trt.DimsExprs(dims)]

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            if pos == 0:
                return desc.type in tuple(getattr(trt.DataType, t) for t in ACTIVATION_TYPES)
            return desc.type == in_out[0].desc.type

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection(_fields(trt, self.group_size, self.rank))

        # -- runtime (GPU only) --
        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            comm = self.shared.communicator(self.op, self.group_size, self.rank)
            count = _volume(input_desc[0].dims)  # elements each rank sends
            if count == 0:  # every rank has the same shapes: all skip together
                return
            dtype = NCCL_TYPES[input_desc[0].type.name]
            send, recv = int(inputs[0]), int(outputs[0])
            if self.op == "AllReduce":
                comm.all_reduce(send, recv, count, dtype, int(stream))
            else:
                comm.all_gather(send, recv, count, dtype, int(stream))

    class MetraleCollectiveCreator(trt.IPluginCreatorV3One):
        """Creates the plugins of one collective op from the node's (or engine's) fields."""

        def __init__(self, op: str, shared: Collectives):
            trt.IPluginCreatorV3One.__init__(self)
            self.op, self.shared = op, shared
            self.name = op
            self.plugin_namespace = ""
            self.plugin_version = "1"
            self.field_names = trt.PluginFieldCollection(_fields(trt, 1, 0))

        def create_plugin(self, name, fc, phase):
            got = {f.name: int(f.data[0]) for f in fc if f.name in ("group_size", "rank")}
            if set(got) != {"group_size", "rank"} or not 0 <= got["rank"] < got["group_size"]:
                raise ValueError(f"{self.op} node {name}: expected INT attributes group_size >= 1 "
                                 f"and 0 <= rank < group_size, got {got}")
            return self.shared.keep_alive.hold(
                MetraleCollectivePlugin(self.op, got["group_size"], got["rank"], self.shared))

    return MetraleCollectivePlugin, MetraleCollectiveCreator


def register_collectives(trt: ModuleType, shared: Collectives) -> dict[str, object]:
    """Register (replacing any earlier registration) a creator per collective op."""
    _, creator_cls = collective_classes(trt)
    registry = trt.get_plugin_registry()
    creators = {}
    for op in COLLECTIVE_OPS:
        old = registry.get_creator(op, "1", "")
        if old is not None:
            registry.deregister_creator(old)
        creator = creator_cls(op, shared)
        if not registry.register_creator(creator, ""):
            raise RuntimeError(f"TensorRT refused to register the {op} plugin creator")
        creators[op] = creator
    return creators
