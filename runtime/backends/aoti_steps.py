"""Static-shape steps: what `metrale build` compiles into AOTInductor packages for CPUs, and what
the CUDA-graph backend captures.

Each step runs the runtime's own loaded model (`qwen3`, `mtp`, `dflash`: the forward the torch
backend runs) over a cache the caller owns (`models.step_caches`): the step's inputs say where
every row goes, the cache writes the rows' K/V in place and attends over all of its S slots
with a mask, as reductions over one row's data. S is the packages' one dynamic dimension besides
the row counts: a request's cache is sized to its length once, and every step of the request
runs over that S. Traced, the models take their captured forms (`layers.tracing`): textbook norms
and rotary embeddings (cos and sin gathered from a table, `rotary.rope_at`), and each MoE row
gathering its top-k experts' weights (NVFP4 experts are dequantized into constants first,
`MoE.dequantize_experts`).

On x86 every projection whose outputs are whole panels of 16 is metrale's kernel
(`cpu_build.uses_linear_kernel`); the target's others are GEMMs (`linear="gemm"`: inductor's CPU
micro-GEMM templates, fast, and row-invariant where the build's check finds them so) or
reductions over the input features (`linear="rowwise"`, `step_caches.linears`: row-invariant by
construction, slower); the build compiles "gemm" and falls back to "rowwise" when a multi-row
package's rows differ from one-row steps.
Drafter packages only move drafts, never emitted tokens: their projections are that kernel, or
where it does not build the GEMM library's.

Target (`TargetStep`, one sequence): `ids` [1, T] int64, `pos` [1] int64 (position of ids[0, 0]),
then K and V [S, nkv, hd] of every layer (and optionally `hide` [T]: a draft tree's rows, as
`BatchedTreeTargetStep`'s) -> logits [1, T, V], last_hidden [1, T, H] (pre final
norm), taps [1, T, n·H] (transformers' hidden_states[l+1] for each tap id l, as `qwen3` defines
them). `BatchedTargetStep`, `BatchedMTPStep` and `BatchedDFlashStep` run the rows of many
sequences, each over its own cache in a pool (see their docstrings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.runtime.models.layers import MLP, Attention, MoE, float_weight
from metrale.runtime.models.rotary import rope_table
from metrale.runtime.models.step_caches import LINEARS, PooledKV, SlotKV, hidden_count, linears

__all__ = ["LINEARS", "TargetStep", "BatchedTargetStep", "BatchedTreeTargetStep", "BatchedMTPStep",
           "BatchedDFlashStep"]


def _prepare(model: nn.Module, decoder, positions: int | None) -> None:
    """Make `model`'s weights what a compiled step folds in as constants, in place: the rotary
    table of `decoder`'s attention for `positions` (default: its context and a margin,
    `rotary.rope_at`); every stored
    (quantized) linear becomes a plain one of its dequantized weight, so `pack` fuses the
    attention's and the MLP's projections into one GEMM each, as it does for float weights (the
    eager modules multiply by the same dequantized weight, `qlinear._StoredLinear.pack`); every
    MoE's experts are stacked, NVFP4 ones dequantized (`MoE.dequantize_experts`)."""
    param = next(p for p in model.parameters() if p.is_floating_point())
    dtype = param.dtype  # the activations'
    rope_table(decoder.head_dim, decoder.rope_theta, dtype, param.device,
               positions or decoder.max_position_embeddings + 64)
    stored = [(name, mod) for name, mod in model.named_modules() if hasattr(mod, "dense_weight")]  # qlinear's
    for name, mod in stored:
        plain = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
        plain.weight = nn.Parameter(float_weight(mod).detach().to(dtype), requires_grad=False)
        if mod.bias is not None:
            plain.bias = nn.Parameter(mod.bias.detach().to(dtype), requires_grad=False)
        model.set_submodule(name, plain)
    experts = {id(m) for moe in model.modules() if isinstance(moe, MoE) for m in moe.experts.modules()}
    for mod in model.modules():
        if isinstance(mod, MoE):
            if mod.experts_gate_up is None and mod.nvfp4_stacked is None:
                mod.pack()
            mod.dequantize_experts()
        elif isinstance(mod, (Attention, MLP)) and stored and id(mod) not in experts:
            mod.pack()


class TargetStep(nn.Module):
    """The target's step over one sequence's cache (see the module docstring)."""

    def __init__(self, model, taps: tuple[int, ...] = (), linear: str = "gemm", positions: int | None = None):
        super().__init__()
        linears(linear)  # refuses an unknown kind here, not at the first call
        self.model, self.taps, self.linear = model, tuple(taps), linear
        self.decoder = model.config  # its attention's sizes (what the build's kernels check)
        _prepare(model, model.config, positions)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, *kv: torch.Tensor, hide: torch.Tensor | None = None):
        slots = pos + torch.arange(ids.shape[1], device=ids.device)  # [T]
        if hide is None:
            return self._run(ids, SlotKV(kv, slots))
        # a draft tree's rows (`BatchedTreeTargetStep`'s `hide`): each sits its hidden count
        # before its slot
        return self._run(ids, SlotKV(kv, slots - hidden_count(hide), slots, hide))

    def _run(self, ids, cache, logit_rows=None):
        with linears(self.linear):
            out = self.model(ids, cache, taps=self.taps, logit_rows=logit_rows)
        return (out.logits, out.last_hidden) + ((out.taps,) if self.taps else ())


class BatchedTargetStep(TargetStep):
    """The target's step over the rows of many sequences at once (`aoti_batched`): `ids`,
    `pos`, `seq` [N] int64 (each row's token, position and sequence, a sequence's rows in
    position order), `want` [M] int64 (the rows whose logits are needed: a prompt needs its
    last row's only), then K and V of every layer as pools, K [B, nkv, hd, S] and V
    [B, S, nkv, hd] (sequence b's cache is [b]) -> logits [M, V], last_hidden [N, H], taps
    [N, n·H]. A row reads its own sequence's slots only, so its bits depend on its sequence,
    never on the batch.

    `cache` is the cache its rows attend through: `PooledKV` (the above), or `LaneKV` for a
    whole-iteration graph's lanes (`spec.iteration`): R rows of each of the pools' B sequences,
    V [B, nkv, S, hd], a row's bits depending on B, R and S too."""

    attention_kernel = False  # attend through metrale's CPU kernel (set by the build, `PooledKV`)

    def __init__(self, model, taps: tuple[int, ...] = (), linear: str = "gemm", positions: int | None = None,
                 cache=PooledKV):
        super().__init__(model, taps, linear, positions)
        self.cache = cache

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, want: torch.Tensor,
                *kv: torch.Tensor):
        return tuple(o[0] for o in self._run(ids[None], self.cache(kv, seq, pos, kernel=self.attention_kernel), want))

    def forward_tree(self, ids: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, want: torch.Tensor,
                     slots: torch.Tensor, hidden: torch.Tensor, *kv: torch.Tensor):
        """`forward` over `LaneKV` for draft trees' rows (`spec.tree_iteration`): row t sits at
        position pos[t], is written at slot slots[t] and sees what `hidden` [B, 1, R, S] leaves
        it."""
        cache = self.cache(kv, seq, pos, slots=slots, hidden=hidden)
        return tuple(o[0] for o in self._run(ids[None], cache, want))


class BatchedTreeTargetStep(BatchedTargetStep):
    """`BatchedTargetStep` whose inputs carry `hide` [N] int64 after `want`: row t hides the
    slots its set bits name (bit d: slot s_t − 1 − d, `plugins.cpu_attention`), is written at slot
    s_t = pos[t] + its hidden count and sees its sequence's slots up to s_t but those. A draft
    tree's node i (`spec.ddtree.Tree.hidden_bits`) so sits at its position, base + its depth, in
    slot base + i, and sees the slots before the root's first draft and its own ancestors; every
    other row hides nothing and is `BatchedTargetStep`'s."""

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, want: torch.Tensor,
                hide: torch.Tensor, *kv: torch.Tensor):
        cache = PooledKV(kv, seq, pos, kernel=self.attention_kernel, hide=hide)
        return tuple(o[0] for o in self._run(ids[None], cache, want))


class BatchedMTPStep(nn.Module):
    """The MTP head's entries for the rows of many sequences at once (`aoti_batched`): `embeds`,
    `hidden` [N, H], `pos`, `seq` [N] int64 (each row's position and sequence, a sequence's rows
    in position order), then the head's K pool [B, nkv, hd, S] and V pool [B, S, nkv, hd] ->
    logits [N, V], h [N, H] (`mtp.MTPHead.forward`). A row reads its own sequence's slots only.
    `cache` as `BatchedTargetStep`'s."""

    attention_kernel = False  # as BatchedTargetStep's

    def __init__(self, head, positions: int | None = None, cache=PooledKV):
        super().__init__()
        self.head, self.decoder, self.cache = head, head.config.decoder, cache
        _prepare(head, self.decoder, positions)

    def forward(self, embeds, hidden, pos, seq, k_pool, v_pool):
        logits, h = self.head(embeds[None], hidden[None], self.cache((k_pool, v_pool), seq, pos,
                                                                    kernel=self.attention_kernel))
        return logits[0], h[0]


class BatchedDFlashStep(nn.Module):
    """Feed context and propose one block for many sequences at once (`aoti_batched`), each over
    its own cache in a pool: `feats` [NF, n·Ht] (every sequence's newly kept rows' taps, in
    sequence order), `feed_pos`, `feed_seq` [NF] (their positions and sequences), `block`
    [Q, Γ] (each proposing sequence's anchor then masks), `block_seq`, `anchor_pos`, `gamma` [Q],
    then each layer's K pool [B, nkv, hd, S] and V pool [B, S, nkv, hd] -> drafts [Q, Γ−1].

    The drafter's own `add_context` writes the fed rows' K/V at their slots; its block forward
    (`_blocks`) then writes the block's K/V at the slots from its anchor on (masked for every
    later row of the sequence and overwritten by its next feed and block), each block row seeing
    its sequence's slots before the anchor and the block's first `gamma` slots; `drafts` picks
    the tokens (DFlash2's convs run the dynamic conv op, which the build compiles as its math).
    With `distributions` it also gives the draft slots' logits [Q, Γ−1, V] and final hidden
    states [Q, Γ−1, H]: what a draft tree is built from (`spec.ddtree.block_tree`); with
    `tables` too (DFlash2), each slot's top K candidates' logits and ids [Q, Γ−1, K] and its
    candidate selector's tables given each parent, log-probabilities and ids [Q, Γ−1, K, K]
    (`dflash.CandidateSelector.tables`), so a tree's children need no work on the host; with
    `picks` off, the distributions alone, no drafts picked (a tree iteration's: it builds its
    tree from them). `cache` as `BatchedTargetStep`'s (with `LaneKV`, every sequence proposes:
    Q = B, NF = B·Γ)."""

    attention_kernel = False  # as BatchedTargetStep's

    def __init__(self, drafter, embed: nn.Embedding, feed_rows: int, positions: int | None = None,
                 distributions: bool = False, cache=PooledKV, tables: bool = False, picks: bool = True):
        super().__init__()
        if tables and not (distributions and drafter.config.version == 2):
            raise ValueError("selector tables are a DFlash2 drafter's, beside its distributions")
        if not (picks or distributions) or (tables and not picks):
            raise ValueError("a step without picks gives the distributions alone")
        self.drafter, self.embed, self.feed_rows, self.cache = drafter, embed, feed_rows, cache
        self.distributions, self.tables, self.picks = distributions, tables, picks
        self.decoder = drafter.config.decoder
        _prepare(drafter, self.decoder, positions)

    def forward(self, feats, feed_pos, feed_seq, block, block_seq, anchor_pos, gamma, *kv):
        d = self.drafter
        q_n, g = block.shape
        d.add_context(feats[None], self.cache(kv, feed_seq, feed_pos))
        per_row = lambda t: t[:, None].expand(q_n, g).reshape(-1)  # noqa: E731 - [Q] -> [Q·Γ]
        positions = (anchor_pos[:, None] + torch.arange(g, device=feats.device)).reshape(-1)  # [Q·Γ]
        rows = self.cache(kv, per_row(block_seq), positions, per_row(anchor_pos + gamma - 1),
                          kernel=self.attention_kernel)
        x = F.embedding(block.reshape(1, -1), self.embed.weight)  # [1, Q·Γ, H]
        hidden = d._blocks(x, positions, rows, None, g).view(q_n, g, -1)[:, 1:]  # the draft slots
        logits = d.lm_head(hidden)
        if not self.picks:
            return logits, hidden
        if not self.tables:
            drafts = d.drafts(hidden, logits, block[:, 0])
            return (drafts, logits, hidden) if self.distributions else drafts
        # the candidates and their projection taken once, for the drafts and the tables
        selector = d.candidate_selector
        cand_logits, cand_ids = logits.topk(selector.num_candidates, dim=-1)
        projected = selector.hidden_projection(hidden)
        drafts = selector.select_projected(projected, cand_logits, cand_ids, block[:, 0])
        return (drafts, logits, hidden, cand_logits, cand_ids,
                *selector.projected_tables(projected, cand_logits, cand_ids, block[:, 0]))
