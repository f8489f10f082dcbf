"""Does a target's forward give each of its rows the bits of the one-row step at that position?

That is what lets chunkwise verify emit plain greedy decoding's tokens on an eager target
(`LoadedEngine.eager_rows_invariant`), and a busy batch's plain steps keep nothing for a drafter
that catches up later (its rows run again bit for bit). It is a property of the kernels the GEMM
library picks by row count, which moves with the torch build and the CPU's instructions, so
`rows_invariant` measures it on the packed model, at every row count the decode loop runs.
"""

from __future__ import annotations

import copy

import torch

# the largest forward the decode loop runs: a draft tree of 64 nodes and its root
# (`steps.MAX_TREE_NODES`); catch-up forwards take 64 rows, MTP verifies up to 33
PROBE_MOST = 65
CONTEXT = 11  # positions in the cache before the probed rows


def probe_rows(most: int = PROBE_MOST) -> tuple[int, ...]:
    """Every row count of a multi-row forward, up to `most`."""
    return tuple(range(2, most + 1))


@torch.inference_mode()
def rows_invariant(target, rows: tuple[int, ...] | None = None, seed: int = 0) -> bool:
    """True when, for every count R in `rows` (default: `probe_rows()`), the R-row forward after
    a context of CONTEXT random tokens equals the R one-row steps it stands for, bit for bit:
    logits, last hidden state, every layer's tapped hidden state, and the K/V it leaves in the
    cache. Counts are read smallest first and the one-row steps taken only as far as the next
    count needs, so where rows differ the probe stops at the first count that shows it."""
    rows = tuple(sorted(probe_rows() if rows is None else rows))
    device = target.model.embed_tokens.weight.device
    taps = tuple(range(target.config.num_hidden_layers))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, CONTEXT + rows[-1]), generator=gen).to(device)
    primed = target.new_cache(1, CONTEXT + rows[-1])
    target(ids[:, :CONTEXT], primed)
    steps, ones = copy.deepcopy(primed), []
    for r in rows:
        ones += [target(ids[:, p:p + 1], steps, taps=taps) for p in range(CONTEXT + len(ones), CONTEXT + r)]
        cache = copy.deepcopy(primed)
        many = target(ids[:, CONTEXT:CONTEXT + r], cache, taps=taps)
        for field in ("logits", "last_hidden", "taps"):
            if not torch.equal(getattr(many, field), torch.cat([getattr(o, field) for o in ones[:r]], dim=1)):
                return False
        end = CONTEXT + r
        if not (torch.equal(cache.k[..., :end, :], steps.k[..., :end, :])
                and torch.equal(cache.v[..., :end, :], steps.v[..., :end, :])):
            return False
    return True
