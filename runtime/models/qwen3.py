"""The target model: Qwen3 (dense) and Qwen3-MoE decoders with a KV cache and hidden-state taps.

`forward(ids, cache, start, taps)` returns the logits and, for the speculative loop, the hidden
states the drafters read: `taps` lists DFlash layer ids, id l being transformers'
`output_hidden_states` entry `hidden_states[l+1]` — the output of decoder layer l for l < L−1,
and for the last layer (l = L−1) that output *after the final norm*, because transformers
replaces its last entry with the normed state (z-lab's drafters are trained on exactly these
entries). `last_hidden` is the final layer's output before the final norm (what the MTP head
consumes). Tensor names are exactly the HF checkpoint's
(`model.layers.N.self_attn.q_proj.weight`, `model.layers.N.mlp.experts.E.gate_proj.weight`, …), so
`state_dict()` is the checkpoint layout and loading needs no renames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from metrale.runtime.models.configs import DecoderConfig
from metrale.runtime.models.kv_cache import KVCache
from metrale.runtime.models.layers import DecoderLayer, RMSNorm
from metrale.runtime.models.rotary import rope_cos_sin, rope_table


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V]
    last_hidden: torch.Tensor  # [B, T, H], last layer output before the final norm
    taps: torch.Tensor | None  # [B, T, n_taps*H] concatenated in `taps` order, or None
    argmax: list[int] | None = None  # each row's greedy token, when a batched forward took them at once

    def kept(self, what: str) -> "TargetOutput":
        """Only its `what` ("hidden" or "taps"): what a proposer holds until it feeds the rows
        to its drafter, without the logits."""
        return TargetOutput(None, self.last_hidden if what == "hidden" else None,
                            self.taps if what == "taps" else None)


class Qwen3Body(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, moe=cfg.layer_is_moe(i)) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim,
                       self.dtype, self.model.embed_tokens.weight.device)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, start: int | None = None,
                taps: tuple[int, ...] = (), logit_rows: torch.Tensor | None = None) -> TargetOutput:
        """ids [B, T]. With a cache, the tokens sit at positions start.. (default: cache.length)
        and the cache length becomes start+T; a step cache that places its rows itself
        (`step_caches`) gives each row's position. `logit_rows` [M]: only those rows' logits
        ([B, M, V])."""
        if cache is not None and start is None:
            start = cache.length
        start = 0 if start is None else start
        t = ids.shape[1]
        x = self.model.embed_tokens(ids)  # [B, T, H]
        placed = getattr(cache, "positions", None)
        if placed is not None:  # rows of a compiled step: each at its own position
            positions = placed
            c = self.config
            cos, sin = rope_table(c.head_dim, c.rope_theta, x.dtype, x.device, c.max_position_embeddings)
            rope = cos[positions], sin[positions]
        elif isinstance(start, torch.Tensor):  # a traced step (`StepKV`): the position is an input
            depths = getattr(cache, "depths", None)  # a tree's rows: each at its depth
            positions = start + (torch.arange(t, device=ids.device) if depths is None else depths)
            c = self.config
            rope = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
        else:
            positions = torch.arange(start, start + t, device=ids.device)
            rope = self.rope(start, t, x.dtype, x.device)
        tapped: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, cache, i, start, rope)
            if i in taps and i != last:
                tapped[i] = x
        if cache is not None:
            cache.length = start + t
        normed = self.model.norm(x)  # [B, T, H]
        if last in taps:
            tapped[last] = normed  # transformers' hidden_states[L] is the normed output
        logits = self.lm_head(normed if logit_rows is None else normed[:, logit_rows])
        tap = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return TargetOutput(logits=logits, last_hidden=x, taps=tap)

    def rope(self, start: int, t: int, dtype: torch.dtype, device: torch.device):
        """cos, sin [T, hd] for positions start..start+T−1, from the shared table (`rotary.rope_table`)."""
        c = self.config
        cos, sin = rope_table(c.head_dim, c.rope_theta, dtype, device, max(c.max_position_embeddings, start + t))
        return cos[start:start + t], sin[start:start + t]
