"""Prefix caching for the batched target (`aoti_batched.BatchedTarget`): prompts' K/V and rows kept
for the next prompt that starts the same way.

A prompt's forward (`backends.Forward` with `last_logits`, at position 0) looks up the longest
prefix it shares with a kept prompt, in whole blocks of `BLOCK` tokens: those positions' K/V are
copied into the new sequence's cache and only the rest of its rows run; a prompt seen whole gets
its kept last-row logits and runs nothing. What the decode loop receives is what the full prefill
gives, bit for bit: a row's bits depend on its token, its position and its sequence's cache only
(the batched step's contract, checked by the build, chunked prefills included), and the kept
K/V, last hidden states and taps are those rows' own. So the MTP head and the drafters are fed
from the prompt's rows as before, and every answer stays the one computed from scratch.

Kept prompts are evicted least recently used first once their positions exceed `capacity`
tokens. Lookups walk a chain of block hashes (`_chain`), so finding a prefix costs one pass over
the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16  # positions reused in whole blocks of this many tokens


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    k: torch.Tensor  # every layer's K [L, nkv, hd, n]
    v: torch.Tensor  # and V [L, n, nkv, hd]
    last_hidden: torch.Tensor  # [n, H]
    taps: torch.Tensor | None  # [n, n_taps·H]: every tap the package computes
    logits: torch.Tensor  # [1, V], the last row's
    argmax: list[int]
    keys: list[int] = field(default_factory=list)  # its blocks' chain hashes (`_chain`)


@dataclass
class Hit:
    """What a lookup found: `entry`'s first `reused` positions."""

    entry: _Entry
    reused: int

    @property
    def whole(self) -> bool:
        return self.reused == len(self.entry.tokens)


def _chain(tokens: tuple[int, ...]) -> list[int]:
    """One hash per whole block of `tokens`, each covering every block before it."""
    out, h = [], 0
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        h = hash((h, tokens[end - BLOCK:end]))
        out.append(h)
    return out


class PrefixCache:
    """Prompts kept for reuse, up to `capacity` positions in all (see the module docstring).
    Counters: `queried` and `reused` prompt positions, as vLLM's prefix-cache queries and hits."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"prefix cache capacity {capacity}: it must hold at least one token")
        self.capacity = capacity
        self.entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.by_block: dict[int, _Entry] = {}
        self.tokens = 0
        self.queried = self.reused = 0

    def lookup(self, tokens: tuple[int, ...]) -> Hit | None:
        """The kept prompt sharing the longest prefix with `tokens`: all of them when the same
        prompt was kept, else whole blocks, at most len(tokens) − 1 positions (its last row
        must run for its logits)."""
        self.queried += len(tokens)
        entry = self.entries.get(tokens)
        if entry is not None:
            self.entries.move_to_end(tokens)
            self.reused += len(tokens)
            return Hit(entry, len(tokens))
        found, reused = None, 0
        for i, key in enumerate(_chain(tokens[:len(tokens) - 1])):
            deeper = self.by_block.get(key)
            if deeper is None:
                break
            found, reused = deeper, (i + 1) * BLOCK
        while found is not None and found.tokens[:reused] != tokens[:reused]:  # a hash collision
            reused -= BLOCK
            found = self.by_block.get(_chain(tokens[:reused])[-1]) if reused else None
        if found is None:
            return None
        self.entries.move_to_end(found.tokens)
        self.reused += reused
        return Hit(found, reused)

    def keep(self, tokens: tuple[int, ...], k, v, last_hidden, taps, logits, argmax) -> None:
        """Keep a prompt's rows: every layer's K `k` [L, nkv, hd, n] and V `v` [L, n, nkv, hd],
        its rows' outputs (copied: the caller's tensors are the live cache's views)."""
        n = len(tokens)
        if tokens in self.entries or n > self.capacity:
            return
        entry = _Entry(tokens, k.clone(), v.clone(), last_hidden.clone(),
                       None if taps is None else taps.clone(), logits.clone(), list(argmax))
        entry.keys = _chain(tokens)
        for key in entry.keys:  # the latest prompt through a block answers for it
            self.by_block[key] = entry
        self.entries[tokens] = entry
        self.tokens += n
        while self.tokens > self.capacity:
            self._evict(next(iter(self.entries.values())))

    def _evict(self, entry: _Entry) -> None:
        del self.entries[entry.tokens]
        self.tokens -= len(entry.tokens)
        for key in entry.keys:  # a block another kept prompt answers for stays
            if self.by_block.get(key) is entry:
                del self.by_block[key]
