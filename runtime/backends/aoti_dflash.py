"""The `aoti` backend's batched DFlash/DFlash2 face: the blocks of many sequences' proposes in
one package call per pool, each sequence's drafter cache a place in a pool (`kv_pool`), as the
target's and the MTP head's batched faces (`aoti_batched`)."""

from __future__ import annotations

import torch

from metrale.runtime.artifact.entries import CpuPackage, CpuPackages
from metrale.runtime.backends.aoti import CompiledDFlash, Package, slots_for
from metrale.runtime.backends.aoti_batched import _by_pool, _longs
from metrale.runtime.backends.kv_pool import KVPool, PooledCache
from metrale.runtime.errors import EngineDirError
from metrale.runtime.steps import BatchedFace, DraftForward


class BatchedDFlash(CompiledDFlash, BatchedFace):
    """The DFlash/DFlash2 drafter's face over its batched package: `new_cache`, `add_context`
    and `propose` as `aoti.CompiledDFlash`'s, plus `forward_many`, the blocks of many
    sequences' `backends.DraftForward`s in one package call per pool. Context added with
    `add_context` waits in the cache's `pending` rows and enters the cache with the next
    propose, through the package: a call feeds up to its package's `fed_rows`, its sequences'
    together, each sequence at least `feed` (a prompt's rows at its first propose are one
    call's); a longer backlog's older rows are fed first by the eager drafter's context
    projection, as `CompiledDFlash` does (every backlog past `feed`, on a package that does not
    record `fed_rows`). A DFlash2 drafter's call where a sequence builds a draft tree runs its
    tree's package (`tree_package`), the same propose with its selector's tables besides."""

    @classmethod
    def from_packages(cls, drafter, loaded: list[tuple[CpuPackage, Package]], cpu: CpuPackages, where: str):
        if not loaded[0][0].batched:  # an engine built before batching: one sequence per call
            return CompiledDFlash.from_packages(drafter, loaded, cpu, where)
        chains = [e for e in loaded if not e[0].selector_tables]
        trees = [e for e in loaded if e[0].selector_tables]
        if len(chains) != 1 or len(trees) > 1:
            raise EngineDirError(f"{where}: a drafter's CPU packages are one propose and at most one "
                                 f"tree's propose with selector tables; the manifest lists "
                                 f"{len(chains)} and {len(trees)}")
        if trees and drafter.config.version != 2:
            raise EngineDirError(f"{where}: selector tables from a DFlash drafter of version "
                                 f"{drafter.config.version}, which has no candidate selector")
        shape = lambda e: (e.block, e.feed, e.fed_rows, e.distributions, e.batched)  # noqa: E731
        if trees and shape(trees[0][0]) != shape(chains[0][0]):
            raise EngineDirError(f"{where}: the tree's propose package ({trees[0][0].file}) was built "
                                 f"for other blocks or feeds than the propose ({chains[0][0].file})")
        face = super().from_packages(drafter, chains, cpu, where)  # its block and feed checked
        # whether its package gives the blocks' logits and hidden states too, what a draft tree
        # reads (the serve refuses trees where it does not: `LoadedEngine.block_distributions`)
        face.distributions = chains[0][0].distributions
        face.tree_package = trees[0][1] if trees else None
        fed_rows = chains[0][0].fed_rows or face.feed
        if fed_rows < face.feed:
            raise EngineDirError(f"{where}: the CPU package feeds {fed_rows} context rows a call, "
                                 f"fewer than its {face.feed} a sequence")
        face.fed_rows = fed_rows
        return face

    def __init__(self, drafter, package: Package, feed: int, max_slots: int):
        super().__init__(drafter, package, feed, max_slots)
        self.pools: dict[int, KVPool] = {}
        self.fed_rows = feed  # the most context rows one call feeds (`from_packages` reads it)
        # the same propose that also gives DFlash2's selector tables, which a call runs where one
        # of its forwards builds a tree (`from_packages`; None: the tree's children are scored on
        # the host, `spec.ddtree.SelectorChildren`)
        self.tree_package: Package | None = None

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

    def propose(self, anchor: torch.Tensor, embed, cache: PooledCache, gamma: int, tree_nodes: int = 0):
        """anchor [1] -> a `dflash.Proposal` of γ−1 drafts (the pending context fed first)."""
        return self.forward_many([DraftForward(self, anchor, embed, cache, gamma, tree_nodes)])[0]

    def _backlog(self, f, most: int) -> tuple[torch.Tensor, int]:
        """A forward's pending rows [1, n, ·] (none: [1, 0, ·]), the older ones past the last
        `most` written now by the eager projection (on a retry, written again, or by the
        package: a cache's length and pending rows move only once a call succeeded) -> (the
        rows the package feeds, how many were fed eagerly)."""
        c = self.config
        rows = f.cache.pending[0] if len(f.cache.pending) == 1 else (
            torch.cat(f.cache.pending, dim=1) if f.cache.pending else
            torch.zeros(1, 0, c.num_context_features * c.target_hidden_size, dtype=f.cache.pool.kv[0].dtype))
        older = max(0, rows.shape[1] - most)
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

        if not self.distributions and any(f.distributions for f in forwards):
            nodes = max(f.tree_nodes for f in forwards)
            raise ValueError(f"a draft tree of {nodes} nodes needs the blocks' distributions, which "
                             f"this drafter's {self.without_distributions}")
        for f in forwards:
            if not 1 < f.gamma <= self.block:
                raise ValueError(f"γ = {f.gamma}: the drafter's CPU package proposes blocks of 2..{self.block}")
        # every backlog whole where they fit in fed_rows together, else an equal share of it
        # (at least `feed` a sequence)
        waiting = sum(p.shape[1] for f in forwards for p in f.cache.pending)
        most = waiting if waiting <= self.fed_rows else max(self.feed, self.fed_rows // len(forwards))
        fed = [self._backlog(f, most) for f in forwards]
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
            tables = self.tree_package is not None and any(forwards[i].distributions for i in members)
            package = self.tree_package if tables else self.package
            outs = package(torch.cat(feats), _longs(pos), _longs(seq), block,
                           _longs([forwards[i].cache.index for i in members]),
                           _longs(anchor_pos), _longs([forwards[i].gamma for i in members]),
                           *forwards[members[0]].cache.pool.kv)
            drafts = outs[0]
            for q, i in enumerate(members):
                n = forwards[i].gamma - 1
                if self.distributions:  # the package gives them, a tree or not (a grammar redrafts within them)
                    results[i] = Proposal(tokens=drafts[q, :n][None], logits=outs[1][q:q + 1, :n],
                                          hidden=outs[2][q:q + 1, :n],
                                          tables=tuple(t[q:q + 1, :n] for t in outs[3:7])
                                          if tables and forwards[i].distributions else None)
                else:
                    results[i] = Proposal(tokens=drafts[q, :n][None], logits=None)
        for f, (rows, older) in zip(forwards, fed):
            f.cache.pending = []
            f.cache.length += older + rows.shape[0]
        return results
