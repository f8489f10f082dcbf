"""The batched steps of the `aoti` backend: one package call over the rows of many sequences,
each reading its own cache — the target's (`BatchedTarget`), the MTP head's draft chains
(`BatchedMTP`); DFlash/DFlash2 block proposes batch the same way (`aoti_dflash.BatchedDFlash`).

Caches live in pools, one per slot count S (a request's S is its own length rounded up to 64
slots, `aoti.slots_for`, so it depends on the request alone): per layer K [B, nkv, hd, S] and V
[B, S, nkv, hd], sequence b's cache being [b]. A `PooledCache` is one sequence's place in its
pool: it holds the index and the sequence's length, and gives its place back when it is freed
(`kv_pool`).

`BatchedTarget.forward_many(forwards)` runs the target rows every given sequence needs next
(`backends.Forward`: a prefill, a plain step's pending token, a verify's pending token and drafts)
in as few package calls as there are pools among them (more when the rows exceed the package's
`rows`: they go in order, chunk after chunk, so a sequence's later rows read the K/V its
earlier rows wrote). Each row of the package reads its own sequence's slots only (attention
over all S slots, masked from its position on, and the per-row reductions of `step_caches`), so
its bits depend on its token, position and its sequence's cache — never on which other
sequences share the call, how many rows it has, or the pool's size. That is what makes every
answer under any concurrency equal to the same request served alone (the build checks it:
`cpu_check`). A stale slot (a freed sequence's K/V) is never visible: it lies at or after the
new sequence's length, masked, and is overwritten before a row at its position reads it.

With more than one torch thread, a forward's sequences are split into parts of about equal
rows that run at once, one package call per thread (`aoti_native.Lanes`: the calls release the
GIL and each is single-threaded as compiled), which a row's bits do not depend on either.

A draft tree's verify (`Forward.tree`) runs as the rows of one forward where the package takes
each row's hidden drafts (`CpuPackage.tree_rows`, `aoti_steps.BatchedTreeTargetStep`): node i
at its position, written at slot length + i, seeing the slots before the tree's first draft and
its ancestors' only; the cache's length stays, and `PooledCache.keep_path` moves the accepted
path into place. Its attention kernel gives each node's row the bits of the same row in a chain
verify of the node's path (the build checks it: `tree_rows_bit_identical`), so a tree's accepted
rows are plain decoding's.

`__call__(ids, cache, start, taps)` is `forward_many` of one sequence: the decode face the
decode loop and the proposers run on, as `aoti.CompiledTarget`'s.
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.runtime.artifact.entries import CpuPackage, CpuPackages
from metrale.runtime.backends.aoti import CompiledMTP, CompiledTarget, Package, TargetFace, _Rows, slots_for
from metrale.runtime.backends import argmax_rows
from metrale.runtime.backends.aoti_native import Lanes
from metrale.runtime.backends.kv_pool import KVPool, PooledCache
from metrale.runtime.backends.prefix_cache import PrefixCache
from metrale.runtime.models.qwen3 import TargetOutput
from metrale.runtime.steps import BatchedFace, Forward, HeadForward

def _longs(values: list[int]) -> torch.Tensor:
    """Python ints as an int64 tensor, through numpy (quicker than torch.tensor of the list; a
    decode step's planning makes four such tensors)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _places(forwards, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's position and sequence (its cache's place in the pool), forwards in order: a
    forward's T rows sit at positions start.. of its cache."""
    if sum(f.rows for f in forwards) > 256:  # prompts: ranges (a long list converts slowly)
        return (torch.cat([torch.arange(s, s + f.rows) for f, s in zip(forwards, starts)]),
                torch.cat([torch.full((f.rows,), f.cache.index) for f in forwards]))
    pos, seq = [], []
    for f, start in zip(forwards, starts):
        pos.extend(range(start, start + f.rows))
        seq.extend([f.cache.index] * f.rows)
    return _longs(pos), _longs(seq)


def _tree_places(forwards, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and hidden drafts (`spec.ddtree.Tree.hidden_bits`) of a part's rows, forwards
    in order, where some are draft trees': node i of a tree sits at its cache's length plus its
    depth; every other row hides nothing."""
    pos, hide, n = pos.clone(), torch.zeros_like(pos), 0
    for f in forwards:
        if f.tree is not None:
            pos[n:n + f.rows] = f.cache.length + _longs(list(f.tree.depths))
            hide[n:n + f.rows] = _longs(f.tree.hidden_bits())
        n += f.rows
    return pos, hide


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
    """Every pool's forwards (`forwards[i]` for the indices in `groups`) cut into the parts the
    lanes run at once (`Lanes.split`)."""
    return [p for members in groups.values() if members
            for p in lanes.split(members, [forwards[i].rows for i in members])]


class BatchedTarget(TargetFace, BatchedFace):
    """The target's decode face over one batched package (see the module docstring)."""

    @classmethod
    def from_packages(cls, model, loaded: list[tuple[CpuPackage, Package]], cpu: CpuPackages, where: str):
        """The face of the target's `cpu` entry: this one for a batched package, else (an
        engine built before batching) `aoti.CompiledTarget`, one sequence per call."""
        entry = loaded[0][0]
        if not entry.batched:
            return CompiledTarget.from_packages(model, loaded, cpu, where)
        return cls(model, loaded[0][1], tuple(cpu.taps), cpu.max_slots, Lanes(loaded[0][1].lanes),
                   entry.tree_rows, entry.tree_rows and cpu.check.get("tree_rows_bit_identical") is True)

    def __init__(self, model, package: Package, taps: tuple[int, ...], max_slots: int,
                 lanes: Lanes | None = None, hides: bool = False, tree_rows: bool = False):
        super().__init__(model, taps, max_slots)
        self.hides = hides  # the package takes each row's hidden drafts (`_tree_places`)
        # a draft tree's rows run in one forward, each with its path's chain row's bits (the
        # decode loop then verifies trees so: `LoadedEngine.tree_attention`)
        self.tree_rows = tree_rows
        # each call's `hide` where no row is a tree's, by row count: made once, not per call
        self._no_hide = [torch.zeros(n, dtype=torch.long) for n in range(package.rows + 1)]
        self.lanes = lanes or Lanes(1)
        self.prefix_cache: PrefixCache | None = None  # set by `serve --prefix-cache-tokens`
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
        if start is not None:
            cache.length = start
        return self.forward_many([Forward(ids, cache, tuple(taps))])[0]

    def forward_many(self, forwards) -> list[TargetOutput]:
        """The target outputs of each `backends.Forward` (rows ids [1, T] of a distinct cache at
        its length), in order; each cache's length grows by its T. With a `prefix_cache`, a
        prompt reuses the kept positions it starts with (`prefix_cache`: the same bits)."""
        # decode steps of one row each (and prompts the prefix cache holds whole, which run no
        # row): what a busy batch runs at almost every iteration, planned by _step_plans
        step = [f.rows == 1 and f.tokens is not None and not f.last_logits and f.tree is None for f in forwards]
        if not all(step):  # each fits its cache, checked before the prefix cache is asked
            groups = _by_pool(forwards, [f.cache.length for f in forwards])
        hits = self._lookups(forwards)
        runs = {i: f if i not in hits else Forward(f.ids[:, hits[i].reused:], f.cache, f.taps, True)
                for i, f in enumerate(forwards) if i not in hits or not hits[i].whole}
        steps = all(step[i] for i in runs)
        if not steps:
            parts = _parts(self.lanes, {k: [i for i in m if i in runs] for k, m in groups.items()}, runs)
        # lengths move only once every call succeeded: a failed batch leaves each cache as it
        # was (its slots written again, with the same values, by a retry)
        try:
            for i, hit in hits.items():
                self._reuse(hit, forwards[i].cache)
                forwards[i].served = hit.reused
            if steps:
                parts, plans = self._step_plans(runs)
            else:
                plans = [self._plan([runs[i] for i in p]) for p in parts]
            done = self.lanes.map(_call_all, plans)  # the package calls only, a part per lane
        finally:
            for i in hits:
                forwards[i].cache.length = 0
        results: list = [None] * len(forwards)
        for members, plan, outs in zip(parts, plans, done):
            self._give(members, runs, _joined_calls(plan, outs), results)
        for i, hit in hits.items():
            results[i] = self._reused(hit, results[i], forwards[i])
        for f in forwards:
            if f.tree is None:  # a tree's rows wait for `keep_path`
                f.cache.length += f.rows
        return results

    def _step_plans(self, runs: dict) -> tuple[list[list[int]], list[list[tuple]]]:
        """The parts and package calls of one-row steps (`runs`' values, each a token given as a
        list): each input of a call made by one comprehension over its sequences, not row by
        row as `_plan` makes a prompt's; each step checked to fit its cache."""
        groups: dict[int, list[int]] = {}
        for i, f in runs.items():
            groups.setdefault(id(f.cache.pool), []).append(i)
        parts = _parts(self.lanes, groups, runs)
        plans = []
        for part in parts:
            caches = [runs[i].cache for i in part]
            pos, pool = [c.length for c in caches], caches[0].pool
            if max(pos) >= pool.slots:
                raise ValueError(f"positions up to {max(pos) + 1} exceed the cache's {pool.slots} slots")
            plans.append(self._calls(_longs([runs[i].tokens[0] for i in part]), _longs(pos),
                                     _longs([c.index for c in caches]), range(len(part)), pool.kv))
        return parts, plans

    def _give(self, members: list[int], runs: dict, outs: list[torch.Tensor], results: list) -> None:
        """Each run forward's output, its rows' views of one part's outputs (a prompt's kept)."""
        greedy = argmax_rows(outs[0])  # every logit row's, in one call
        taps = outs[2] if len(outs) > 2 else None
        offset = lo = 0  # into the rows, into the logit rows
        for i in members:
            f = runs[i]
            t = f.rows
            n = 1 if f.last_logits else t
            results[i] = _RowsOutput(self, outs[0], outs[1], taps, offset, t, lo, n, f.taps, greedy[lo:lo + n])
            if f.last_logits and f.cache.length == 0 and self.prefix_cache is not None:
                out = results[i]
                self._keep(f, out.rows("hidden"), out.rows("taps"), out.rows("logits"), out.argmax)
            offset, lo = offset + t, lo + n

    def _keep(self, f, hidden, taps, logits, argmax) -> None:
        """A whole prompt's rows into the prefix cache, with its K/V as its cache now holds them."""
        self.prefix_cache.keep(tuple(f.token_ids()), *f.cache.read_prefix(f.rows), hidden, taps, logits, argmax)

    def _lookups(self, forwards) -> dict:
        """The prefix-cache hits of the prompts among `forwards` (their index -> `Hit`)."""
        if self.prefix_cache is None:
            return {}
        hits = {}
        for i, f in enumerate(forwards):
            if f.last_logits and f.cache.length == 0:
                hit = self.prefix_cache.lookup(tuple(f.token_ids()))
                if hit is not None:
                    hits[i] = hit
        return hits

    @staticmethod
    def _reuse(hit, cache: PooledCache) -> None:
        """The hit's positions' K/V into `cache` (its length then the positions reused)."""
        cache.write_prefix(hit.entry.k, hit.entry.v, hit.reused)

    def _reused(self, hit, ran, f) -> TargetOutput:
        """A prompt's output from the kept positions it reused, then the rows it ran (if any);
        a prompt only partly kept is kept whole now."""
        e, n = hit.entry, hit.reused
        if ran is None:  # the whole prompt was kept
            logits, hidden, taps, argmax = e.logits, e.last_hidden, e.taps, list(e.argmax)
        else:
            logits, argmax = ran.rows("logits"), ran.argmax
            hidden = torch.cat([e.last_hidden[:n], ran.rows("hidden")])
            taps = None if e.taps is None else torch.cat([e.taps[:n], ran.rows("taps")])
            self._keep(f, hidden, taps, logits, argmax)
        return TargetOutput(logits=logits[None], last_hidden=hidden[None],
                            taps=self.select_taps(taps[None], f.taps) if f.taps else None, argmax=argmax)

    def _plan(self, forwards) -> list[tuple]:
        """One part's package calls: its rows in chunks of at most `max_rows`, each chunk's
        inputs and whether its logits are wanted (a chunk inside a prompt has none: its last
        row stands in, its logits dropped)."""
        want, n = [], 0
        for f in forwards:
            t = f.rows
            want.extend([n + t - 1] if f.last_logits else range(n, n + t))
            n += t
        pos, seq = _places(forwards, [f.cache.length for f in forwards])
        hide = None
        if any(f.tree is not None for f in forwards):
            if not self.hides:
                raise ValueError("this engine's target package runs no draft tree in one forward "
                                 "(built before tree rows): its trees are verified along their paths")
            pos, hide = _tree_places(forwards, pos)
        if all(f.tokens is not None for f in forwards):  # the decode loop's steps: one tensor
            ids = _longs([t for f in forwards for t in f.tokens])
        else:
            ids = forwards[0].ids[0] if len(forwards) == 1 else torch.cat([f.ids[0] for f in forwards])
        return self._calls(ids, pos, seq, want, forwards[0].cache.pool.kv, hide)

    def _calls(self, ids, pos, seq, want, kv, hide: torch.Tensor | None = None) -> list[tuple]:
        """The package calls of one part's rows (inputs ids, pos, seq over its n rows, `want`
        the rows whose logits are wanted, `hide` their hidden drafts where a tree is among them)
        in chunks of at most `max_rows`."""
        calls, step, n = [], self.max_rows, len(ids)
        for c in range(0, n, step):
            mine = [w - c for w in want if c <= w < c + step]
            inputs = [ids[c:c + step], pos[c:c + step], seq[c:c + step], _longs(mine or [min(step, n - c) - 1])]
            if self.hides:
                inputs.append(hide[c:c + step] if hide is not None else self._no_hide[min(step, n - c)])
            calls.append((self.package, bool(mine), (*inputs, *kv)))
        return calls


def _call_all(calls: list[tuple]) -> list:
    """A part's package calls, in order (a prompt's later chunks read what its earlier wrote)."""
    return [package(*inputs) for package, _, inputs in calls]


def _joined_calls(calls: list[tuple], outs: list) -> list[torch.Tensor]:
    """A part's outputs concatenated over its calls (logits of the wanted chunks only)."""
    if len(outs) == 1:
        return outs[0]
    outs = [o if wanted else [o[0][:0], *o[1:]] for (_, wanted, _), o in zip(calls, outs)]
    return [torch.cat([o[j] for o in outs]) for j in range(len(outs[0]))]


class _RowsOutput:
    """A forward's `TargetOutput` as views of its part's outputs, taken when first read (a
    greedy plain step reads only `argmax`): logits [1, n, V], last_hidden [1, t, H], taps
    [1, t, ·] of the forward's taps."""

    __slots__ = ("_face", "_logits", "_hidden", "_taps", "_rows", "_logit_rows", "_which", "argmax")

    def __init__(self, face, logits, hidden, taps, offset, t, lo, n, which, argmax):
        self._face, self._logits, self._hidden, self._taps = face, logits, hidden, taps
        self._rows, self._logit_rows = slice(offset, offset + t), slice(lo, lo + n)
        self._which, self.argmax = which, argmax

    def rows(self, what: str) -> torch.Tensor | None:
        """Its rows of the part's logits, last hidden or (every package tap's) taps."""
        if what == "logits":
            return self._logits[self._logit_rows]
        src = self._hidden if what == "hidden" else self._taps
        return None if src is None else src[self._rows]

    def kept(self, what: str) -> "_RowsOutput":
        """As `TargetOutput.kept`, in place: the output forgets its logits, its argmax and the
        other of hidden and taps, and is held as it is. Its one reader, the decode loop, is done
        with them by then, so a proposer following a plain step of a busy batch makes no object
        and no view."""
        self._logits = self.argmax = None
        if what == "hidden":
            self._taps = None
        else:
            self._hidden = None
        return self

    @property
    def logits(self) -> torch.Tensor:
        return self.rows("logits")[None]

    @property
    def last_hidden(self) -> torch.Tensor:
        return self.rows("hidden")[None]

    @property
    def taps(self) -> torch.Tensor | None:
        return self._face.select_taps(self.rows("taps")[None], self._which) if self._which else None


class BatchedMTP(BatchedFace):
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
        return self.forward_many([HeadForward(self, embeds, hidden, cache, start)])[0]

    def forward_many(self, forwards) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each `HeadForward`'s (logits [1, T, V], h [1, T, H]), in order; each cache's length
        becomes its start + T once every call succeeded."""
        starts = [f.cache.length if f.start is None else f.start for f in forwards]
        results: list = [None] * len(forwards)
        for members in _by_pool(forwards, starts).values():
            mine = [forwards[i] for i in members]
            pos, seq = _places(mine, [starts[i] for i in members])
            # (one chain's link, the common call: its own rows, no copy)
            embeds = mine[0].embeds[0].contiguous() if len(mine) == 1 else torch.cat([f.embeds[0] for f in mine])
            hidden = mine[0].hidden[0].contiguous() if len(mine) == 1 else torch.cat([f.hidden[0] for f in mine])
            kv = mine[0].cache.pool.kv
            if embeds.shape[0] <= self.max_rows:
                logits, hs = self.package(embeds, hidden, pos, seq, *kv)
            else:
                parts = [self.package(embeds[c:c + self.max_rows], hidden[c:c + self.max_rows],
                                      pos[c:c + self.max_rows], seq[c:c + self.max_rows], *kv)
                         for c in range(0, embeds.shape[0], self.max_rows)]
                logits, hs = (torch.cat([p[j] for p in parts]) for j in (0, 1))
            offset = 0
            for i, f in zip(members, mine):
                results[i] = (logits[offset:offset + f.rows][None], hs[offset:offset + f.rows][None])
                offset += f.rows
        for f, start in zip(forwards, starts):
            f.cache.length = start + f.rows
        return results
