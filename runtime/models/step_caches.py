"""Caches that compiled steps own: the runtime's modules run over them unchanged.

The decode loop's eager modules (`qwen3`, `mtp`, `dflash`) take a cache object and call its
`write`; a cache that also has `positions` and `attend` places every row itself and attends
over its own storage, which is how the CPU packages (`backends.aoti_steps`) and the CUDA-graph
steps run the very forwards the torch backend runs:

- `PooledKV`: the rows of many sequences in one call, each over its own cache in a pool (per
  layer K [B, nkv, hd, S], slot-minor, so the scores of 16 slots are one vector FMA per feature;
  V [B, S, nkv, hd]); row t is sequence seq[t]'s entry at positions[t] and sees its slots up to
  `last_visible[t]` (by default its own position); a draft tree's rows (`hide`) are written at
  slots past their positions and hide the drafts that are not their ancestors;
- `SlotKV`: one sequence, per layer K and V [S, nkv, hd] (slot-major, so a prefix of a bigger
  buffer is a smaller cache);
- `LaneKV`: a pool of B sequences' caches (per layer K [B, nkv, hd, S] as `PooledKV`'s, V
  [B, nkv, S, hd]), R rows of each at a time (a whole-iteration graph's lanes, `spec.iteration`):
  each sequence's cache is read once for all its rows, as two batched matrix products whose
  operands are views of the pool, instead of once per row.

(`StepKV`, the exported ONNX graphs' cache, appends instead: its graph returns the new K/V.)

`PooledKV` and `SlotKV` attend over *all* S slots with a mask, written as reductions over one
row's data, so a row's bits depend on its sequence and position, never on how many rows the
call has (`LaneKV`'s products depend on the call's shapes: see it). A CPU
package's `PooledKV` may instead call metrale's kernel (`kernel=True`, `plugins.cpu_attention`),
which reads a row's visible slots only, under the same contract.
`linears("rowwise")` writes every projection as a reduction over its input features for the same
reason (a GEMM library picks other kernels at M = 1 than at M = 8).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from metrale.plugins import step_kernels
from metrale.plugins.cpu_attention import HIDE_BITS, visible_slots
from metrale.plugins.cpu_attention import pooled_math as pooled_attention


BASE_SLOTS = (256, 1088)  # slot buckets a request picks from (the CPU packages' and the graphs')


def buckets_to(top: int) -> tuple[int, ...]:
    """The slot buckets of caches of up to `top` slots: the base buckets below it, ×4 steps above
    them while under half of it, then `top`."""
    out = [s for s in BASE_SLOTS if s < top]
    s = out[-1] * 4 if out else top
    while 2 * s <= top:
        out.append(s)
        s *= 4
    return tuple(out) + (top,)


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [T, nh, hd]; k/v [S, nkv, hd] of one sequence; `visible` [T, S] bool (row t sees slot
    j) -> [T, nh·hd]."""
    t, nh, hd = q.shape
    s, nkv = k.shape[0], k.shape[1]
    qg = q.reshape(t, 1, nkv, nh // nkv, hd)
    scores = (qg * k.view(1, s, nkv, 1, hd)).sum(-1) * hd ** -0.5  # [T, S, nkv, g]
    probs = torch.softmax(scores.masked_fill(~visible[:, :, None, None], float("-inf")), dim=1)
    out = (probs.unsqueeze(-1) * v.view(1, s, nkv, 1, hd)).sum(1)  # [T, nkv, g, hd]
    return out.reshape(t, nh * hd)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[1, n, T, hd] (a module's heads-first layout, batch 1) -> [T, n, hd]."""
    return x[0].transpose(0, 1)


class PooledKV:
    """The rows of many sequences (batch 1, T rows) over a pool of caches, `kv` being per layer
    K [B, nkv, hd, S] then V [B, S, nkv, hd]; see the module docstring."""

    length = 0  # the modules' bookkeeping; every row carries its own position

    def __init__(self, kv, seq: torch.Tensor, positions: torch.Tensor, last_visible: torch.Tensor | None = None,
                 kernel: bool = False, hide: torch.Tensor | None = None):
        self.kv, self.seq, self.positions = kv, seq, positions
        self.slots = positions  # where each row's K/V goes
        if hide is not None:  # a tree's rows: written past their positions by the drafts they hide
            self.slots = positions + hidden_count(hide)
        self.last_visible = self.slots if last_visible is None else last_visible
        self.hide = hide
        self.kernel = kernel  # attend through `metrale::pooled_attention` (a CPU package's kernel)

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [1, nkv, T, hd] -> each row's slot of its sequence's cache."""
        self.kv[2 * layer][self.seq, :, :, self.slots] = _rows(k)  # keys slot-minor
        self.kv[2 * layer + 1].index_put_((self.seq, self.slots), _rows(v))

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [1, nh, T, hd] -> [1, T, nh·hd]."""
        k, v = self.kv[2 * layer], self.kv[2 * layer + 1]
        if self.kernel:  # the same math, reading each row's visible slots only (`plugins.cpu_attention`)
            if self.hide is not None:
                return torch.ops.metrale.pooled_tree_attention(_rows(q).contiguous(), k, v, self.seq,
                                                               self.last_visible, self.hide)[None]
            return torch.ops.metrale.pooled_attention(_rows(q).contiguous(), k, v, self.seq, self.last_visible)[None]
        return pooled_attention(_rows(q), k, v, self.seq, self.last_visible, self.hide)[None]


def hidden_count(hide: torch.Tensor) -> torch.Tensor:
    """Each row's hidden drafts (the set bits of hide [T] int64): a tree node's slot less its
    position."""
    shifts = torch.arange(HIDE_BITS + 1, device=hide.device)
    return (torch.bitwise_right_shift(hide[:, None], shifts) & 1).sum(1)


class LaneKV:
    """R rows of each of B sequences over a pool of their caches, `kv` per layer K
    [B, nkv, hd, S] then V [B, nkv, S, hd] (views of a bigger pool's lanes and first slots are a
    smaller pool); row t is sequence t // R's, written at slot `positions[t]` and seeing that
    sequence's slots up to `last_visible[t]` (default: its own position). `seq` [B·R] must be
    t // R (the caller's lane-major index, made once per shape): it places the writes, while
    the attention reads rows by that layout. The R rows of a
    sequence attend as one matrix product with its keys (scores [nkv, g·R, S]) and one with its
    values, both read in place, so the cache is read once per sequence, not once per row as
    `PooledKV` reads it; a row's bits then depend on R and S (the GEMMs' shapes), so two runs
    agree bit for bit where they run the same B, R and S. A draft tree's rows
    (`spec.tree_iteration`) are written at their `slots` instead of their positions and see
    what the given `hidden` [B, 1, R, S] leaves them."""

    length = 0

    def __init__(self, kv, seq: torch.Tensor, positions: torch.Tensor, last_visible: torch.Tensor | None = None,
                 kernel: bool = False, hide: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None):
        if kernel or hide is not None:
            raise ValueError("LaneKV attends with matrix products: no CPU kernel, no hidden-draft bits "
                             "(a draft tree's rows give `slots` and `hidden`)")
        self.kv, self.seq, self.positions = kv, seq, positions
        self.slots = positions if slots is None else slots  # where each row's K/V goes
        self.lanes = kv[0].shape[0]
        if positions.shape[0] % self.lanes:
            raise ValueError(f"{positions.shape[0]} rows are not R rows of each of {self.lanes} sequences")
        self.rows = positions.shape[0] // self.lanes
        self.last_visible = positions if last_visible is None else last_visible
        self.hidden = hidden  # [B, 1, R, S]: the slots a tree's row may not see (given)
        self._mask: torch.Tensor | None = hidden  # the same for every row (`_masked`)

    def _masked(self) -> torch.Tensor:
        """Which slots each row may not see, worked out at the first layer's attention (rows
        that are only written, a drafter's context, need none)."""
        if self._mask is None:
            s = self.kv[0].shape[-1]
            last = self.last_visible.view(self.lanes, 1, self.rows, 1)
            self._mask = torch.arange(s, device=last.device) > last
        return self._mask

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [1, nkv, B·R, hd] -> each row's slot of its sequence's cache."""
        self.kv[2 * layer][self.seq, :, :, self.slots] = _rows(k)  # keys slot-minor
        self.kv[2 * layer + 1][self.seq, :, self.slots] = _rows(v)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [1, nh, B·R, hd] -> [1, B·R, nh·hd]."""
        k, v = self.kv[2 * layer], self.kv[2 * layer + 1]  # [B, nkv, hd, S], [B, nkv, S, hd]
        b, r = self.lanes, self.rows
        nh, hd = q.shape[1], q.shape[3]
        nkv, s = k.shape[1], k.shape[3]
        g = nh // nkv
        if (step_kernels.use(q) and hd >= 16 and hd & (hd - 1) == 0
                and g * r <= step_kernels.LANE_MAX_ROWS):  # a GPU: one launch
            return step_kernels.lane_attention(q, k, v, self.last_visible, self.hidden, r)
        # scaled before the product: the queries are R rows, the scores R·S
        qs = q[0].reshape(nkv, g, b, r, hd).permute(2, 0, 1, 3, 4).reshape(b, nkv, g * r, hd) * hd ** -0.5
        scores = torch.matmul(qs, k).view(b, nkv, g, r, s)
        probs = torch.softmax(scores.masked_fill(self._masked()[:, :, None], float("-inf")), dim=-1)
        out = torch.matmul(probs.view(b, nkv, g * r, s), v)  # [B, nkv, g·R, hd]
        return out.view(b, nkv, g, r, hd).permute(0, 3, 1, 2, 4).reshape(1, b * r, nh * hd)


class SlotKV:
    """One sequence's rows at `positions` [T] over its cache, `kv` being per layer K then V
    [S, nkv, hd]; see the module docstring. Row t is written at slot `slots[t]` (by default its
    position) and sees the slots up to it but those `hide` names (a draft tree's rows, as
    `PooledKV`'s); which slots each row sees is worked out once, for every layer."""

    length = 0

    def __init__(self, kv, positions: torch.Tensor, slots: torch.Tensor | None = None,
                 hide: torch.Tensor | None = None):
        self.kv, self.positions = kv, positions
        self.slots = positions if slots is None else slots
        self.visible = visible_slots(kv[0].shape[0], self.slots, hide)  # [T, S]

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[2 * layer].index_copy_(0, self.slots, _rows(k))
        self.kv[2 * layer + 1].index_copy_(0, self.slots, _rows(v))

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return slot_attention(_rows(q), self.kv[2 * layer], self.kv[2 * layer + 1], self.visible)[None]


class TreeKV:
    """A draft tree's verify rows over a `kv_cache.KVCache` (the eager target's): node i is
    written at slot base+i (base: the cache's length, the root's position), sits at position
    base+depth_i and attends to the slots before the root and its ancestors' (`Tree.mask`).
    The modules run on it unchanged (`positions`, `write`, `mask`); the cache's length stays at
    base until the accepted path is kept (`KVCache.keep_path`)."""

    def __init__(self, cache, tree):
        self.cache, self.base = cache, cache.length
        device = cache.k.device
        self.positions = self.base + torch.tensor(tree.depths, device=device)
        own = tree.mask().to(device)  # [N, N]: a node sees itself and its ancestors
        self._mask = torch.cat([own.new_ones(own.shape[0], self.base), own], dim=1)
        self.length = self.base

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor):
        return self.cache.write(layer, self.base, k, v)

    def mask(self, t: int, start, device) -> torch.Tensor:
        return self._mask


class StepKV:
    """A step's K/V as an exported graph holds them: `past_key`/`past_value` [L, B, nkv, P, hd]
    whole, slots at or after `position` (a [1] tensor: the first new position) masked out, and
    the new keys/values appended, not written back — `new_kv` returns them [L, B, nkv, T, hd]
    for the caller to store at `position`. The runtime modules run on it unchanged (`write` and
    `mask` are `KVCache`'s), so the ONNX export traces the very forward the torch backend runs.

    `tree_mask` [T, T] bool (new row i sees new row j; the target's graph input): the new rows
    are a draft tree's, row i at position `position` + its depth (its visible new rows less one:
    itself and its ancestors) and seeing its ancestors only, as `TreeKV` places them. A chain's
    mask is the causal one, which gives every row the chain's position and visibility."""

    def __init__(self, past_key: torch.Tensor, past_value: torch.Tensor, position: torch.Tensor,
                 tree_mask: torch.Tensor | None = None):
        self.past_key, self.past_value, self.position = past_key, past_value, position
        self.length = position
        self.tree_mask = tree_mask
        # each row's offset from `position` (None: 0..T−1); summed in float, which every
        # runtime reduces, and exact for any row count a profile takes
        self.depths = None if tree_mask is None else tree_mask.float().sum(1).long() - 1
        self._new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer: int, start, k: torch.Tensor, v: torch.Tensor):
        self._new[layer] = (k, v)
        return (torch.cat([self.past_key[layer], k], dim=2),
                torch.cat([self.past_value[layer], v], dim=2))

    def mask(self, t: int, start, device) -> torch.Tensor:
        """[T, P+T]: past slot j is visible iff j < position; new row i sees new rows 0..i (or
        those `tree_mask` names)."""
        p = self.past_key.shape[3]
        past = (torch.arange(p, device=device)[None, :] < self.position).expand(t, p)
        if self.tree_mask is not None:
            return torch.cat([past, self.tree_mask], dim=1)
        rows = torch.arange(t, device=device)
        return torch.cat([past, rows[None, :] <= rows[:, None]], dim=1)

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        layers = [self._new[i] for i in sorted(self._new)]
        return torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T as a reduction over K: compiled, every output element is one
    loop over K whose order depends on K alone."""
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias


class _RowwiseLinears(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return rowwise_linear(*args, **kwargs)
        return func(*args, **kwargs)


LINEARS = ("gemm", "rowwise")


def linears(kind: str):
    """A context in which the modules' projections are GEMMs ("gemm": as written) or reductions
    over their input features ("rowwise", for a trace: row-invariant by construction)."""
    if kind not in LINEARS:
        raise ValueError(f"linear {kind!r}: expected one of {LINEARS}")
    return _RowwiseLinears() if kind == "rowwise" else contextlib.nullcontext()
