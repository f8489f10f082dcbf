"""The pooled caches of the `aoti` backend's batched steps (`aoti_batched`): per slot count S one
pool holding, per layer, K [B, nkv, hd, S] (slot-minor, as the steps' attention reads it) and V
[B, S, nkv, hd] for up to B sequences, doubling B when full; a `PooledCache` is one sequence's
place in its pool, given back when the cache is freed."""

from __future__ import annotations

import weakref

import torch

FIRST_CAPACITY = 4  # sequences a pool holds before it first grows (it doubles when full)


class KVPool:
    """The caches of the sequences of one slot count: per layer K [B, nkv, hd, S] (slot-minor,
    see `step_caches.pooled_attention`) and V [B, S, nkv, hd]."""

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

    def prefix(self, n: int) -> list[torch.Tensor]:
        """Per layer its K [nkv, hd, n] and V [n, nkv, hd] of positions 0..n-1 (views)."""
        return [t[self.index][..., :n] if j % 2 == 0 else t[self.index][:n]
                for j, t in enumerate(self.pool.kv)]

    @property
    def device(self) -> torch.device:
        return self.pool.kv[0].device
