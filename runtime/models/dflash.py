"""DFlash block drafters: z-lab's DFlash and DFlash2.

A propose is one non-causal forward over the block `[anchor, MASK×(γ−1)]` (embedded with the
target's embedding) at positions anchor_pos.. ; slot j predicts the token at anchor_pos+j. Every
layer's attention sees, besides the block, the *context*: the target's tapped hidden states at the
accepted positions 0..anchor_pos−1, turned into features by `hidden_norm(fc(taps))` and into K/V by
each layer's own k/v projections (the same weights as the block's K/V; an engine may hold them
stacked into one GEMM, `context_kv_proj`). Context K/V are cached; the block's are never kept.
Invariant: the drafter cache's length is the anchor's position.

DFlash2 adds, per layer, two-tap grouped dynamic convs over the block slots — before attention
(`attention_conv`) and before the MLP (`mlp_conv`): for G channel groups,
    y[t, g] = k[t, g, 0]·x[t, g] + k[t, g, 1]·x[t−1, g],  k[t] = base_kernel + kernel_projection(x[t])
(x[−1] = 0) added residually — and a candidate selector: per slot, the top-16 candidates of the
draft LM head are rescored with
    score(c) = logit(c) + ⟨hidden_projection(h_slot) + predecessor_codebook[prev], successor_codebook[c]⟩
where prev is the token chosen at the slot before (the anchor for slot 1), left to right.

Tensor parallel (`tp`, see `runtime.models.tp`): each rank builds the drafter with its own heads,
intermediate slice and LM-head vocab slice; the partial outputs of o_proj and down_proj are
summed over the ranks (one all-reduce each), and the drafts come from the global top
candidates gathered from every rank's vocab slice (one all-gather), so every rank drafts the
same tokens, equal to one rank's up to the all-reduce's summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metrale.plugins import step_kernels
from metrale.plugins.dynamic_conv import dflash2_dynamic_conv
from metrale.runtime.models.configs import DFlashConfig
from metrale.runtime.models.kv_cache import KVCache
from metrale.runtime.models.layers import MLP, Attention, RMSNorm, attend
from metrale.runtime.models.rotary import rope_at
from metrale.runtime.models.tp import TOP_CANDIDATES, TensorParallel, check_drafter_split, local_decoder


class DynamicConv(nn.Module):
    """Two-tap grouped dynamic conv along the block slots (see the module docstring)."""

    def __init__(self, hidden: int, groups: int):
        super().__init__()
        if hidden % groups:
            raise ValueError(f"hidden size {hidden} is not divisible by conv_groups {groups}")
        self.groups = groups
        self.base_kernel = nn.Parameter(torch.zeros(groups, 2))
        self.kernel_projection = nn.Linear(hidden, groups * 2, bias=False)

    def forward(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """x [B, nb*Bs, H] (nb blocks of `block` slots) -> y [B, nb*Bs, H], through the
        `metrale::dflash2_dynamic_conv` op (its products and sum in float32, one rounding): the
        op the exported graph holds as a `DFlash2DynamicConv` node and an engine as its plugin."""
        b, t, _ = x.shape
        kernel = self.base_kernel.to(x.dtype) + self.kernel_projection(x).view(b, t, self.groups, 2)
        return dflash2_dynamic_conv(x, kernel, block)


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, dim: int, num_candidates: int):
        super().__init__()
        self.num_candidates = num_candidates
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, dim))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, dim))
        self.hidden_projection = nn.Linear(hidden, dim, bias=False)

    def scores(self, hidden, cand_ids, cand_logits, prev_ids):
        """hidden [..., H], cand_ids/cand_logits [..., K], prev_ids [...] -> scores [..., K] (fp32).

        Codebook rows are looked up with `F.embedding`, not indexing: on CPU its backward sums
        the gradients of repeated ids in a fixed order, so training the selector is reproducible."""
        return self._scores(self.hidden_projection(hidden), cand_ids, cand_logits, prev_ids)

    def _scores(self, projected, cand_ids, cand_logits, prev_ids):
        """`scores` with hidden_projection(hidden) given."""
        z = projected + F.embedding(prev_ids, self.predecessor_codebook)  # [..., D]
        bonus = (F.embedding(cand_ids, self.successor_codebook) * z.unsqueeze(-2)).sum(-1)  # [..., K]
        return cand_logits.float() + bonus.float()

    def select(self, hidden, logits, anchor):
        """hidden [B, n, H], logits [B, n, V] for the draft slots, anchor [B] -> tokens [B, n]."""
        cand_logits, cand_ids = logits.topk(self.num_candidates, dim=-1)  # [B, n, K]
        return self.select_candidates(hidden, cand_logits, cand_ids, anchor)

    def select_candidates(self, hidden, cand_logits, cand_ids, anchor):
        """hidden [B, n, H], the top candidates' logits/ids [B, n, K], anchor [B] -> [B, n]."""
        return self.select_projected(self.hidden_projection(hidden), cand_logits, cand_ids, anchor)

    def select_projected(self, projected, cand_logits, cand_ids, anchor):
        """`select_candidates` with hidden_projection(hidden) [B, n, D] given."""
        if step_kernels.use(projected):  # a GPU: the whole left-to-right pick in one launch
            return step_kernels.dflash2_select(projected, cand_logits, cand_ids, anchor,
                                               self.predecessor_codebook, self.successor_codebook)
        prev, out = anchor, []
        for j in range(projected.shape[1]):
            s = self._scores(projected[:, j], cand_ids[:, j], cand_logits[:, j], prev)  # [B, K]
            prev = cand_ids[:, j].gather(-1, s.argmax(-1, keepdim=True)).squeeze(-1)
            out.append(prev)
        return torch.stack(out, dim=1)

    def tables(self, hidden, cand_logits, cand_ids, anchor):
        """Every slot's candidates under the selector given each possible parent: hidden
        [B, n, H], the top candidates' logits/ids [B, n, K], anchor [B] -> (log-probabilities
        [B, n, K, K], their ids [B, n, K, K]), row r of slot j the distribution over j's
        candidates given the token before them is the anchor (j = 0, every row) or slot j−1's
        candidate r, each row sorted best first (ties in candidate order). What a draft tree's
        nodes take their children from (`spec.ddtree.SelectorChildren`), all of a block's in
        one batched product."""
        return self.projected_tables(self.hidden_projection(hidden), cand_logits, cand_ids, anchor)

    def parent_log_probs(self, projected, cand_logits, cand_ids, anchor):
        """`tables`' log-probabilities in candidate order, unsorted: hidden_projection(hidden)
        [B, n, D], the top candidates' logits/ids [B, n, K], anchor [B] -> [B, n, K parents,
        K] (a NaN as −inf)."""
        b, n, k = cand_ids.shape
        parents = torch.cat([anchor[:, None, None].expand(b, 1, k), cand_ids[:, :-1]], dim=1)
        z = projected[:, :, None, :] + F.embedding(parents, self.predecessor_codebook)  # [B, n, K, D]
        bonus = torch.matmul(z, F.embedding(cand_ids, self.successor_codebook).transpose(-1, -2))
        lp = torch.log_softmax(cand_logits.float()[:, :, None, :] + bonus.float(), -1)  # [B, n, K parents, K]
        return torch.where(lp.isnan(), float("-inf"), lp)  # (a NaN compares unequal: its place would be no one's)

    def projected_tables(self, projected, cand_logits, cand_ids, anchor):
        """`tables` with hidden_projection(hidden) given. Each row is sorted by counting, for
        every candidate, the candidates that go before it (a greater value, or an equal one
        earlier), then placing each where its count says: K elementwise terms over a row's K
        (a library sort costs more, per row, than the whole table at these sizes)."""
        b, n, k = cand_ids.shape
        lp = self.parent_log_probs(projected, cand_logits, cand_ids, anchor)
        i = torch.arange(k, device=lp.device)
        # a candidate's place: how many of the row go before it
        place = sum(((lp[..., j:j + 1] > lp) | ((lp[..., j:j + 1] == lp) & (i > j))).long() for j in range(k))
        unsorted = cand_ids[:, :, None, :].expand(b, n, k, k)
        vals = sum(torch.where(place[..., j:j + 1] == i, lp[..., j:j + 1], 0.0) for j in range(k))
        ids = sum(torch.where(place[..., j:j + 1] == i, unsorted[..., j:j + 1], 0) for j in range(k))
        return vals, ids


def candidate_drafts(selector: CandidateSelector | None, num_candidates: int, hidden, vals, ids,
                     anchor) -> torch.Tensor:
    """The drafts of every slot's global top candidates (vals/ids [B, n, K], sorted by value, as
    tensor-parallel ranks gather them): the first (the argmax), or DFlash2's selector over the
    first `num_candidates`."""
    if selector is None:
        return ids[..., 0]
    n = num_candidates
    return selector.select_candidates(hidden, vals[..., :n], ids[..., :n], anchor)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        d = cfg.decoder if tp is None else local_decoder(cfg.decoder, tp.rank, tp.size)
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.self_attn = Attention(d)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.mlp = MLP(d.hidden_size, d.intermediate_size)
        if cfg.version == 2:
            self.attention_conv = DynamicConv(d.hidden_size, cfg.conv_groups)
            self.mlp_conv = DynamicConv(d.hidden_size, cfg.conv_groups)

    def forward(self, x, cos, sin, context, mask, block: int, index: int = 0):
        """x [B, Tq, H]; context: this layer's context K/V, a pair [B, nkv, S, hd] with mask
        [Tq, S+Tq] bool or None (all visible), or a step cache holding every layer's
        (`step_caches`: it keeps the block's K/V at the block's slots and attends itself; this
        layer is its layer `index`)."""
        if hasattr(self, "attention_conv"):
            x = x + self.attention_conv(x, block)
        a = self.self_attn
        h = self.input_layernorm(x)
        q, k, v = a.project_qkv(h, cos, sin)
        b, t, _ = x.shape
        if isinstance(context, tuple):
            ctx_k, ctx_v = context
            out = attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)
            out = out.transpose(1, 2).reshape(b, t, a.nh * a.hd)
        else:
            context.write(index, None, k, v)
            out = context.attend(index, q)
        x = x + self._sum(a.o_proj(out))
        if hasattr(self, "mlp_conv"):
            x = x + self.mlp_conv(x, block)
        return x + self._sum(self.mlp(self.post_attention_layernorm(x)))

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """[B, Tq, H] this rank's heads' (or intermediate slice's) share -> the whole sum."""
        return partial if self.tp is None else self.tp.all_reduce(partial)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, γ−1] drafts for positions anchor_pos+1 ..
    logits: torch.Tensor  # [B, γ−1, V_r] draft LM-head logits of those slots for token ids
    vocab_start: int = 0  # vocab_start.. : the whole vocab on one rank, the rank's slice under tp
    # [B, γ−1, ·] what the face's candidate selector scores the slots with: their final hidden
    # states (the eager drafter's), or their projection (an exported graph's `selector_query`,
    # its selector's projection the identity)
    hidden: torch.Tensor | None = None
    # under tensor parallelism, for a draft tree (`propose` with `tree_nodes`): every slot's global top
    # candidates, (log-probabilities [B, γ−1, k], ids [B, γ−1, k]) best first
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    # a DFlash2 package's, for a draft tree: every slot's top candidates' logits and ids
    # [B, γ−1, K] and its selector's tables given each parent, log-probabilities and ids
    # [B, γ−1, K, K] (`CandidateSelector.tables`), on the host
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp  # None: the whole drafter in this process
        if tp is not None:
            check_drafter_split(cfg, tp.size)
        d = cfg.decoder
        # this rank's shapes: its KV heads, intermediate slice and vocab slice
        self.local = d if tp is None else local_decoder(d, tp.rank, tp.size)
        self.vocab_start = 0 if tp is None else tp.range(d.vocab_size)[0]
        self.fc = nn.Linear(cfg.num_context_features * cfg.target_hidden_size, d.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg, tp) for _ in range(d.num_hidden_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = nn.Linear(d.hidden_size, self.local.vocab_size, bias=False)
        self.context_kv_proj: nn.Module | None = None  # engine-only stacked k/v (see module doc)
        if cfg.version == 2:
            self.candidate_selector = CandidateSelector(d.hidden_size, d.vocab_size,
                                                        cfg.selector_dim, cfg.num_candidates)

    def engine_state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """What an engine directory stores for this drafter (module names, `dtype`): its state
        with the stacked context K/V projection (`context_kv_proj`) in place of any it holds."""
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()
                 if not k.startswith("context_kv_proj.")}
        state["context_kv_proj.weight"] = self.stacked_context_kv_weight().detach().to(dtype).contiguous()
        return state

    # -- context ---------------------------------------------------------------------------
    def stacked_context_kv_weight(self) -> torch.Tensor:
        """[L·2·nkv·hd, H]: every layer's k_proj then v_proj rows, layer by layer."""
        rows = []
        for layer in self.layers:
            rows += [layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]
        return torch.cat(rows, dim=0)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor):
        """features [B, C, n·Ht] -> per layer (k, v) [B, nkv, C, hd], roped at `positions` [C]."""
        c = self.hidden_norm(self.fc(features))  # [B, C, H]
        d = self.local
        cos, sin = rope_at(positions, d.head_dim, d.rope_theta, c.dtype)
        width = d.num_key_value_heads * d.head_dim
        if self.context_kv_proj is not None:
            kv = self.context_kv_proj(c).split(width, dim=-1)  # 2L × [B, C, nkv·hd]
        else:
            kv = []
            for layer in self.layers:
                kv += [layer.self_attn.k_proj(c), layer.self_attn.v_proj(c)]
        return [layer.self_attn.kv_from_projected(kv[2 * i], kv[2 * i + 1], cos, sin)
                for i, layer in enumerate(self.layers)]

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device="cpu") -> KVCache:
        d = self.local
        return KVCache(d.num_hidden_layers, batch, d.num_key_value_heads, max_len, d.head_dim,
                       dtype, device)

    def add_context(self, features: torch.Tensor, cache: KVCache) -> None:
        """Append the features [B, C, n·Ht] of the next C accepted positions to the cache (or
        write them at the positions of a step cache that places its rows, `step_caches`)."""
        start, n = cache.length, features.shape[1]
        positions = getattr(cache, "positions", None)
        if positions is None:
            positions = torch.arange(start, start + n, device=features.device)
        for i, (k, v) in enumerate(self.context_kv(features, positions)):
            cache.write(i, start, k, v)
        cache.length = start + n

    # -- propose ---------------------------------------------------------------------------
    def _blocks(self, x, positions, kv, mask, block):
        """x [B, Tq, H] block embeddings at `positions` [Tq]; kv per layer (k, v) of the context,
        or a step cache holding it (`DFlashLayer.forward`) -> normed hidden."""
        d = self.config.decoder
        cos, sin = rope_at(positions, d.head_dim, d.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv[i] if isinstance(kv, (list, tuple)) else kv, mask, block, i)
        return self.norm(x)

    def forward_block(self, block_embeds: torch.Tensor, cache: KVCache):
        """block_embeds [B, γ, H] at positions cache.length.. -> (hidden [B, γ, H], logits [B, γ, V])."""
        start, g = cache.length, block_embeds.shape[1]
        positions = torch.arange(start, start + g, device=block_embeds.device)
        kv = [(cache.k[i, :, :, :start], cache.v[i, :, :, :start]) for i in range(len(self.layers))]
        hidden = self._blocks(block_embeds, positions, kv, None, g)
        return hidden, self.lm_head(hidden)

    def propose(self, anchor: torch.Tensor, embed: nn.Embedding, cache: KVCache, gamma: int,
                tree_nodes: int = 0) -> Proposal:
        """anchor [B] (the last accepted token, at position cache.length) -> γ−1 greedy drafts.
        Under tensor parallelism with `tree_nodes` (a draft tree's), the proposal carries every
        slot's global top candidates, at least `tree_nodes`, with their log-probabilities under the
        whole vocabulary (`Proposal.top`), gathered with the drafts' own."""
        cfg = self.config
        block = torch.full((anchor.shape[0], gamma), cfg.mask_token_id, dtype=torch.long,
                           device=anchor.device)
        block[:, 0] = anchor
        hidden, logits = self.forward_block(embed(block), cache)
        hidden, logits = hidden[:, 1:], logits[:, 1:]
        if self.tp is not None:
            # one all-gather: every rank's top candidates (with a tree's, their normalizer), with
            # the anchors and the cache length as a lockstep check
            length = torch.tensor([float(cache.length)], device=anchor.device)
            got = self.tp.top_candidates(logits, self.vocab_start,
                                         max(TOP_CANDIDATES, cfg.num_candidates, tree_nodes),
                                         torch.cat([anchor.float(), length]), normalizer=tree_nodes > 0)
            vals, ids = got[:2]  # [B, n, k], best first
            selector = self.candidate_selector if cfg.version == 2 else None
            tokens = candidate_drafts(selector, cfg.num_candidates, hidden, vals, ids, anchor)
            top = (vals - got[2][..., None], ids) if tree_nodes else None
            return Proposal(tokens=tokens, logits=logits, vocab_start=self.vocab_start, hidden=hidden,
                            top=top)
        return Proposal(tokens=self.drafts(hidden, logits, anchor), logits=logits, hidden=hidden)

    def drafts(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """The greedy drafts of the draft slots (hidden [B, n, H], logits [B, n, V], anchor [B]):
        each slot's argmax, or DFlash2's candidate selector, left to right -> [B, n]."""
        if self.config.version == 2:
            return self.candidate_selector.select(hidden, logits, anchor)
        return logits.argmax(-1)

    # -- training ----------------------------------------------------------------------------
    def forward_train(self, features: torch.Tensor, block_embeds: torch.Tensor, anchors: list[int]):
        """Many blocks of one batch of sequences in one forward.

        features [B, L, n·Ht] for positions 0..L−1; block_embeds [B, nb·Bs, H] for blocks whose
        anchors (positions, the same for the whole batch) are `anchors`. Block b sees the context
        positions < anchors[b] and its own slots. Returns (hidden, logits) [B, nb·Bs, ·].
        """
        b, length, _ = features.shape
        nb = len(anchors)
        bs = block_embeds.shape[1] // nb
        dev = features.device
        kv = self.context_kv(features, torch.arange(length, device=dev))
        anchor_t = torch.tensor(anchors, device=dev)
        positions = (anchor_t[:, None] + torch.arange(bs, device=dev)[None, :]).reshape(-1)
        block_of_query = torch.arange(nb, device=dev).repeat_interleave(bs)  # [Tq]
        ctx_mask = torch.arange(length, device=dev)[None, :] < anchor_t[block_of_query][:, None]
        own = block_of_query[:, None] == block_of_query[None, :]
        mask = torch.cat([ctx_mask, own], dim=1)  # [Tq, L + Tq]
        hidden = self._blocks(block_embeds, positions, kv, mask, bs)
        return hidden, self.lm_head(hidden)
