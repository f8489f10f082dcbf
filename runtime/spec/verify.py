"""Lossless verification of a draft chain against the target model's rows (the reference).

Terms, for a step that verifies k drafts d_1..d_k:
- row i (0 <= i <= k) of the target's output is its distribution for the token after the
  context plus d_1..d_i; row i−1 judges draft d_i, row k follows the last draft.
- accepted: the drafts kept, always a prefix d_1..d_m (0 <= m <= k).
- recovered token: when draft d_{m+1} is rejected, the token emitted in its place, drawn from
  row m (greedy: the target's argmax there).
- bonus token: when all k drafts are accepted, the token drawn from row k.
Every step therefore emits m + 1 tokens: the accepted drafts and one recovered or bonus token.

Greedy verification keeps the longest prefix where d_i equals the target's argmax of row i−1,
so the output is the target's own greedy output. Sampled verification is the rejection
sampling of Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (ICML 2023) and Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling" (2023), specialised to one-hot drafts: the drafter's distribution q is a
point mass on d, so d is accepted with probability min(1, p(d)/q(d)) = p(d), and on rejection
the recovered token is drawn from normalize(max(p − q, 0)), i.e. p with d's mass removed. Each
emitted token is then distributed exactly as plain sampling from the target would give it.

Invariants: no model code; the target probabilities come from `sampling.probs_from_logits`
so verification and plain decoding share one definition of temperature and top-p.
"""

from __future__ import annotations

import torch

from metrale.runtime.backends import argmax_rows
from metrale.runtime.spec.sampling import sample_from_probs


def _check(draft_tokens: torch.Tensor, target_rows: torch.Tensor) -> int:
    k = draft_tokens.shape[0]
    if draft_tokens.dim() != 1 or target_rows.dim() != 2 or target_rows.shape[0] != k + 1:
        raise ValueError(
            f"expected draft_tokens [k] and target rows [k+1, V]; got "
            f"{tuple(draft_tokens.shape)} and {tuple(target_rows.shape)}"
        )
    return k


def verify_greedy(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """draft_tokens [k] int64, target_logits [k+1, V] -> (accepted m, emitted [m+1] int64).

    emitted = d_1..d_m followed by the target's argmax of row m (recovered or bonus token).
    """
    _check(draft_tokens, target_logits)
    target_ids = argmax_rows(target_logits)  # the target's greedy token per row
    accepted = accepted_prefix(draft_tokens.tolist(), target_ids)
    emitted = torch.tensor(target_ids[: accepted + 1], device=target_logits.device)  # [m+1]
    return accepted, emitted


def accepted_prefix(drafts: list[int], target_ids: list[int]) -> int:
    """How many leading drafts equal the target's greedy tokens (row i's argmax judges draft
    i+1), never past the last row given: with exact verify's early stop, fewer than k+1 rows
    end at the row that rejected."""
    m, limit = 0, min(len(drafts), len(target_ids) - 1)
    while m < limit and drafts[m] == target_ids[m]:
        m += 1
    return m


def verify_sampling(
    draft_tokens: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, torch.Tensor]:
    """draft_tokens [k] int64, target_probs [k+1, V] float -> (accepted m, emitted [m+1] int64).

    Draft d_i is accepted with probability p_{i−1}(d_i) (u ~ U[0,1), accept when u < p). The
    first rejection draws the recovered token from row i−1 with d_i zeroed and renormalized;
    if every draft is accepted the bonus token is drawn from row k.
    """
    k = _check(draft_tokens, target_probs)
    if k == 0:  # a plain step: no draft to judge, its one token drawn from row 0
        return 0, sample_from_probs(target_probs[0], generator).reshape(1)
    device = target_probs.device
    drafts = draft_tokens.to(device)
    # One uniform per draft, drawn up front so the random stream does not depend on where the
    # chain is rejected.
    u = torch.rand(k, generator=generator, device=device, dtype=torch.float64)  # [k]
    p_draft = target_probs[torch.arange(k, device=device), drafts].double()  # [k]
    # A draft holding all of its row's mass is accepted outright: a float32 row can carry
    # p(d) = 0.99999994 with nothing left for a recovered token to be drawn from.
    sole = (target_probs[:k] > 0).sum(dim=-1) == (p_draft > 0).long()  # [k] bool
    accepted_mask = ((u < p_draft) | (sole & (p_draft > 0))).long()  # [k]
    accepted = int(accepted_mask.cumprod(dim=0).sum()) if k else 0
    row = target_probs[accepted].float()  # [V]
    if accepted < k:
        residual = row.clone()
        residual[drafts[accepted]] = 0.0  # max(p − q, 0) with q one-hot on the rejected draft
        assert float(residual.sum()) > 0.0  # a sole-mass draft is never rejected (above)
        last = sample_from_probs(residual / residual.sum(), generator)  # recovered token
    else:
        last = sample_from_probs(row, generator)  # bonus token
    emitted = torch.cat([drafts[:accepted], last.reshape(1)])  # [m+1]
    return accepted, emitted


def verify_sampling_on_device(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                              generator: torch.Generator | None = None,
                              counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_sampling` in fixed shapes with nothing read by the host (what a captured
    iteration runs): draft_tokens [k] int64, target_probs [k+1, V] float -> (accepted m, a 0-dim
    int64 tensor; tokens [k+1] int64 whose first m+1 are the emitted ones). `counted` (0-dim)
    caps the drafts judged (a draft stop): when all of those are accepted the bonus token is
    drawn from the row after them. The same draws in the same order as `verify_sampling`."""
    _check(draft_tokens, target_probs)
    m, ids = verify_sampling_lanes(draft_tokens[None], target_probs[None], generator,
                                   None if counted is None else counted.view(1))
    return m[0], ids[0]


def verify_sampling_lanes(draft_tokens: torch.Tensor, target_probs: torch.Tensor,
                          generator: torch.Generator | None = None,
                          counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_sampling_on_device` for B sequences at once: draft_tokens [B, k], target_probs
    [B, k+1, V], counted [B] -> (accepted [B], tokens [B, k+1]); each sequence's uniforms drawn
    in its order (one sequence: exactly `verify_sampling`'s draws)."""
    b, k = draft_tokens.shape
    device = target_probs.device
    u = torch.rand(b, k, generator=generator, device=device, dtype=torch.float64)  # [B, k]
    p_draft = target_probs[:, :k].gather(2, draft_tokens[..., None])[..., 0].double()  # [B, k]
    sole = (target_probs[:, :k] > 0).sum(dim=-1) == (p_draft > 0).long()  # [B, k] bool
    accepted = ((u < p_draft) | (sole & (p_draft > 0))).long().cumprod(dim=1).sum(dim=1)  # [B]
    limit = torch.full((b,), k, dtype=torch.long, device=device)
    if counted is not None:
        limit = torch.minimum(limit, counted)
    m = torch.minimum(accepted, limit)  # [B]
    # every row's residual (its draft's mass removed, renormalized), and row k whole
    residual = target_probs[:, :k].float().scatter(2, draft_tokens[..., None], 0.0)  # [B, k, V]
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    rows = torch.cat([residual, target_probs[:, k:].float()], dim=1)  # [B, k+1, V]
    pick = m[:, None, None].expand(b, 1, rows.shape[-1])
    row = torch.where((m < limit)[:, None], rows.gather(1, pick)[:, 0],
                      target_probs.float().gather(1, pick)[:, 0])  # [B, V]
    last = sample_from_probs(row, generator)  # [B]: each sequence's recovered or bonus token
    return m, torch.cat([draft_tokens, last[:, None]], dim=1).scatter(1, m[:, None], last[:, None])
