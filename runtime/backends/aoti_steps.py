"""Static-shape step modules: what `metrale build` compiles into AOTInductor packages for CPUs.

Each module is built from the runtime's own loaded model and reads its weights (quantized
linears dequantized once into the activation dtype, `layers.float_weight`) and norm modules;
only the attention is written anew, over a *static* KV cache:

- a layer's cache is one contiguous tensor per K and V, [S, nkv, hd] (slot-major), passed in as
  an input and written in place (`index_copy_` at the step's positions), so the caller owns it.
  S is the packages' one dynamic dimension: a request's cache is sized to its length once, and
  every step of the request runs over that S;
- every step attends over all S slots with a mask (slot j is visible to the query at position
  p iff j <= p), written as a reduction, and the routed experts are gathered per row inside a
  reduction, so each row's arithmetic depends only on that row;
- the dense projections are `F.linear` (`linear="gemm"`: inductor's CPU micro-GEMM templates,
  fast, and row-invariant where the build's check finds them so) or reductions over the input
  features (`linear="rowwise"`: row-invariant by construction, slower); the build compiles
  "gemm" and falls back to "rowwise" for the target when a multi-row package's rows differ
  from one-row steps. Drafter packages only move drafts, never emitted tokens: always "gemm".

Target (`TargetStep`): `ids` [1, T] int64, `pos` [1] int64 (position of ids[0, 0]), then K and V
of every layer -> logits [1, T, V], last_hidden [1, T, H] (pre final norm), taps [1, T, n·H]
(transformers' hidden_states[l+1] for each tap id l, as `qwen3` defines them).

MTP head (`BatchedMTPStep`): the head's forward (`mtp.MTPHead`) for the rows of many sequences,
each over its own one-layer cache in a pool, as the target's `BatchedTargetStep` does.

DFlash drafter (`BatchedDFlashStep`), one call feeds context and proposes a block for many
sequences, each over its own cache in a pool: the fed rows' K/V land at their positions, the
block sits at the positions from its anchor on, sees every context slot before the anchor and
its first `gamma` slots, and its K/V are written at its own slots (past the context, masked for
every later row and written again by the sequence's next feed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.plugins.dynamic_conv import dflash2_dynamic_conv
from metrale.plugins.nvfp4_moe import dense_experts
from metrale.runtime.models.layers import MoE, apply_rope, float_weight, rope_cos_sin

LINEARS = ("gemm", "rowwise")


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T written as a reduction over K: compiled, every output element
    is one loop over K whose order depends on K alone, so a row's result does not depend on how
    many rows the step has (a GEMM library picks other kernels at M = 1 than at M = 8)."""
    return (x.unsqueeze(-2) * weight).sum(-1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """q [T, nh, hd] (normed, roped); k/v [S, nkv, hd] shared by every row, or [T, S, nkv, hd]
    one per row; visible [T, S] bool -> [T, nh·hd], the softmax over the slots written as
    reductions (head h reads KV head h // (nh / nkv))."""
    t, nh, hd = q.shape
    s, nkv = k.shape[-3], k.shape[-2]
    per_row = t if k.dim() == 4 else 1
    qg = q.view(t, nkv, nh // nkv, hd)
    scores = (qg.unsqueeze(1) * k.view(per_row, s, nkv, 1, hd)).sum(-1) * hd ** -0.5  # [T, S, nkv, g]
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)  # over the slots
    out = (probs.unsqueeze(-1) * v.view(per_row, s, nkv, 1, hd)).sum(1)  # [T, nkv, g, hd]
    return out.reshape(t, nh * hd)


def pooled_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seq: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of rows of many sequences, each over its own cache in a pool: q [T, nh,
    hd]; k_pool [B, nkv, hd, S] (slot-minor, so the scores of 16 slots are one vector FMA per
    feature, with no horizontal sums); v_pool [B, S, nkv, hd]; row t reads sequence seq[t],
    slot j visible iff j <= positions[t] -> [T, nh·hd]. Reductions over one row's data only."""
    t, nh, hd = q.shape
    nkv, s = k_pool.shape[1], k_pool.shape[3]
    g = nh // nkv
    kt = k_pool[seq]  # [T, nkv, hd, S]
    scores = (q.view(t, nkv, g, hd, 1) * kt.view(t, nkv, 1, hd, s)).sum(3) * hd ** -0.5  # [T, nkv, g, S]
    visible = torch.arange(s, device=q.device)[None, :] <= positions[:, None]  # [T, S]
    probs = torch.softmax(scores.masked_fill(~visible[:, None, None, :], float("-inf")), dim=-1)
    v = v_pool[seq]  # [T, S, nkv, hd]
    out = (probs.permute(0, 3, 1, 2).unsqueeze(-1) * v.view(t, s, nkv, 1, hd)).sum(1)  # [T, nkv, g, hd]
    return out.reshape(t, nh * hd)


def static_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Causal attention over a cache already holding this step's keys: slot j is visible to the
    row at position p iff j <= p."""
    visible = torch.arange(k_cache.shape[0], device=q.device)[None, :] <= positions[:, None]
    return masked_attention(q, k_cache, v_cache, visible)


def _weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    return float_weight(linear).to(dtype).contiguous()


class StepFFN(nn.Module):
    """A SwiGLU MLP or a routed MoE (with its optional gated shared expert) as reductions and
    GEMMs over dense weights: each MoE row gathers its top-k experts' weights (compiled, the
    gather is an indirect load inside the reduction: only the selected experts are read) and
    sums their outputs in slot order."""

    def __init__(self, mlp: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.moe = isinstance(mlp, MoE)
        dense = mlp.shared_expert if self.moe else mlp
        if self.moe:
            self.top_k, self.norm_topk = mlp.top_k, mlp.norm_topk
            if mlp.experts_gate_up is None and mlp.nvfp4_stacked is None:
                mlp.pack()
            if mlp.nvfp4_stacked is not None:  # NVFP4 experts: the grouped op's dequantized copy
                gate_up, down_t = dense_experts(*mlp.nvfp4_stacked)[:2]  # [E, 2I, H], [E, H, I]
            else:
                e, inter, hidden = mlp.experts_down.shape
                gate_up = mlp.experts_gate_up.view(e, 2 * inter, hidden)
                down_t = mlp.experts_down.transpose(1, 2)
            self.register_buffer("router", _weight(mlp.gate, dtype))
            self.register_buffer("experts_gate_up", gate_up.to(dtype))
            self.register_buffer("experts_down_t", down_t.to(dtype).contiguous())
            gate = mlp.shared_expert_gate
            self.register_buffer("shared_gate", None if gate is None else _weight(gate, dtype))
        self.register_buffer("gate_up", None if dense is None else torch.cat(
            [_weight(dense.gate_proj, dtype), _weight(dense.up_proj, dtype)]))
        self.register_buffer("down", None if dense is None else _weight(dense.down_proj, dtype))

    def _swiglu(self, x, linear):
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down)

    def forward(self, x: torch.Tensor, linear) -> torch.Tensor:
        if not self.moe:
            return self._swiglu(x, linear)
        probs = torch.softmax(linear(x, self.router).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        gate, up = (x[:, None, None, :] * self.experts_gate_up[ids]).sum(-1).chunk(2, dim=-1)  # [T, k, I]
        y = ((F.silu(gate) * up).unsqueeze(-2) * self.experts_down_t[ids]).sum(-1)  # [T, k, H]
        out = (y * weights.to(x.dtype).unsqueeze(-1)).sum(1)  # [T, H]
        if self.gate_up is not None:
            shared = self._swiglu(x, linear)
            if self.shared_gate is not None:
                shared = torch.sigmoid(linear(x, self.shared_gate)) * shared
            out = out + shared
        return out


class StepAttention(nn.Module):
    """Projections and per-head norms of a (Qwen3-style) attention, for static-cache steps."""

    def __init__(self, attn: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.nh, self.nkv, self.hd = attn.nh, attn.nkv, attn.hd
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.register_buffer("qkv", torch.cat([_weight(p, dtype) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]))
        self.register_buffer("o", _weight(attn.o_proj, dtype))

    def qkv_roped(self, h: torch.Tensor, cos, sin, linear):
        """h [T, H] -> q [T, nh, hd], k [T, nkv, hd] (normed, roped) and v [T, nkv, hd]."""
        t = h.shape[0]
        q, k, v = linear(h, self.qkv).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = apply_rope(self.q_norm(q.view(t, self.nh, self.hd)), cos, sin)
        k = apply_rope(self.k_norm(k.view(t, self.nkv, self.hd)), cos, sin)
        return q, k, v.view(t, self.nkv, self.hd)

    def cached(self, h, positions, cos, sin, k_cache, v_cache, linear, seq=None) -> torch.Tensor:
        """Causal attention of rows at `positions`, writing their K/V into the static cache
        ([S, nkv, hd]), or, with `seq` [T] (each row's sequence), into a pool of caches (keys
        [B, nkv, hd, S], values [B, S, nkv, hd]) where each row reads its own sequence's slots
        only (`pooled_attention`)."""
        q, k, v = self.qkv_roped(h, cos, sin, linear)
        if seq is None:
            k_cache.index_copy_(0, positions, k)
            v_cache.index_copy_(0, positions, v)
            return linear(static_attention(q, k_cache, v_cache, positions), self.o)
        k_cache[seq, :, :, positions] = k  # keys slot-minor: [B, nkv, hd, S]
        v_cache.index_put_((seq, positions), v)
        return linear(pooled_attention(q, k_cache, v_cache, seq, positions), self.o)


class StepLayer(nn.Module):
    """A pre-norm decoder layer (target or MTP head) over its static cache."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.attn = StepAttention(layer.self_attn, dtype)
        self.ffn = StepFFN(layer.mlp, dtype)

    def forward(self, x, positions, cos, sin, k_cache, v_cache, linear, seq=None):
        h = self.input_layernorm(x)
        x = x + self.attn.cached(h, positions, cos, sin, k_cache, v_cache, linear, seq)
        return x + self.ffn(self.post_attention_layernorm(x), linear)


def _rope_table(cfg, positions: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(torch.arange(positions), cfg.head_dim, cfg.rope_theta, dtype)


def _linear_fn(linear: str):
    if linear not in LINEARS:
        raise ValueError(f"linear {linear!r}: expected one of {LINEARS}")
    return F.linear if linear == "gemm" else rowwise_linear


class TargetStep(nn.Module):
    """The target's step over a static cache (see the module docstring)."""

    def __init__(self, model, taps: tuple[int, ...] = (), linear: str = "gemm", positions: int | None = None):
        super().__init__()
        self.linear = _linear_fn(linear)
        self.taps = tuple(taps)
        c = model.config
        dtype = model.dtype
        self.embed_tokens, self.norm = model.model.embed_tokens, model.model.norm
        self.layers = nn.ModuleList(StepLayer(layer, dtype) for layer in model.model.layers)
        self.register_buffer("lm_head", _weight(model.lm_head, dtype))
        cos, sin = _rope_table(c, positions or c.max_position_embeddings + 64, dtype)
        self.register_buffer("cos", cos, persistent=False)  # [P, hd]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, *kv: torch.Tensor):
        t = ids.shape[1]
        positions = pos + torch.arange(t, device=ids.device)  # [T]
        return tuple(o[None] for o in self.rows(ids[0], positions, None, kv))

    def rows(self, ids: torch.Tensor, positions: torch.Tensor, seq, kv, want=None):
        """ids, positions (and `seq`) [T] -> logits [T, V] (only of the rows `want` [M], when
        given: [M, V]), last hidden [T, H] (, taps [T, n·H])."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [T, 1, hd]
        x = self.embed_tokens(ids)  # [T, H]
        last = len(self.layers) - 1
        tapped = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cos, sin, kv[2 * i], kv[2 * i + 1], self.linear, seq)
            if i in self.taps and i != last:
                tapped[i] = x
        normed = self.norm(x)
        if last in self.taps:
            tapped[last] = normed
        outs = (self.linear(normed if want is None else normed[want], self.lm_head), x)
        if self.taps:
            outs += (torch.cat([tapped[i] for i in self.taps], dim=-1),)
        return outs


class BatchedTargetStep(TargetStep):
    """The target's step over the rows of many sequences at once (`aoti_batched`): `ids`,
    `pos`, `seq` [N] int64 (each row's token, position and sequence, a sequence's rows in
    position order), `want` [M] int64 (the rows whose logits are needed: a prompt needs its
    last row's only), then K and V of every layer as pools, K [B, nkv, hd, S] and V
    [B, S, nkv, hd] (sequence b's cache is [b]) -> logits [M, V], last_hidden [N, H], taps
    [N, n·H]. A row reads its own sequence's slots only, so its bits depend on its sequence,
    never on the batch."""

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, want: torch.Tensor,
                *kv: torch.Tensor):
        return self.rows(ids, pos, seq, kv, want)


class MTPStep(nn.Module):
    """The MTP head's weights and its entries' arithmetic (`BatchedMTPStep` runs them)."""

    def __init__(self, head, positions: int):
        super().__init__()
        d = head.config.decoder
        dtype = head.pre_fc_norm_embedding.weight.dtype
        self.norm_e, self.norm_h, self.norm = head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.norm
        self.register_buffer("fc", _weight(head.fc, dtype))
        self.layer = StepLayer(head.layer, dtype)
        self.register_buffer("lm_head", _weight(head.lm_head, dtype))
        cos, sin = _rope_table(d, positions, dtype)  # the target's context and a padded step
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rows(self, embeds, hidden, positions, seq, k_cache, v_cache):
        """embeds, hidden [T, H], positions (and `seq`) [T] -> logits [T, V], h [T, H]."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        x = F.linear(torch.cat([self.norm_e(embeds), self.norm_h(hidden)], dim=-1), self.fc)
        h = self.layer(x, positions, cos, sin, k_cache, v_cache, F.linear, seq)
        return F.linear(self.norm(h), self.lm_head), h


class BatchedMTPStep(MTPStep):
    """The MTP head's entries for the rows of many sequences at once (`aoti_batched`): `embeds`,
    `hidden` [N, H], `pos`, `seq` [N] int64 (each row's position and sequence, a sequence's rows
    in position order), then the head's K pool [B, nkv, hd, S] and V pool [B, S, nkv, hd] ->
    logits [N, V], h [N, H]. A row reads its own sequence's slots only."""

    def forward(self, embeds, hidden, pos, seq, k_pool, v_pool):
        return self.rows(embeds, hidden, pos, seq, k_pool, v_pool)


class DFlashStep(nn.Module):
    """The drafter's weights as its step reads them (`BatchedDFlashStep` runs them)."""

    def __init__(self, drafter, embed: nn.Embedding, feed_rows: int, positions: int):
        super().__init__()
        cfg = drafter.config
        d = cfg.decoder
        dtype = drafter.norm.weight.dtype
        self.version, self.block, self.feed_rows = cfg.version, cfg.block_size, feed_rows
        self.register_buffer("embed", embed.weight.detach().to(dtype))
        self.register_buffer("fc", _weight(drafter.fc, dtype))
        stacked = drafter.context_kv_proj  # the engine's own context K/V weights, when it has them
        self.register_buffer("ctx_kv", _weight(stacked, dtype) if stacked is not None else
                             drafter.stacked_context_kv_weight().detach().to(dtype))  # [L·2·nkv·hd, H]
        self.hidden_norm, self.norm = drafter.hidden_norm, drafter.norm
        self.attn = nn.ModuleList(StepAttention(layer.self_attn, dtype) for layer in drafter.layers)
        self.ln1 = nn.ModuleList(layer.input_layernorm for layer in drafter.layers)
        self.ln2 = nn.ModuleList(layer.post_attention_layernorm for layer in drafter.layers)
        self.ffn = nn.ModuleList(StepFFN(layer.mlp, dtype) for layer in drafter.layers)
        if cfg.version == 2:
            convs = [(layer.attention_conv, layer.mlp_conv) for layer in drafter.layers]
            self.groups = cfg.conv_groups
            self.register_buffer("conv_base", torch.stack([torch.stack([a.base_kernel, m.base_kernel])
                                                           for a, m in convs]).to(dtype))  # [L, 2, G, 2]
            self.register_buffer("conv_proj", torch.stack([torch.stack([_weight(a.kernel_projection, dtype),
                                                                        _weight(m.kernel_projection, dtype)])
                                                           for a, m in convs]))  # [L, 2, 2G, H]
            sel = drafter.candidate_selector
            self.num_candidates = sel.num_candidates
            self.register_buffer("pred_cb", sel.predecessor_codebook.detach().to(dtype))
            self.register_buffer("succ_cb", sel.successor_codebook.detach().to(dtype))
            self.register_buffer("sel_proj", _weight(sel.hidden_projection, dtype))
        self.register_buffer("lm_head", _weight(drafter.lm_head, dtype))
        cos, sin = _rope_table(d, positions, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


class BatchedDFlashStep(DFlashStep):
    """Feed context and propose one block for many sequences at once (`aoti_batched`), each over
    its own cache in a pool: `feats` [NF, n·Ht] (every sequence's newly kept rows' taps, in
    sequence order), `feed_pos`, `feed_seq` [NF] (their positions and sequences), `block`
    [Q, Γ] (each proposing sequence's anchor then masks), `block_seq`, `anchor_pos`, `gamma` [Q],
    then each layer's K pool [B, nkv, hd, S] and V pool [B, S, nkv, hd] -> drafts [Q, Γ−1].
    The fed rows' K/V land at their slots; the block's K/V are written at the slots from its
    anchor on (masked for every later row of the sequence and overwritten by its next feed and
    block), and each block row sees its sequence's slots before the anchor and the block's first
    `gamma` slots."""

    def forward(self, feats, feed_pos, feed_seq, block, block_seq, anchor_pos, gamma, *kv):
        q_n, g = block.shape
        dev = feats.device
        a0 = self.attn[0]
        c = self.hidden_norm(F.linear(feats, self.fc))  # [NF, H]
        ctx = F.linear(c, self.ctx_kv).view(-1, len(self.attn), 2, a0.nkv, a0.hd)
        cf, sf = self.cos[feed_pos][:, None], self.sin[feed_pos][:, None]
        blk_pos = (anchor_pos[:, None] + torch.arange(g, device=dev)).reshape(-1)  # [Q·Γ]
        per_row = lambda t: t[:, None].expand(q_n, g).reshape(-1)  # noqa: E731 - [Q] -> [Q·Γ]
        rows_seq = per_row(block_seq)
        last_visible = per_row(anchor_pos + gamma - 1)  # each row sees its sequence's slots up to it
        cb, sb = self.cos[blk_pos][:, None], self.sin[blk_pos][:, None]
        x = F.embedding(block.reshape(-1), self.embed)  # [Q·Γ, H]
        for i, attn in enumerate(self.attn):
            k_pool, v_pool = kv[2 * i], kv[2 * i + 1]
            k = apply_rope(attn.k_norm(ctx[:, i, 0]), cf, sf)  # the fed context's
            k_pool[feed_seq, :, :, feed_pos] = k
            v_pool.index_put_((feed_seq, feed_pos), ctx[:, i, 1])
            if self.version == 2:
                x = x + self._conv(x, i, 0, q_n, g)
            q, kb, vb = attn.qkv_roped(self.ln1[i](x), cb, sb, F.linear)
            k_pool[rows_seq, :, :, blk_pos] = kb
            v_pool.index_put_((rows_seq, blk_pos), vb)
            out = pooled_attention(q, k_pool, v_pool, rows_seq, last_visible)
            x = x + F.linear(out, attn.o)
            if self.version == 2:
                x = x + self._conv(x, i, 1, q_n, g)
            x = x + self.ffn[i](self.ln2[i](x), F.linear)
        hidden = self.norm(x).view(q_n, g, -1)[:, 1:]  # [Q, Γ−1, H]: the draft slots
        logits = F.linear(hidden, self.lm_head)
        if self.version == 2:
            return self._select(hidden, logits, block[:, 0])
        return logits.argmax(-1)

    def _conv(self, x, layer: int, which: int, q_n: int, g: int) -> torch.Tensor:
        """The two-tap grouped dynamic conv (`dflash.DynamicConv`) over each sequence's block
        (x [Q·Γ, H]), through the `metrale::dflash2_dynamic_conv` op over blocks of Γ slots
        (slot 0 of every block sees no previous slot); the build compiles the op's math in its
        place (`dynamic_conv.inductor_decompositions`)."""
        t, h = x.shape
        kernel = self.conv_base[layer, which] + F.linear(x, self.conv_proj[layer, which]).view(t, self.groups, 2)
        return dflash2_dynamic_conv(x.view(q_n, g, h), kernel.view(q_n, g, self.groups, 2), g).view(t, h)

    def _select(self, hidden, logits, anchors) -> torch.Tensor:
        """DFlash2's candidate selector (`dflash.CandidateSelector`) for every sequence's block
        at once, left to right over the draft slots."""
        cand_logits, cand_ids = logits.topk(self.num_candidates, dim=-1)  # [Q, n, K]
        z0 = F.linear(hidden, self.sel_proj)  # [Q, n, D]
        prev, out = anchors, []
        for j in range(hidden.shape[1]):
            z = z0[:, j] + F.embedding(prev, self.pred_cb)  # [Q, D]
            s = cand_logits[:, j].float() + (F.embedding(cand_ids[:, j], self.succ_cb) * z[:, None]).sum(-1).float()
            prev = cand_ids[:, j].gather(1, s.argmax(-1, keepdim=True))[:, 0]  # [Q]
            out.append(prev)
        return torch.stack(out, dim=1)
