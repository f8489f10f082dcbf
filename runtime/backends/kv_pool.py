"""The pooled caches of the `aoti` backend's batched steps (`aoti_batched`): per slot count S one
pool holding, per layer, K [B, nkv, hd, S] (slot-minor, as the steps' attention reads it) and V
[B, S, nkv, hd] for up to B sequences, doubling B when full; a `PooledCache` is one sequence's
place in its pool, given back when the cache is freed. Every layer's keys are one tensor
[L, B, nkv, hd, S] and every layer's values another (the layers' tensors are their views), so a
sequence's positions of all layers move in one copy (`PooledCache.read_prefix`,
`write_prefix`: a prompt's kept K/V, `prefix_cache`)."""

from __future__ import annotations

import weakref

import torch

from metrale.runtime.models.kv_cache import move_path

FIRST_CAPACITY = 4  # sequences a pool holds before it first grows (it doubles when full)


class KVPool:
    """The caches of the sequences of one slot count: per layer K [B, nkv, hd, S] (slot-minor,
    see `step_caches.pooled_attention`) and V [B, S, nkv, hd]."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, dtype, device,
                 capacity: int = FIRST_CAPACITY):
        self.slots = slots
        self._hold(torch.zeros(layers, capacity, kv_heads, head_dim, slots, dtype=dtype, device=device),
                   torch.zeros(layers, capacity, slots, kv_heads, head_dim, dtype=dtype, device=device))
        self.free = list(range(capacity - 1, -1, -1))  # popped from the end: lowest index first

    def _hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys [L, B, nkv, hd, S] and values [L, B, S, nkv, hd]; `kv`: per layer K then V."""
        self.keys, self.values = keys, values
        self.kv = [t for layer in zip(keys, values) for t in layer]

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    @property
    def in_use(self) -> int:
        return self.capacity - len(self.free)

    def acquire(self) -> int:
        if not self.free:
            old = self.capacity
            grown = []
            for t in (self.keys, self.values):
                g = t.new_zeros(t.shape[0], 2 * old, *t.shape[2:])
                g[:, :old].copy_(t)
                grown.append(g)
            self._hold(*grown)
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

    def read_prefix(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Its positions 0..n-1 of every layer: K [L, nkv, hd, n] and V [L, n, nkv, hd] (views)."""
        i = self.index
        return self.pool.keys[:, i, :, :, :n], self.pool.values[:, i, :n]

    def write_prefix(self, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        """Positions 0..n-1 of every layer from K [L, nkv, hd, ≥n] and V [L, ≥n, nkv, hd]; its
        length then n."""
        mine_k, mine_v = self.read_prefix(n)
        mine_k.copy_(keys[..., :n])
        mine_v.copy_(values[:, :n])
        self.length = n

    def keep_path(self, base: int, path: list[int]) -> None:
        """After a draft tree's verify written from slot `base` (node i at slot base+i): the
        accepted path's nodes `path` move to the slots of their positions, base+1.., as a chain
        verify of the path writes them (`kv_cache.KVCache.keep_path`); the length becomes
        base+1+len(path)."""
        i = self.index  # keys [L, nkv, hd, S], values [L, S, nkv, hd]
        move_path([(self.pool.keys[:, i], 3), (self.pool.values[:, i], 1)], base, path)
        self.length = base + 1 + len(path)

    @property
    def device(self) -> torch.device:
        return self.pool.kv[0].device
