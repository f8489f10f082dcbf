"""τ of draft trees against the chain, measured over the target's greedy continuation: what the
decode loop's greedy verify accepts with each policy, without running its verifies (each
policy's drafter is fed the target's taps of what it accepted, as the decode loop feeds it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from metrale.runtime.spec.ddtree import accepted_along, block_tree, chain, marginal_tree
from metrale.runtime.spec.decode import Decoder
from metrale.runtime.spec.sampling import SamplingParams


@dataclass
class Acceptance:
    """One policy's greedy steps: verifies, tokens they emitted, and how many steps accepted
    each number of drafts."""

    steps: int = 0
    emitted: int = 0
    accepted: Counter = field(default_factory=Counter)

    @property
    def tau(self) -> float:
        """Tokens per verify (accepted drafts + 1), to three decimals."""
        return round(self.emitted / self.steps, 3) if self.steps else 0.0


def block_acceptance(engine, drafter: str, prompts: list[list[int]], max_tokens: int,
                     budgets: tuple[int, ...]) -> dict[str, float]:
    """τ (tokens per verify: accepted drafts + 1) of greedy speculative decoding with drafter
    `drafter`'s blocks verified as its chain and as trees of each budget, on `prompts` of plain
    decoding's first `max_tokens` tokens each (`block_steps`). -> {"chain": τ, "tree N": τ}."""
    return {p: a.tau for p, a in block_steps(engine, drafter, prompts, max_tokens, budgets).items()}


def block_steps(engine, drafter: str, prompts: list[list[int]], max_tokens: int,
                budgets: tuple[int, ...], marginal: bool = False) -> dict[str, Acceptance]:
    """Greedy speculative decoding's steps with drafter `drafter`'s blocks verified as its chain
    and as trees of each budget, on `prompts` of plain decoding's first `max_tokens` tokens
    each. Greedy verify of a target whose rows are plain decoding's accepts exactly the drafts
    on the target's greedy continuation, so each policy is run over that continuation: at each
    step the drafter proposes from the context the policy has accepted so far (the target's
    taps at those positions, as the decode loop feeds them), and the step advances by what the
    policy accepts. `marginal`: read DFlash2's blocks as DFlash's, without its candidate
    selector (the chain each slot's argmax, a node's children its position's own distribution),
    to tell what the selector adds from what the block gives. -> {"chain": …, "tree N": …}."""
    target, face = engine.target, engine.drafters[drafter]
    taps = tuple(face.config.target_layer_ids)
    gamma = face.config.block_size
    embed = target.model.embed_tokens
    dtype, device = embed.weight.dtype, embed.weight.device
    policies = ["chain", *(f"tree {b}" for b in budgets)]
    out = {p: Acceptance() for p in policies}
    plain = Decoder(target, frozenset())  # no EOS: every prompt runs its whole budget
    with torch.inference_mode():
        for prompt in prompts:
            ys = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)).token_ids
            ids = torch.tensor([prompt + ys], device=device)
            cache = target.new_cache(1, ids.shape[1] + gamma)
            feats = target(ids, cache, taps=taps).taps  # [1, T, n·H]: every position's taps
            for policy in policies:
                budget = None if policy == "chain" else int(policy.split()[1])
                cache = face.new_cache(1, ids.shape[1] + 2 * gamma, dtype, device)
                fed, i = 0, 0  # positions fed to the drafter; the anchor's index in `ys`
                while i < len(ys) - 1:
                    at = len(prompt) + i  # the anchor's position
                    face.add_context(feats[:, fed:at], cache)
                    fed = at
                    anchor = torch.tensor([ys[i]], device=device)
                    # (a tree's budget: its distributions, whatever the face)
                    proposal = face.propose(anchor, embed, cache, gamma, budget or 0)
                    if marginal and budget is None:
                        tree = chain(ys[i], proposal.logits[0].argmax(-1).tolist())
                    elif marginal:
                        tree = marginal_tree(ys[i], proposal.logits[0], min(budget, len(ys) - 2 - i))
                    elif budget is None:
                        tree = chain(ys[i], proposal.tokens[0].tolist())
                    else:  # the tree the decode loop verifies (`DFlashProposer`), which
                        # holds no more drafts than the tokens left after its root
                        tree = block_tree(face, ys[i], proposal, min(budget, len(ys) - 2 - i))
                    n = accepted_along(tree, ys[i + 1:])
                    a = out[policy]
                    a.steps += 1
                    a.emitted += min(n + 1, len(ys) - 1 - i)
                    a.accepted[n] += 1
                    i += n + 1
    return out
