"""What a CUDA graph freezes, checked on a CPU: each replay must dispatch the captured ops.

A captured graph is a fixed list of kernels with fixed arguments: the same ops, the same
scalars, the same shapes and the same memory. A replay runs none of the Python that built it,
so a function captured as a graph must do, every time it is called, exactly what it did at
capture; whatever it read from the host (a position as an `int`, a length from a list, a tensor
made from Python values) is frozen at its capture-time value, and a tensor it reads that is not
one of the buffers that outlive the call (inputs, weights, caches) is gone after capture.

`OpTrace` records the ops a call dispatches: per op, the op, its non-tensor arguments, and per
tensor argument either the op of this call that made its memory (with the view's offset, shape
and strides) or, for memory made before the call, its address, offset, shape and strides.
`EagerGraphs` (the stand-in for `CudaGraphs` on machines without CUDA) records each captured
function this way and checks every replay against the record, so a function that would
replay other than it ran on a GPU fails its tests on a CPU, at the first op that differs and
naming it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_NESTED = (list, tuple)
_VALUES = frozenset((int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout,
                     torch.memory_format))


def _flatten(values, out: list) -> list:
    """An op's arguments (or outputs) as one flat list: a dispatched op's nest only in lists and
    tuples (cheaper than pytree's, which a trace would call twice per op)."""
    for v in values:
        if type(v) in _NESTED:
            _flatten(v, out)
        else:
            out.append(v)
    return out


class GraphReplayError(RuntimeError):
    """A replay of a captured function dispatched other than its capture did: on a GPU, its
    graph would have run the captured ops on the captured values instead."""


class OpTrace(TorchDispatchMode):
    """`with OpTrace() as t:` records `t.ops`, one entry per op dispatched inside: (op, its
    arguments described). `generators`: those registered with the graph."""

    def __init__(self, generators=()):
        super().__init__()
        self.generators = tuple(generators)
        self.ops: list[tuple] = []
        self._made: dict[int, tuple[int, int]] = {}  # storage address -> (op, output) that made it
        # every output kept alive while recording, so no memory made during the call is freed
        # and handed to a later tensor, which would then pass for the op that made it first
        self._outputs: list[torch.Tensor] = []

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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _flatten(args, [])
        if kwargs:
            _flatten(kwargs.items(), leaves)
        index, made, given = len(self.ops), self._made, set()
        if func is _LIFT_FRESH:  # a tensor made from Python values (`torch.tensor(...)`,
            # `t[i] = 1`): the graph holds the values it had at capture
            with torch._C.DisableTorchFunction(), _disable_current_modes():
                described = (("host values", tuple(leaves[0].reshape(-1).tolist())),)
        else:
            described = []
            for leaf in leaves:
                kind = type(leaf)
                if kind in _VALUES:
                    described.append(leaf)
                elif isinstance(leaf, torch.Tensor):
                    ptr = leaf.untyped_storage().data_ptr()
                    given.add(ptr)
                    maker = made.get(ptr)
                    # memory made by an op of this call, or from before it (by address)
                    described.append((maker if maker is not None else ptr, leaf.storage_offset(),
                                      leaf.shape, leaf.stride(), leaf.dtype))
                elif kind is torch.Generator:
                    described.append(self._generator(leaf))
                else:
                    described.append(("value", leaf))
            described = tuple(described)
        self.ops.append((func, described))
        out = func(*args, **kwargs)
        # new memory: an output whose storage is none of the arguments' (not a view of one nor
        # written into one; an op that may alias, like `to`, makes new memory when it copies)
        for i, t in enumerate(_flatten(out, []) if type(out) in _NESTED else (out,)):
            if isinstance(t, torch.Tensor):
                self._outputs.append(t)
                ptr = t.untyped_storage().data_ptr()
                if func is _LIFT_FRESH or ptr not in given:
                    made[ptr] = (index, i)
        return out


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


def _difference(captured: tuple, replayed: tuple) -> str:
    """Where and why an op's replay differs from its capture."""
    if captured[0] is not replayed[0]:
        return f"{replayed[0]} where the capture ran {captured[0]}"
    if len(captured[1]) != len(replayed[1]):
        return f"{captured[0]}: {len(replayed[1])} arguments where the capture had {len(captured[1])}"
    for i, (a, b) in enumerate(zip(captured[1], replayed[1])):
        if a == b:
            continue
        if _is_tensor(a) and _is_tensor(b) and type(a[0]) is int and type(b[0]) is int and a[0] != b[0]:
            why = ("a tensor not made by the graph whose memory is not capture's: one made during "
                   "the call outside the graph's ops (e.g. from host values), or another buffer; "
                   "the graph reads the memory it read at capture")
        elif _is_tensor(a) or _is_tensor(b) or (type(a) is tuple and a[:1] == ("generator",)):
            why = f"{_said(b)} where the capture read {_said(a)}"
        else:
            why = f"{_said(a)} at capture, {_said(b)} now: a value from the host, which the graph froze"
        return f"{captured[0]}, argument {i}: {why}"
    return f"{captured[0]}: differs"


_UNREGISTERED = ("generator", "not registered with the graph")


def check_capture(trace: OpTrace, what: str = "a captured function") -> None:
    """Raise `GraphReplayError` where a capture draws from a generator not registered with its
    graph: a replay would not advance its state, and every replay would draw the same numbers."""
    for op, (func, args) in enumerate(trace.ops):
        if _UNREGISTERED in args:
            raise GraphReplayError(f"{what}: op {op}, {func}, draws from a generator not registered "
                                   "with the graph (pass it to capture's `generators`), so every "
                                   "replay would draw the numbers the capture drew")


def check_replay(captured: OpTrace, replayed: OpTrace, what: str = "a captured function") -> None:
    """Raise `GraphReplayError` at the first op where `replayed` differs from `captured`."""
    if captured.ops == replayed.ops:
        return
    for op, (a, b) in enumerate(zip(captured.ops, replayed.ops)):
        if a != b:
            raise GraphReplayError(f"{what} replayed other than it was captured: op {op}, "
                                   f"{_difference(a, b)}")
    n = min(len(captured.ops), len(replayed.ops))
    raise GraphReplayError(f"{what} replayed other than it was captured: {len(replayed.ops)} ops "
                           f"where the capture ran {len(captured.ops)} (they part at op {n})")
