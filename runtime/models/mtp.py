"""The MTP (multi-token prediction) head: one decoder layer that drafts the token after next.

Entry p of the head's stream pairs the token at position p+1 with the hidden state of position
p: `x_p = fc(cat[norm_e(embed(token_{p+1})), norm_h(hidden_p)])` — the embedding comes first —
where hidden_p is the target's last-layer output (before its final norm), or, inside a chain, the
head's own pre-norm output of entry p−1. Entry p sits at rotary position p and cache slot p, and
through `norm` and the draft LM head gives the draft distribution for token p+2. The layer's
output h is fed back, so a chain reuses the one head k times.

Two checkpoint namings (see `loader.RENAMES`): Qwen3-Next `mtp.*` (zero-centred norms x̂·(1+w),
shared expert with a sigmoid gate) and DeepSeek/GLM `model.layers.{N}.*` (`enorm`, `hnorm`,
`eh_proj`, `shared_head.norm`; plain norms; `shared_experts` without a gate). Internally both use
the names of this module: `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layer.*`, `norm`,
`lm_head` (the draft LM head: a copy of the target's, so quantization can treat it separately).
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.runtime.models.configs import MTPConfig
from metrale.runtime.models.kv_cache import KVCache
from metrale.runtime.models.layers import DecoderLayer, RMSNorm


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.config = cfg
        d, zc = cfg.decoder, cfg.zero_centred_norm
        h = d.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, d.rms_norm_eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(h, d.rms_norm_eps, zc)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(d, moe=d.is_moe, zero_centred_norm=zc,
                                  shared_gate=cfg.naming == "qwen3_next")
        self.norm = RMSNorm(h, d.rms_norm_eps, zc)
        self.lm_head = nn.Linear(h, d.vocab_size, bias=False)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device="cpu") -> KVCache:
        d = self.config.decoder
        return KVCache(1, batch, d.num_key_value_heads, max_len, d.head_dim, dtype, device)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: KVCache | None = None,
                start: int | None = None):
        """Entries start..start+T−1. embeds [B, T, H] (target embedding of token p+1 for entry p),
        hidden [B, T, H] (hidden state of position p) -> (logits [B, T, V], h [B, T, H] pre-norm)."""
        if cache is not None and start is None:
            start = cache.length
        start = 0 if start is None else start
        t = embeds.shape[1]
        arange = torch.arange(t, device=embeds.device)
        # a traced step (`StepKV`) has its position as a tensor input; a step cache that places
        # its rows itself (`step_caches`) gives each row's
        positions = getattr(cache, "positions", None)
        if positions is None:
            positions = start + arange if isinstance(start, torch.Tensor) else arange + start
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))  # [B, T, H]
        h = self.layer(x, positions, cache, 0, start)
        if cache is not None:
            cache.length = start + t
        return self.lm_head(self.norm(h)), h
