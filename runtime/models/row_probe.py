"""Does a target's forward give each of its rows the bits of the one-row step at that position?

That is what lets chunkwise verify emit plain greedy decoding's tokens on an eager target
(`LoadedEngine.eager_rows_invariant`), and a busy batch's plain steps keep nothing for a drafter
that catches up later (its rows run again bit for bit). It is a property of the kernels the GEMM
library picks by row count, which moves with the torch build and the CPU's instructions, so it
is measured on the packed model rather than assumed from its dtype.
"""

from __future__ import annotations

import torch

# every verify of a chain up to γ = 16, then the sizes of trees and of catch-up forwards
PROBE_ROWS = (*range(2, 18), 24, 32, 48, 64, 65)
CONTEXT = 11  # positions in the cache before the probed rows


@torch.inference_mode()
def rows_invariant(target, rows: tuple[int, ...] = PROBE_ROWS, seed: int = 0) -> bool:
    """True when, for every count R in `rows`, the R-row forward after a context of CONTEXT
    random tokens equals, in logits and last hidden state bit for bit, the R one-row steps it
    stands for."""
    device = target.model.embed_tokens.weight.device
    most = max(rows)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, CONTEXT + most), generator=gen).to(device)

    def primed():
        cache = target.new_cache(1, CONTEXT + most)
        target(ids[:, :CONTEXT], cache)
        return cache

    steps, ones = primed(), []  # the one-row steps, taken as far as the next count needs
    for r in sorted(rows):  # smallest first: where it fails, it most often fails early
        ones += [target(ids[:, p:p + 1], steps) for p in range(CONTEXT + len(ones), CONTEXT + r)]
        many = target(ids[:, CONTEXT:CONTEXT + r], primed())
        if not (torch.equal(many.logits, torch.cat([o.logits for o in ones[:r]], dim=1))
                and torch.equal(many.last_hidden, torch.cat([o.last_hidden for o in ones[:r]], dim=1))):
            return False
    return True
