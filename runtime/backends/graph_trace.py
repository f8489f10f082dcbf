"""What a CUDA graph freezes, checked on a CPU: each replay must dispatch the captured ops.

A captured graph is a fixed list of kernels with fixed arguments: the same ops, the same
scalars, the same shapes and the same memory. A replay runs none of the Python that built it,
so a function captured as a graph must do, every time it is called, exactly what it did at
capture; whatever it read from the host (a position as an `int`, a length from a list, a tensor
made from Python values) is frozen at its capture-time value, and a tensor it reads that is not
one of the buffers that outlive the call (inputs, weights, caches) is gone after capture.

`OpTrace` records the ops a call dispatches: per op, the op and per argument its value, or for
a tensor either the op of this call that made its memory or, for memory from before the call,
its address, with the view's offset, shape, strides and dtype; then the same of the tensors the
call returned (the graph's outputs stay the ones it wrote at capture). `EagerGraphs` (the
stand-in for `CudaGraphs` on machines without CUDA) records each captured function this way and
checks replays against the record, so a function that would replay other than it ran on a GPU
fails its tests on a CPU, at the first op that differs and naming it and its argument.

What it cannot tell: memory from before the call is told by address, so a tensor made during the
call without an op (`torch.frombuffer`, DLPack; `torch.tensor` and `from_numpy` are ops, whose
values are compared) or a buffer swapped into the very address of the old one passes; a
generator is told by its state, so an unregistered one whose state equals a registered one's
passes; ops run on another thread are not seen (a capture that dispatched none is refused).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_NESTED = (list, tuple)
_VALUES = frozenset((int, bool, type(None), str, torch.dtype, torch.device, torch.layout,
                     torch.memory_format))
_NAN = "nan"  # stands for every NaN (a NaN is not equal to itself)
_UNREGISTERED = ("generator", "not registered with the graph")
_RETURNED = "the call's return"


class GraphReplayError(RuntimeError):
    """A replay of a captured function dispatched other than its capture did: on a GPU, its
    graph would have run the captured ops on the captured values instead."""


def _float(v: float):
    return _NAN if v != v else v


class OpTrace(TorchDispatchMode):
    """`with OpTrace() as t:` records `t.ops`, one entry per op dispatched inside: (op, its
    positional arguments described, its keyword arguments described); `returned(outs)` adds the
    call's outputs. `generators`: those registered with the graph."""

    def __init__(self, generators=()):
        super().__init__()
        self.generators = tuple(generators)
        self.ops: list[tuple] = []
        self._made: dict[int, tuple[int, int]] = {}  # storage address -> (op, output) that made it
        # every output kept alive while recording, so no memory made during the call is freed
        # and handed to a later tensor, which would then pass for the op that made it first
        self._outputs: list[torch.Tensor] = []
        self._given: set[int] = set()

    def __exit__(self, *exc):
        self._outputs, self._made = [], {}  # what only the recording needed
        return super().__exit__(*exc)

    def _generator(self, g: torch.Generator) -> tuple:
        """Which registered generator `g` is (a new Python object at every op: told by state)."""
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            state = g.get_state()
            mine = [i for i, r in enumerate(self.generators) if torch.equal(r.get_state(), state)]
        # a graph draws afresh at each replay only from the generators registered with it
        return ("generator", mine[0]) if mine else _UNREGISTERED

    def _describe(self, arg):
        kind = type(arg)
        if kind in _VALUES:
            return arg
        if kind is float:
            return _float(arg)
        if isinstance(arg, torch.Tensor):
            ptr = arg.untyped_storage().data_ptr()
            self._given.add(ptr)
            maker = self._made.get(ptr)
            # memory made by an op of this call, or from before it (by address)
            return (maker if maker is not None else ptr, arg.storage_offset(), arg.shape, arg.stride(), arg.dtype)
        if kind in _NESTED:
            return tuple(self._describe(a) for a in arg)
        if kind is torch.Generator:
            return self._generator(arg)
        return ("value", arg)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = len(self.ops)
        self._given = set()
        if func is _LIFT_FRESH:  # a tensor made from Python values (`torch.tensor(...)`,
            # `t[i] = 1`): the graph holds the values it had at capture
            with torch._C.DisableTorchFunction(), _disable_current_modes():
                values = args[0].reshape(-1).tolist()
            described = (("host values", tuple(_float(v) if type(v) is float else v for v in values)),)
        else:
            described = tuple(self._describe(a) for a in args)
        self.ops.append((func, described, tuple((k, self._describe(v)) for k, v in kwargs.items())))
        out = func(*args, **kwargs)
        # new memory: an output whose storage is none of the arguments' (not a view of one nor
        # written into one; an op that may alias, like `to`, makes new memory when it copies)
        given = self._given
        for i, t in enumerate(out if type(out) in _NESTED else (out,)):
            if isinstance(t, torch.Tensor):
                self._outputs.append(t)
                ptr = t.untyped_storage().data_ptr()
                if func is _LIFT_FRESH or ptr not in given:
                    self._made[ptr] = (index, i)
        return out

    def returned(self, outs) -> None:
        """Record the tensors the call returned (inside the `with`)."""
        self.ops.append((_RETURNED, tuple(self._describe(t) for t in outs), ()))


def _is_tensor(d) -> bool:
    return type(d) is tuple and len(d) == 5 and isinstance(d[4], torch.dtype)


def _said(d) -> str:
    """An argument's description in words."""
    if _is_tensor(d):
        maker, offset, shape, stride, dtype = d
        where = (f"op {maker[0]}'s output {maker[1]}" if type(maker) is tuple
                 else f"memory from before the call at {maker:#x}")
        return f"a tensor of {where} (offset {offset}, shape {tuple(shape)}, strides {tuple(stride)}, {dtype})"
    if type(d) is tuple and d and d[0] in ("generator", "host values", "value"):
        return f"{d[0]} {d[1]!r}"
    return repr(d)


def _why(a, b) -> str:
    if _is_tensor(a) and _is_tensor(b) and type(a[0]) is int and type(b[0]) is int and a[0] != b[0]:
        return ("a tensor not made by the graph whose memory is not capture's: one made during "
                "the call outside the graph's ops, or another buffer; the graph reads the memory "
                "it read at capture")
    if _is_tensor(a) or _is_tensor(b) or (type(a) is tuple and a[:1] == ("generator",)):
        return f"{_said(b)} where the capture read {_said(a)}"
    if type(a) is tuple and type(b) is tuple and len(a) == len(b) and a[:1] != ("host values",):
        return next(_why(x, y) for x, y in zip(a, b) if x != y)  # an element of a list argument
    return f"{_said(a)} at capture, {_said(b)} now: a value from the host, which the graph froze"


def _names(func) -> list[str]:
    return [a.name for a in func._schema.arguments] if func is not _RETURNED else []


def _difference(captured: tuple, replayed: tuple) -> str:
    """Which argument of an op differs between capture and replay, and why."""
    func = captured[0]
    if func is not replayed[0]:
        return f"{replayed[0]} where the capture ran {func}"
    names = _names(func)
    what = "output" if func is _RETURNED else "argument"
    for i, (a, b) in enumerate(zip(captured[1], replayed[1])):
        if a != b:
            name = f" ({names[i]})" if i < len(names) else ""
            return f"{func}, {what} {i}{name}: {_why(a, b)}"
    if len(captured[1]) != len(replayed[1]):
        n = min(len(captured[1]), len(replayed[1]))
        # (aten leaves out trailing arguments that take their defaults)
        name = f" ({names[n]}: its default in one of them)" if n < len(names) else ""
        return (f"{func}: {len(replayed[1])} {what}s where the capture had {len(captured[1])}; "
                f"they part at {what} {n}{name}")
    for (k, a), (k2, b) in zip(captured[2], replayed[2]):
        if (k, a) != (k2, b):
            return f"{func}, keyword {k2!r}: {_why(a, b)}" if k == k2 else f"{func}: keyword {k2!r} where the capture had {k!r}"
    return f"{func}: keywords {[k for k, _ in replayed[2]]} where the capture had {[k for k, _ in captured[2]]}"


def check_capture(trace: OpTrace, what: str = "a captured function") -> None:
    """Raise `GraphReplayError` where a capture would replay nothing (no op dispatched on this
    thread) or draws from a generator not registered with its graph: a replay would not advance
    its state, and every replay would draw the numbers the capture drew."""
    if not any(func is not _RETURNED for func, _, _ in trace.ops):
        raise GraphReplayError(f"{what} dispatched no op on the capturing thread: its graph would be empty")
    for op, (func, args, kwargs) in enumerate(trace.ops):
        if _UNREGISTERED in args or _UNREGISTERED in (v for _, v in kwargs):
            raise GraphReplayError(f"{what}: op {op}, {func}, draws from a generator not registered "
                                   "with the graph (pass it to capture's `generators`), so every "
                                   "replay would draw the numbers the capture drew")


def check_replay(captured: OpTrace, replayed: OpTrace, what: str = "a captured function") -> None:
    """Raise `GraphReplayError` at the first op where `replayed` differs from `captured`."""
    if captured.ops == replayed.ops:
        return
    n = min(len(captured.ops), len(replayed.ops))
    for op, (a, b) in enumerate(zip(captured.ops, replayed.ops)):
        if a != b:
            if (a[0] is _RETURNED) == (b[0] is _RETURNED):
                raise GraphReplayError(f"{what} replayed other than it was captured: op {op}, "
                                       f"{_difference(a, b)}")
            n = op  # one of them returned there: a count of ops differs
            break
    count = [sum(f is not _RETURNED for f, _, _ in t.ops) for t in (replayed, captured)]
    raise GraphReplayError(f"{what} replayed other than it was captured: {count[0]} ops where the "
                           f"capture ran {count[1]} (they part at op {n})")
