"""The batched steps of the `aoti` backend: one package call over the rows of many sequences,
each reading its own cache — the target's (`BatchedTarget`), the MTP head's draft chains
(`BatchedMTP`) and DFlash/DFlash2 block proposes (`BatchedDFlash`).

Caches live in pools, one per slot count S (a request's S is its own length rounded up to 64
slots, `aoti.slots_for`, so it depends on the request alone): per layer K [B, nkv, hd, S] and V
[B, S, nkv, hd], sequence b's cache being [b]. A `PooledCache` is one sequence's place in its
pool: it holds the index and the sequence's length, and gives its place back when it is freed.

`BatchedTarget.forward_many(forwards)` runs the target rows every given sequence needs next
(`backends.Forward`: a prefill, a plain step's pending token, a verify's pending token and drafts)
in as few package calls as there are pools among them (more when the rows exceed the package's
`rows`: they go in order, chunk after chunk, so a sequence's later rows read the K/V its
earlier rows wrote). Each row of the package reads its own sequence's slots only (attention
over all S slots, masked from its position on, and the per-row reductions of `aoti_steps`), so
its bits depend on its token, position and its sequence's cache — never on which other
sequences share the call, how many rows it has, or the pool's size. That is what makes every
answer under any concurrency equal to the same request served alone (the build checks it:
`cpu_check`). A stale slot (a freed sequence's K/V) is never visible: it lies at or after the
new sequence's length, masked, and is overwritten before a row at its position reads it.

With more than one torch thread, a forward's sequences are split into parts of about equal
rows that run at once, one package call per thread (`aoti_native.Lanes`: the calls release the
GIL and each is single-threaded as compiled), which a row's bits do not depend on either.

`__call__(ids, cache, start, taps)` is `forward_many` of one sequence: the decode face the
decode loop and the proposers run on, as `aoti.CompiledTarget`'s.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from metrale.runtime.artifact.entries import CpuPackage, CpuPackages
from metrale.runtime.backends.aoti import (CompiledDFlash, CompiledMTP, CompiledTarget, Package, TargetFace,
                                           _Rows, slots_for)
from metrale.runtime.backends.aoti_native import Lanes
from metrale.runtime.models.qwen3 import TargetOutput

FIRST_CAPACITY = 4  # sequences a pool holds before it first grows (it doubles when full)


class KVPool:
    """The caches of the sequences of one slot count: per layer K [B, nkv, hd, S] (slot-minor,
    see `aoti_steps.pooled_attention`) and V [B, S, nkv, hd]."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, dtype, device,
                 capacity: int = FIRST_CAPACITY):
        self.slots = slots
        keys, values = (capacity, kv_heads, head_dim, slots), (capacity, slots, kv_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device)
                   for _ in range(layers) for shape in (keys, values)]
        self.free = list(range(capacity - 1, -1, -1))  # popped from the end: lowest index first

    @property
    def capacity(self) -> int:
        return self.kv[0].shape[0]

    @property
    def in_use(self) -> int:
        return self.capacity - len(self.free)

    def acquire(self) -> int:
        if not self.free:
            old = self.capacity
            grown = []
            for t in self.kv:
                g = t.new_zeros(2 * old, *t.shape[1:])
                g[:old].copy_(t)
                grown.append(g)
            self.kv = grown
            self.free = list(range(2 * old - 1, old - 1, -1))
        return self.free.pop()

    def release(self, index: int) -> None:
        self.free.append(index)


class PooledCache:
    """One sequence's cache: place `index` of `pool`; `length` counts its valid positions;
    `pending`: a drafter's context rows added since its last propose (`BatchedDFlash`)."""

    def __init__(self, pool: KVPool):
        self.pool, self.index, self.length = pool, pool.acquire(), 0
        self.pending: list[torch.Tensor] = []
        weakref.finalize(self, pool.release, self.index)

    @property
    def max_len(self) -> int:
        return self.pool.slots

    @property
    def kv(self) -> list[torch.Tensor]:
        """Per layer K [nkv, hd, S] and V [S, nkv, hd] (views of the pool, valid until it next
        grows)."""
        return [t[self.index] for t in self.pool.kv]

    @property
    def device(self) -> torch.device:
        return self.pool.kv[0].device


def _places(forwards, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's position and sequence (its cache's place in the pool), forwards in order: a
    forward's T rows sit at positions start.. of its cache."""
    pos, seq = [], []
    for f, start in zip(forwards, starts):
        pos.extend(range(start, start + f.rows))
        seq.extend([f.cache.index] * f.rows)
    return torch.tensor(pos), torch.tensor(seq)


def _by_pool(forwards, starts: list[int]) -> dict[int, list[int]]:
    """The forwards' indices grouped by their caches' pool, each checked to fit its cache."""
    groups: dict[int, list[int]] = {}
    for i, (f, start) in enumerate(zip(forwards, starts)):
        if start + f.rows > f.cache.max_len:
            raise ValueError(f"positions up to {start + f.rows} exceed the cache's "
                             f"{f.cache.max_len} slots")
        groups.setdefault(id(f.cache.pool), []).append(i)
    return groups


def _parts(lanes: Lanes, groups: dict[int, list[int]], forwards) -> list[list[int]]:
    """Every pool's forwards cut into the parts the lanes run at once (`Lanes.split`)."""
    return [p for members in groups.values() for p in lanes.split(members, [forwards[i].rows for i in members])]


@dataclass(frozen=True)
class _Rows1D:
    """The flattened rows of one pool's forwards."""

    ids: torch.Tensor
    pos: torch.Tensor
    seq: torch.Tensor
    want: list[int]  # the rows whose logits are needed


class BatchedTarget(TargetFace):
    """The target's decode face over one batched package (see the module docstring)."""

    @classmethod
    def from_packages(cls, model, loaded: list[tuple[CpuPackage, Package]], cpu: CpuPackages, where: str):
        """The face of the target's `cpu` entry: this one for a batched package, else (an
        engine built before batching) `aoti.CompiledTarget`, one sequence per call."""
        if not loaded[0][0].batched:
            return CompiledTarget.from_packages(model, loaded, cpu, where)
        return cls(model, loaded[0][1], tuple(cpu.taps), cpu.max_slots, Lanes(loaded[0][1].lanes))

    def __init__(self, model, package: Package, taps: tuple[int, ...], max_slots: int,
                 lanes: Lanes | None = None):
        super().__init__(model, taps, max_slots)
        self.lanes = lanes or Lanes(1)
        self.rows = _Rows([package], "target")
        self.package = package
        self.packages = [package]
        self.max_rows = package.rows
        self.pools: dict[int, KVPool] = {}

    def new_cache(self, batch: int, max_len: int) -> PooledCache:
        """A place for `max_len` positions in the pool of its slot count (no padding rows: the
        package takes any row count, so a request's slots are its length rounded up to 64, and
        its attention runs over no more of them)."""
        if batch != 1:
            raise ValueError("the aoti backend holds one sequence per cache")
        slots = slots_for(max_len, self.max_slots, "target")
        pool = self.pools.get(slots)
        if pool is None:
            c = self.config
            pool = self.pools[slots] = KVPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                              slots, self.dtype, self.model.embed_tokens.weight.device)
        return PooledCache(pool)

    def __call__(self, ids: torch.Tensor, cache: PooledCache, start: int | None = None,
                 taps: tuple[int, ...] = ()) -> TargetOutput:
        """ids [1, T] at positions start.. (default cache.length); cache.length becomes start+T."""
        from metrale.runtime.backends import Forward

        if start is not None:
            cache.length = start
        return self.forward_many([Forward(ids, cache, tuple(taps))])[0]

    def forward_many(self, forwards) -> list[TargetOutput]:
        """The target outputs of each `backends.Forward` (rows ids [1, T] of a distinct cache at
        its length), in order; each cache's length grows by its T."""
        groups = _by_pool(forwards, [f.cache.length for f in forwards])
        results: list[TargetOutput | None] = [None] * len(forwards)

        def part(members: list[int]) -> None:
            mine = [forwards[i] for i in members]
            outs = self._run(mine)
            greedy = outs[0].argmax(dim=-1).tolist()  # every logit row's, in one call
            offset = lo = 0  # into the rows, into the logit rows
            for i, f in zip(members, mine):
                t = f.ids.shape[1]
                n = 1 if f.last_logits else t
                rows = slice(offset, offset + t)
                results[i] = TargetOutput(logits=outs[0][lo:lo + n][None], last_hidden=outs[1][rows][None],
                                          taps=self.select_taps(outs[2][rows][None], f.taps) if f.taps else None,
                                          argmax=greedy[lo:lo + n])
                offset, lo = offset + t, lo + n

        # lengths move only once every call succeeded: a failed batch leaves each cache as it
        # was (its slots written again, with the same values, by a retry)
        self.lanes.run(part, _parts(self.lanes, groups, forwards))
        for f in forwards:
            f.cache.length += f.ids.shape[1]
        return results

    def _flatten(self, forwards) -> _Rows1D:
        ids, want, n = [], [], 0
        for f in forwards:
            t = f.ids.shape[1]
            ids.append(f.ids[0])
            want.extend([n + t - 1] if f.last_logits else range(n, n + t))
            n += t
        pos, seq = _places(forwards, [f.cache.length for f in forwards])
        return _Rows1D(ids[0] if len(ids) == 1 else torch.cat(ids), pos, seq, want)

    def _run(self, forwards) -> list[torch.Tensor]:
        """One pool's rows, in package calls of at most `max_rows` rows, concatenated (logits:
        of the wanted rows only)."""
        rows = self._flatten(forwards)
        kv = forwards[0].cache.pool.kv
        n, step = rows.ids.shape[0], self.max_rows
        parts = []
        for c in range(0, n, step):
            want = [w - c for w in rows.want if c <= w < c + step]
            if not want:  # a chunk inside a prompt: its last row stands in (its logits dropped)
                want = [min(step, n - c) - 1]
            out = self.package(rows.ids[c:c + step], rows.pos[c:c + step], rows.seq[c:c + step],
                               torch.tensor(want), *kv)
            if not any(c <= w < c + step for w in rows.want):
                out = [out[0][:0], *out[1:]]
            parts.append(out)
        if len(parts) == 1:
            return parts[0]
        return [torch.cat([p[j] for p in parts]) for j in range(len(parts[0]))]


class BatchedMTP:
    """The MTP head's face over its batched package: `new_cache` and `__call__` as
    `aoti.CompiledMTP`'s, plus `forward_many`, the entries of many sequences' draft chains
    (`backends.HeadForward`) in one package call per pool. Caches are `PooledCache`s of the
    head's one layer, pooled by slot count as the target's are."""

    @classmethod
    def from_packages(cls, head, loaded: list[tuple[CpuPackage, Package]], cpu: CpuPackages, where: str):
        """The face of the head's `cpu` entry: this one for a batched package, else (an engine
        built before batching) `aoti.CompiledMTP`, one sequence per call."""
        if not loaded[0][0].batched:
            return CompiledMTP.from_packages(head, loaded, cpu, where)
        return cls(head, loaded[0][1], cpu.max_slots)

    def __init__(self, head, package: Package, max_slots: int):
        self.config = head.config
        self.package, self.max_rows, self.max_slots = package, package.rows, max_slots
        self.pools: dict[int, KVPool] = {}

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device="cpu") -> PooledCache:
        if batch != 1:
            raise ValueError("the aoti backend holds one sequence per cache")
        slots = slots_for(max_len, self.max_slots, "mtp")
        pool = self.pools.get(slots)
        if pool is None:
            d = self.config.decoder
            pool = self.pools[slots] = KVPool(1, d.num_key_value_heads, d.head_dim, slots, dtype, device)
        return PooledCache(pool)

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: PooledCache,
                 start: int | None = None):
        """Entries start.. of embeds/hidden [1, T, H] -> (logits [1, T, V], h [1, T, H])."""
        from metrale.runtime.backends import HeadForward

        return self.forward_many([HeadForward(self, embeds, hidden, cache, start)])[0]

    def forward_many(self, forwards) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each `HeadForward`'s (logits [1, T, V], h [1, T, H]), in order; each cache's length
        becomes its start + T once every call succeeded."""
        starts = [f.cache.length if f.start is None else f.start for f in forwards]
        results: list = [None] * len(forwards)
        for members in _by_pool(forwards, starts).values():
            mine = [forwards[i] for i in members]
            pos, seq = _places(mine, [starts[i] for i in members])
            embeds = torch.cat([f.embeds[0] for f in mine])
            hidden = torch.cat([f.hidden[0] for f in mine])
            kv = mine[0].cache.pool.kv
            parts = [self.package(embeds[c:c + self.max_rows], hidden[c:c + self.max_rows],
                                  pos[c:c + self.max_rows], seq[c:c + self.max_rows], *kv)
                     for c in range(0, embeds.shape[0], self.max_rows)]
            logits = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
            hs = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
            offset = 0
            for i, f in zip(members, mine):
                results[i] = (logits[offset:offset + f.rows][None], hs[offset:offset + f.rows][None])
                offset += f.rows
        for f, start in zip(forwards, starts):
            f.cache.length = start + f.rows
        return results


class BatchedDFlash(CompiledDFlash):
    """The DFlash/DFlash2 drafter's face over its batched package: `new_cache`, `add_context`
    and `propose` as `aoti.CompiledDFlash`'s, plus `forward_many`, the blocks of many
    sequences' `backends.DraftForward`s in one package call per pool. Context added with
    `add_context` waits in the cache's `pending` rows and enters the cache with the next
    propose, up to `feed` rows through the package; a longer backlog's older rows are fed first
    by the eager drafter's context projection, as `CompiledDFlash` does."""

    @classmethod
    def from_packages(cls, drafter, loaded: list[tuple[CpuPackage, Package]], cpu: CpuPackages, where: str):
        if not loaded[0][0].batched:  # an engine built before batching: one sequence per call
            return CompiledDFlash.from_packages(drafter, loaded, cpu, where)
        return super().from_packages(drafter, loaded, cpu, where)  # its block and feed checked

    def __init__(self, drafter, package: Package, feed: int, max_slots: int):
        super().__init__(drafter, package, feed, max_slots)
        self.pools: dict[int, KVPool] = {}

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device="cpu") -> PooledCache:
        if batch != 1:
            raise ValueError("the aoti backend holds one sequence per cache")
        slots = slots_for(max_len + self.block, self.max_slots, "dflash")  # a block past the context
        pool = self.pools.get(slots)
        if pool is None:
            d = self.config.decoder
            pool = self.pools[slots] = KVPool(d.num_hidden_layers, d.num_key_value_heads, d.head_dim,
                                              slots, dtype, device)
        return PooledCache(pool)

    def propose(self, anchor: torch.Tensor, embed, cache: PooledCache, gamma: int):
        """anchor [1] -> a `dflash.Proposal` of γ−1 drafts (the pending context fed first)."""
        from metrale.runtime.backends import DraftForward

        return self.forward_many([DraftForward(self, anchor, embed, cache, gamma)])[0]

    def _backlog(self, f) -> tuple[torch.Tensor, int]:
        """A forward's pending rows [1, n, ·] (none: [1, 0, ·]), the older ones past the last
        `feed` written now by the eager projection (again, with the same values, on a retry)
        -> (the rows the package feeds, how many were fed eagerly)."""
        c = self.config
        rows = f.cache.pending[0] if len(f.cache.pending) == 1 else (
            torch.cat(f.cache.pending, dim=1) if f.cache.pending else
            torch.zeros(1, 0, c.num_context_features * c.target_hidden_size, dtype=f.cache.pool.kv[0].dtype))
        older = max(0, rows.shape[1] - self.feed)
        if older:
            start = f.cache.length
            if start + rows.shape[1] + self.block > f.cache.max_len:
                raise ValueError(f"drafter context up to {start + rows.shape[1] + self.block} exceeds "
                                 f"the cache's {f.cache.max_len} slots")
            positions = torch.arange(start, start + older)
            kv = f.cache.kv
            for i, (k, v) in enumerate(self.eager.context_kv(rows[:, :older], positions)):  # [1, nkv, n, hd]
                kv[2 * i][:, :, start:start + older] = k[0].transpose(1, 2)  # keys slot-minor
                kv[2 * i + 1][start:start + older] = v[0].transpose(0, 1)
        return rows[0, older:], older

    def forward_many(self, forwards) -> list:
        """Each `DraftForward`'s `Proposal` (γ−1 drafts), in order; each cache's pending rows
        enter it, its length moving past them, once every call succeeded."""
        from metrale.runtime.models.dflash import Proposal

        for f in forwards:
            if not 1 < f.gamma <= self.block:
                raise ValueError(f"γ = {f.gamma}: the drafter's CPU package proposes blocks of 2..{self.block}")
        fed = [self._backlog(f) for f in forwards]
        results: list = [None] * len(forwards)
        for members in _by_pool(forwards, [f.cache.length for f in forwards]).values():
            feats, pos, seq, anchor_pos = [], [], [], []
            for i in members:
                f, (rows, older) = forwards[i], fed[i]
                start = f.cache.length + older
                if start + rows.shape[0] + self.block > f.cache.max_len:
                    raise ValueError(f"drafter context up to {start + rows.shape[0] + self.block} "
                                     f"exceeds the cache's {f.cache.max_len} slots")
                feats.append(rows)
                pos.extend(range(start, start + rows.shape[0]))
                seq.extend([f.cache.index] * rows.shape[0])
                anchor_pos.append(start + rows.shape[0])
            if not pos:  # nothing to feed: one stand-in row at a slot the block overwrites
                feats.append(fed[members[0]][0].new_zeros(1, fed[members[0]][0].shape[1]))
                pos.append(anchor_pos[0])
                seq.append(forwards[members[0]].cache.index)
            block = torch.full((len(members), self.block), self.config.mask_token_id, dtype=torch.long)
            block[:, 0] = torch.cat([forwards[i].anchor.reshape(-1)[:1].cpu() for i in members])
            drafts = self.package(torch.cat(feats), torch.tensor(pos), torch.tensor(seq), block,
                                  torch.tensor([forwards[i].cache.index for i in members]),
                                  torch.tensor(anchor_pos), torch.tensor([forwards[i].gamma for i in members]),
                                  *forwards[members[0]].cache.pool.kv)[0]
            for q, i in enumerate(members):
                results[i] = Proposal(tokens=drafts[q, :forwards[i].gamma - 1][None], logits=None)
        for f, (rows, older) in zip(forwards, fed):
            f.cache.pending = []
            f.cache.length += older + rows.shape[0]
        return results
