"""The check an engine's load runs before a GPU step takes the fused kernels of
`plugins.step_kernels`: each kernel once on the device, on small random inputs in the engine's
dtype, against the PyTorch forms it replaces; they are turned on only where all agree (the
switch METRALE_STEP_KERNELS=0 keeps them off)."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from metrale.plugins import step_kernels
from metrale.plugins.dynamic_conv import conv_math, dflash2_dynamic_conv_triton
from metrale.runtime.errors import ConfigError
from metrale.runtime.models.configs import DecoderConfig
from metrale.runtime.models.dflash import CandidateSelector
from metrale.runtime.models.layers import Attention, MoE
from metrale.runtime.models.rotary import rope_cos_sin
from metrale.runtime.models.step_caches import LaneKV

log = logging.getLogger(__name__)

SWITCH = "METRALE_STEP_KERNELS"  # 0: keep the PyTorch forms (what a before/after measures)


def prepare(device: torch.device, dtype: torch.dtype) -> str:
    """Check each kernel on `device` against the PyTorch forms (small random inputs in
    `dtype`) and turn them on where all agree: '' then, else why they stay off."""
    step_kernels.enable(False)
    switch = os.environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise ConfigError(f"environment variable {SWITCH}={switch!r}: expected 1 (the fused step "
                          "kernels where they check out, the default) or 0 (their PyTorch forms)")
    if switch == "0":
        return f"fused step kernels off ({SWITCH}=0)"
    if device.type != "cuda":
        return "the fused step kernels run on CUDA devices only"
    try:
        from metrale.plugins.triton_mode import triton_interprets

        if triton_interprets():
            return "triton was imported in interpreter mode (TRITON_INTERPRET=1): fused step kernels off"
        why = agree(device, dtype)
    except Exception as exc:  # noqa: BLE001 - no triton, a compile or launch failure: stay off
        why = f"{type(exc).__name__}: {exc}"
    if why:
        why = f"fused step kernels off, running their PyTorch forms: {why}"
        log.warning(why)
        return why
    step_kernels.enable(True)
    return ""


def agree(device: torch.device, dtype: torch.dtype) -> str:
    """'' where every kernel gives the PyTorch forms' results on this device, else what differed."""
    g = torch.Generator(device="cpu").manual_seed(0)
    # the selector's inputs in `dtype`; the PyTorch form scores the same values in float32, as
    # the kernel does, so the picks must agree (up to the dot products' summation order)
    sel = CandidateSelector(32, 256, 32, 16)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(dtype))
    sel.hidden_projection = torch.nn.Identity()
    sel = sel.to(device)
    projected = torch.randn(2, 7, 32, generator=g).to(device, dtype)
    cand_logits, cand_ids = (4 * torch.randn(2, 7, 256, generator=g)).to(device, dtype).topk(16, dim=-1)
    anchor = torch.tensor([3, 9], device=device)
    want = sel.select_candidates(projected.float(), cand_logits.float(), cand_ids, anchor)
    got = step_kernels.dflash2_select(projected, cand_logits, cand_ids, anchor,
                                      sel.predecessor_codebook.to(dtype), sel.successor_codebook.to(dtype))
    if not torch.equal(got, want):
        return f"dflash2_select drafted {got.tolist()}, the selector {want.tolist()}"
    cfg = DecoderConfig(vocab_size=16, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, intermediate_size=64, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=64)
    attn = Attention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 1.0) + (p.dim() == 1))
    attn = attn.to(device, dtype)
    attn.pack()
    x = torch.randn(2, 5, 64, generator=g).to(device, dtype)
    cos, sin = rope_cos_sin(torch.arange(3, 8, device=device), 32, 10000.0, dtype)
    want = attn.project_qkv(x, cos, sin)[:2]
    qkv = torch.nn.functional.linear(x, attn.qkv_weight)
    got = step_kernels.qk_norm_rope(qkv, qkv[..., 4 * 32:], attn.qk_norm_weight, cos, sin,
                                    cfg.rms_norm_eps, 4, 2, 32)
    for name, a, b in zip("qk", got, want):
        if not _close(a, b):
            return f"qk_norm_rope's {name} is {_off(a, b):.3g} off the PyTorch form's"
    moe = MoE(dataclasses.replace(cfg, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                  norm_topk_prob=True))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    moe = moe.to(device, dtype)
    moe.pack()
    moe.row_invariant = True  # the PyTorch form the graphs capture: every expert, weighted
    x = torch.randn(2, 5, 64, generator=g).to(device, dtype)
    a = step_kernels.moe_experts(x.reshape(10, 64), moe.gate.weight, moe.experts_gate_up, moe.experts_down, 2, True)
    b = moe(x).reshape(10, 64)
    if not _close(a, b):
        return f"moe_experts is {_off(a, b):.3g} off the PyTorch form's"
    kv = [torch.randn(3, 2, 32, 80, generator=g).to(device, dtype), torch.randn(3, 2, 80, 32, generator=g).to(device, dtype)]
    kv = [kv[0][1:, :, :, :70], kv[1][1:, :, :70]]  # two lanes' first 70 slots of a pool's
    pos = torch.tensor([20, 21, 22, 60, 61, 62], device=device)
    lanes = LaneKV(kv, torch.arange(2, device=device).repeat_interleave(3), pos)
    q = torch.randn(1, 4, 6, 32, generator=g).to(device, dtype)
    hidden = torch.rand(2, 1, 3, 70, generator=g).to(device) < 0.5  # a tree's rows: what it leaves them
    hidden[0, 0, torch.arange(3), pos[:3]] = hidden[1, 0, torch.arange(3), pos[3:]] = False
    tree = LaneKV(kv, torch.arange(2, device=device).repeat_interleave(3), pos, hidden=hidden)
    for name, a, b in (("", step_kernels.lane_attention(q, kv[0], kv[1], pos, None, 3), lanes.attend(0, q)),
                       (" (a tree's rows)", step_kernels.lane_attention(q, kv[0], kv[1], pos, hidden, 3),
                        tree.attend(0, q))):
        if not _close(a, b):
            return f"lane_attention{name} is {_off(a, b):.3g} off the PyTorch form's"
    x = torch.randn(2, 16, 64, generator=g).to(device, dtype)
    kernel = torch.randn(2, 16, 8, 2, generator=g).to(device, dtype)
    a, b = dflash2_dynamic_conv_triton(x, kernel, 8), conv_math(x, kernel, 8)
    if not _close(a, b):
        return f"dflash2_dynamic_conv's kernel is {_off(a, b):.3g} off its math"
    return ""


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within rounding: float32 to 1e-4, a 16-bit dtype to four units in its last place (the
    PyTorch forms round after each op, up to four times on a CPU, the kernels once or twice)."""
    rtol, atol = (1e-4, 1e-4) if a.dtype == torch.float32 else (2 ** -5, 2 ** -5)
    return torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol)


def _off(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
