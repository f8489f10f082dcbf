"""The decode loop's KV cache: preallocated keys and values for a stack of attention layers.

(The caches that compiled and exported steps own are `step_caches`'.)
"""

from __future__ import annotations

import torch


def causal_mask(t: int, start: int, device: torch.device) -> torch.Tensor:
    """[T, start+T] bool: query i (absolute position start+i) sees keys 0..start+i."""
    rows = torch.arange(t, device=device)[:, None] + start
    cols = torch.arange(start + t, device=device)[None, :]
    return cols <= rows


def move_path(tensors: list[tuple[torch.Tensor, int]], base: int, path: list[int]) -> None:
    """A cache's `keep_path` over its tensors (each with its slot dimension): the slots of a
    draft tree's accepted nodes, base + path[i], copied to base + 1 + i (nothing moves where the
    path is the tree's first nodes)."""
    n = len(path)
    if path == list(range(1, n + 1)):
        return
    for t, dim in tensors:
        src = torch.tensor([base + j for j in path], device=t.device)
        t.narrow(dim, base + 1, n).copy_(t.index_select(dim, src))


class KVCache:
    """Preallocated keys/values for a stack of attention layers, one sequence length for the batch.

    k, v: [L, B, nkv, S_max, hd]. `length` is how many positions hold valid entries; rolling back
    a rejected draft is `length = n` (stale entries past it are overwritten before being read).
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [B, nkv, T, hd] at positions start.. and return all keys/values so far."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {end} requested")
        keys, values = self.k[layer], self.v[layer]
        keys.narrow(2, start, end - start).copy_(k)
        values.narrow(2, start, end - start).copy_(v)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def keep_path(self, base: int, path: list[int]) -> None:
        """After a draft tree's verify written from slot `base` (node i at slot base+i): the
        accepted path's nodes `path` move to the slots of their positions, base+1.., as a
        chain verify of the path would have written them; the length becomes base+1+len(path)."""
        move_path([(self.k, 3), (self.v, 3)], base, path)  # [L, B, nkv, S, hd]
        self.length = base + 1 + len(path)

    def mask(self, t: int, start: int, device) -> torch.Tensor | None:
        """The attention mask of T new rows at positions start.. over `write`'s keys (None: one
        row sees every key)."""
        return causal_mask(t, start, device) if t > 1 or start == 0 else None
