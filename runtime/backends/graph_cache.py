"""The tensorrt backend's KV caches: per component, buffers in the profile's sizes, grown on demand.

A cache (`EngineCache`) is one sequence's K/V for one component, `k`/`v` [L, 1, nkv, S, hd] torch
CUDA tensors the engine reads whole as `past_key`/`past_value` (positions at or after `length`
are masked). S takes the sizes a component's `CacheSizes` offers — the engine profile's opt past
(the shape TensorRT tuned for) and its max — so short requests attend over opt slots, not max.
A cache starts in the smallest size; `reserve(end)` moves it to the smallest size holding `end`
positions (its valid positions copied) before a call would write past it, and refuses past the
largest.

Buffers come from one pool per size (`SlotPool`) and return to it when their cache is collected
or moves up, so consecutive requests reuse buffers, and the CUDA graphs captured on them (graph
keys name a buffer by `slot_id`, unique across a component's sizes); two caches alive at once
never share one.

`position_limit` is the target's usable context: its own limit, capped by every component's
largest past less the rows one speculative step may write past the decode budget.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from metrale.runtime.models.kv_cache import KVCache


# Rows one speculative step may write past the decode budget: every component's cache keeps this
# headroom past the usable context (`position_limit`).
STEP_HEADROOM = 17


def position_limit(max_positions: int, pasts: list[int]) -> int:
    """The target's usable context: its own limit, capped by the smallest max past of every
    component's profile less `STEP_HEADROOM` (at least 1)."""
    return max(1, min([max_positions] + [p - STEP_HEADROOM for p in pasts]))


class EngineCache:
    """One sequence's K/V for one component: `k`, `v` [L, 1, nkv, S, hd] on the GPU; `length`
    valid positions; `pending` (drafters) context features [1, C, n·Ht] not yet in `k`/`v`."""

    def __init__(self, slot: dict, sizes: "CacheSizes | None" = None):
        self.k, self.v, self.slot_id = slot["k"], slot["v"], slot["id"]
        self.length = 0
        self.pending: torch.Tensor | None = None
        self._sizes = sizes
        self._slot = slot
        self._finalizer = None

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def reserve(self, end: int) -> None:
        """Make room for positions < `end`: move to a larger buffer of the component's sizes
        (the valid positions copied) when this one is too small."""
        if end <= self.max_len:
            return
        if self._sizes is None:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} requested")
        self._sizes.grow(self, end)

    def write_new(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new k/v [L, 1, nkv, T, hd] at positions start.."""
        end = start + k.shape[3]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} requested")
        self.k[:, :, :, start:end] = k
        self.v[:, :, :, start:end] = v

    keep_path = KVCache.keep_path  # the eager cache's: the same k/v layout [L, B, nkv, S, hd]


class SlotPool:
    """Preallocated K/V buffers of one shape; a buffer returns when its cache is collected."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 ids=None):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.free: list[dict] = []
        self.count = 0
        self._ids = ids if ids is not None else itertools.count()

    def take(self) -> dict:
        if self.free:
            return self.free.pop()
        self.count += 1
        # zeros, not empty: masked slots are still multiplied by a zero weight, and an
        # uninitialized NaN there would survive it
        return {"id": next(self._ids), "pool": self,
                "k": torch.zeros(self.shape, dtype=self.dtype, device=self.device),
                "v": torch.zeros(self.shape, dtype=self.dtype, device=self.device)}

    def give(self, slot: dict) -> None:
        self.free.append(slot)

    def cache(self, sizes: "CacheSizes | None" = None) -> EngineCache:
        slot = self.take()
        cache = EngineCache(slot, sizes)
        cache._finalizer = weakref.finalize(cache, self.give, slot)
        return cache


class CacheSizes:
    """A component's cache buffers in the sizes of `past_sizes` (ascending), one pool each,
    slot ids unique across them. A cache starts in the smallest size and grows on demand."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, past_sizes: list[int],
                 dtype: torch.dtype, device: torch.device):
        ids = itertools.count()
        self.pools = [SlotPool((layers, 1, kv_heads, s, head_dim), dtype, device, ids)
                      for s in sorted(set(past_sizes))]

    def cache(self) -> EngineCache:
        return self.pools[0].cache(self)

    def grow(self, cache: EngineCache, end: int) -> None:
        pool = next((p for p in self.pools if p.shape[3] >= end), None)
        if pool is None:
            raise ValueError(f"KV cache holds at most {self.pools[-1].shape[3]} positions (the "
                             f"engine profile's largest past); {end} requested")
        old, slot = cache._slot, pool.take()
        n = cache.length
        slot["k"][:, :, :, :n] = cache.k[:, :, :, :n]
        slot["v"][:, :, :, :n] = cache.v[:, :, :, :n]
        if cache._finalizer is not None:
            cache._finalizer.detach()
        old["pool"].give(old)
        cache.k, cache.v, cache.slot_id, cache._slot = slot["k"], slot["v"], slot["id"], slot
        cache._finalizer = weakref.finalize(cache, pool.give, slot)
