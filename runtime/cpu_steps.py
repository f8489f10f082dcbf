"""Static-shape step modules: what `metrale build` compiles into AOTInductor packages for CPUs.

Each module wraps the runtime's own (packed, see `layers.pack_for_inference`) model and reads
its weights and submodules; only the attention is written anew, over a *static* KV cache:

- a layer's cache is one contiguous tensor per K and V, [S, nkv, hd] (slot-major), passed in as
  an input and written in place (`index_copy_` at the step's positions), so the caller owns it
  and a prefix `cache[:S_b]` of a larger one is itself contiguous — one buffer serves every
  length bucket S_b a package was built for;
- every step attends over all S_b slots with a mask (slot j is visible to the query at position
  p iff j <= p), written as a reduction, and the routed experts are gathered per row inside a
  reduction, so each row's arithmetic depends only on that row;
- the dense projections are `F.linear` (`linear="gemm"`: inductor's CPU micro-GEMM templates,
  fast, and row-invariant where the build's check finds them so) or reductions over the input
  features (`linear="rowwise"`: row-invariant by construction, slower); the build compiles
  "gemm" and falls back to "rowwise" when a multi-row package's rows differ from one-row steps.

Inputs: `ids` [1, T] int64, `pos` [1] int64 (position of ids[0, 0]), then K and V of every layer.
Target outputs: logits [1, T, V], last_hidden [1, T, H] (pre final norm), taps [1, T, n·H]
(transformers' hidden_states[l+1] for each tap id l, as `qwen3` defines them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.runtime.layers import MoE, apply_rope, rope_cos_sin
from metrale.runtime.qwen3 import Qwen3ForCausalLM


LINEARS = ("gemm", "rowwise")


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T written as a reduction over K: compiled, every output element
    is one loop over K whose order depends on K alone, so a row's result does not depend on how
    many rows the step has (a GEMM library picks other kernels at M = 1 than at M = 8)."""
    return (x.unsqueeze(-2) * weight).sum(-1)


def moe_rowwise(moe, x: torch.Tensor, linear=rowwise_linear) -> torch.Tensor:
    """A packed `layers.MoE` on x [T, H], every product a reduction: each row gathers its top-k
    experts' weights (compiled, the gather is an indirect load inside the reduction: only the
    selected experts are read) and sums their outputs in slot order."""
    probs = torch.softmax(linear(x, moe.gate.weight).float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)  # [T, k]
    if moe.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    e, inter, hidden = moe.experts_down.shape
    gate_up = moe.experts_gate_up.view(e, 2 * inter, hidden)[ids]  # [T, k, 2I, H]
    gate, up = (x[:, None, None, :] * gate_up).sum(-1).chunk(2, dim=-1)  # [T, k, I] each
    down = moe.experts_down.transpose(1, 2)[ids]  # [T, k, H, I]
    y = ((F.silu(gate) * up).unsqueeze(-2) * down).sum(-1)  # [T, k, H]
    out = (y * weights.to(x.dtype).unsqueeze(-1)).sum(1)  # [T, H]
    if moe.shared_expert is not None:
        s = moe.shared_expert
        g, u = linear(x, s.gate_up_weight).chunk(2, dim=-1)
        shared = linear(F.silu(g) * u, s.down_proj.weight)
        if moe.shared_expert_gate is not None:
            shared = torch.sigmoid(linear(x, moe.shared_expert_gate.weight)) * shared
        out = out + shared
    return out


def static_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """q [T, nh, hd] (normed, roped); k/v_cache [S, nkv, hd] already holding this step's keys;
    positions [T] -> [T, nh·hd]. Softmax over all S slots, masked to slots <= the row's position."""
    t, nh, hd = q.shape
    s, nkv, _ = k_cache.shape
    g = nh // nkv
    qg = q.view(t, nkv, g, hd)  # head h reads KV head h // g
    scores = (qg.unsqueeze(1) * k_cache.view(1, s, nkv, 1, hd)).sum(-1) * hd ** -0.5  # [T, S, nkv, g]
    visible = torch.arange(s, device=q.device)[None, :] <= positions[:, None]  # [T, S]
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)  # over the slots
    out = (probs.unsqueeze(-1) * v_cache.view(1, s, nkv, 1, hd)).sum(1)  # [T, nkv, g, hd]
    return out.reshape(t, nh * hd)


class TargetStep(nn.Module):
    """The target's step over a static cache (see the module docstring)."""

    def __init__(self, model: Qwen3ForCausalLM, taps: tuple[int, ...] = (), linear: str = "gemm"):
        super().__init__()
        if linear not in LINEARS:
            raise ValueError(f"linear {linear!r}: expected one of {LINEARS}")
        self.model, self.taps = model, tuple(taps)
        self.linear = F.linear if linear == "gemm" else rowwise_linear
        c = model.config
        cos, sin = rope_cos_sin(torch.arange(c.max_position_embeddings + 64), c.head_dim,
                                c.rope_theta, model.dtype)
        self.register_buffer("cos", cos, persistent=False)  # [P, hd]
        self.register_buffer("sin", sin, persistent=False)

    def _ffn(self, mlp, x: torch.Tensor) -> torch.Tensor:
        if isinstance(mlp, MoE):
            return moe_rowwise(mlp, x, self.linear)
        gate, up = self.linear(x, mlp.gate_up_weight).chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, mlp.down_proj.weight)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, *kv: torch.Tensor):
        m = self.model
        body, cfg = m.model, m.config
        t = ids.shape[1]
        positions = pos + torch.arange(t, device=ids.device)  # [T]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [T, 1, hd]
        x = body.embed_tokens(ids)[0]  # [T, H]
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        last = len(body.layers) - 1
        tapped = {}
        for i, layer in enumerate(body.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = self.linear(h, a.qkv_weight).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = apply_rope(a.q_norm(q.view(t, nh, hd)), cos, sin)  # [T, nh, hd]
            k = apply_rope(a.k_norm(k.view(t, nkv, hd)), cos, sin)  # [T, nkv, hd]
            k_cache, v_cache = kv[2 * i], kv[2 * i + 1]  # [S, nkv, hd]
            k_cache.index_copy_(0, positions, k)
            v_cache.index_copy_(0, positions, v.view(t, nkv, hd))
            x = x + self.linear(static_attention(q, k_cache, v_cache, positions), a.o_proj.weight)
            x = x + self._ffn(layer.mlp, layer.post_attention_layernorm(x))
            if i in self.taps and i != last:
                tapped[i] = x
        normed = body.norm(x)
        if last in self.taps:
            tapped[last] = normed
        logits = self.linear(normed, m.lm_head.weight)
        outs = (logits[None], x[None])
        if self.taps:
            outs += (torch.cat([tapped[i] for i in self.taps], dim=-1)[None],)
        return outs
