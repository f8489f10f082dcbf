"""A guard that fails on any read of a tensor's value by the host.

A speculative iteration that is to run as one CUDA graph may not read the device: every
`.item()`, `int(t)`, `float(t)`, `.tolist()` of a device tensor, every copy of one to the CPU and
every op whose output shape depends on tensor values (`nonzero`, `masked_select`, boolean
indexing, `unique`, `repeat_interleave` by counts) drains the GPU's queue, and none of them can
be captured. `forbid_host_reads()` is a dispatch mode that raises `HostRead` at the first such
op, naming it, whatever the device: a CPU run of an iteration under it proves the same code
makes no host read on a GPU (where the same ops would sync). The Python-level reads that never
reach the dispatcher on a CPU tensor (`.tolist()`, `.numpy()`, `int(t)`, `.cpu()`, ...) are
caught by a function mode beside it, so the guard sees on a CPU every read a GPU would sync on.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# ops that read values into the host or give a shape that depends on them
_READS = {
    _aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default,
    _aten.nonzero.default, _aten.nonzero_static.default, _aten.masked_select.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.equal.default, _aten.allclose.default,
}
_READ_PACKETS = {f.overloadpacket for f in _READS}
_READ_OVERLOADS = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}  # counts as a tensor


class HostRead(RuntimeError):
    """An op that reads device values into the host ran where none may."""


def _to_host(func, args, kwargs) -> bool:
    """A copy from a non-CPU tensor into a CPU one."""
    if func in (_aten._to_copy.default, _aten.to.device, _aten.to.dtype_layout):
        src = args[0]
        dst = kwargs.get("device", args[1] if func is _aten.to.device and len(args) > 1 else None)
        return (isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None
                and torch.device(dst).type == "cpu")
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    return False


_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
             _aten._index_put_impl_.default}


def _by_mask(func, args) -> bool:
    """Indexing by a boolean mask: its result's shape is the mask's count of True."""
    return func in _INDEXING and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))


# tensor methods that hand values to Python (on a GPU, each a copy to the host and a sync)
_PY_READS = {"tolist", "numpy", "item", "__int__", "__float__", "__bool__", "__index__",
             "__complex__", "cpu"}


def _py_read(func, args, kwargs) -> str | None:
    name = getattr(func, "__name__", "")
    if name in _PY_READS:
        return f"Tensor.{name} hands tensor values to Python"
    if name == "to":
        dst = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(dst, (str, torch.device)) and torch.device(dst).type == "cpu":
            return "Tensor.to copies a tensor to the CPU"
    return None


class _PyGuard(TorchFunctionMode):
    """The Python-level half of the guard (or of the count, `counter` given)."""

    def __init__(self, what: str, counter: "OpCount | None" = None):
        super().__init__()
        self.what, self.counter = what, counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _py_read(func, args, kwargs)
        if why is not None:
            if self.counter is None:
                raise HostRead(f"{self.what}: {why}")
            self.counter.host_reads += 1
        return func(*args, **kwargs)


def host_read(func, args, kwargs) -> str | None:
    """Why the op reads device values into the host, or None."""
    if func.overloadpacket in _READ_PACKETS or func in _READ_OVERLOADS:
        return "reads tensor values into the host"
    if _by_mask(func, args):
        return "indexes by a boolean mask (a shape read from values)"
    if _to_host(func, args, kwargs):
        return "copies a device tensor to the CPU"
    return None


class _Guard(TorchDispatchMode):
    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = host_read(func, args, kwargs)
        if why is not None:
            raise HostRead(f"{self.what}: {func} {why}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_reads(what: str = "an iteration"):
    """Raise `HostRead` at the first op inside that reads values into the host."""
    with _PyGuard(what), _Guard(what):
        yield


class _Count(TorchDispatchMode):
    def __init__(self, counter: "OpCount"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counter.ops += 1
        self.counter.host_reads += host_read(func, args, kwargs) is not None
        return func(*args, **kwargs)


class OpCount:
    """`with OpCount() as c:` counts the ops that run inside (`c.ops`: each a kernel launch on a
    GPU run eagerly, a graph node when captured) and the host reads (`c.host_reads`: of those
    ops, and of the Python-level reads)."""

    def __init__(self):
        self.ops = self.host_reads = 0
        self._modes = contextlib.ExitStack()

    def __enter__(self) -> "OpCount":
        self._modes.enter_context(_PyGuard("", self))
        self._modes.enter_context(_Count(self))
        return self

    def __exit__(self, *exc) -> None:
        self._modes.close()
