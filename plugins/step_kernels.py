"""One launch where a GPU decode step ran a handful: DFlash2's candidate selection, Qwen3's q/k
norm with rotary and DFlash2's dynamic conv, as Triton kernels
(`triton_kernels.dflash2_select_kernel`, `triton_kernels.qk_norm_rope_kernel`, and the conv op's
own `dflash2_dynamic_conv_kernel`).

At the tiny sizes a decode step runs, a step's time on a GPU is its launches (or, replayed as
a CUDA graph, its nodes), not its arithmetic. The selector's left-to-right pick is about eight
small ops per draft slot, so a block of 7 drafts is some 56 launches; the per-head norm and the
rotary of q and k are about a dozen per layer, the conv's float32 math about eight. Each becomes
one launch here.

The models call these through `use(t)`: true for a CUDA tensor outside a trace, once
`prepare` has run each kernel on this device against the PyTorch forms and they agreed. A
device where triton is missing (or imported in interpreter mode), or where a kernel fails or
disagrees, keeps the PyTorch forms, and `prepare` says why; so does METRALE_STEP_KERNELS=0 in
the environment. Exported graphs and CPU packages always trace the PyTorch forms.

The kernels compute in float32 and round once where the PyTorch forms round per op, so the
norm and rotary can differ from the eager forms' in the last bits of a 16-bit output, and the
selector, which scores in float32 where the PyTorch form scores in the model's dtype, can pick
another candidate at a near-tie (a draft: the verify decides what is emitted). A step's rows stay
independent of each other, and plain and speculative decoding run the same kernels, so greedy
speculative output stays plain decoding's.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

SWITCH = "METRALE_STEP_KERNELS"  # 0: keep the PyTorch forms (what a before/after measures)

_state = {"on": False, "cpu": False}  # `prepare` passed; tests: run them on CPU (interpreter)


def use(t: torch.Tensor) -> bool:
    """Does a step on `t`'s device run the kernels here? (A CUDA tensor, not traced, no autograd
    (the kernels have no backward), kernels checked on the device by `prepare`; `layers.tracing`
    is the same test of a trace.)"""
    return (_state["on"] and (t.is_cuda or _state["cpu"]) and not torch.is_grad_enabled()
            and not (torch._C._is_tracing() or torch.compiler.is_compiling()))


def dflash2_select(projected: torch.Tensor, cand_logits: torch.Tensor, cand_ids: torch.Tensor,
                   anchor: torch.Tensor, predecessor: torch.Tensor, successor: torch.Tensor) -> torch.Tensor:
    """`dflash.CandidateSelector.select_candidates` in one launch: projected [B, n, D] (the
    slots' hidden projection), the candidates' logits and ids [B, n, K], anchor [B], the
    codebooks [V, D] -> the drafts [B, n] int64."""
    from metrale.plugins.triton_mode import load_kernels

    b, n, d = projected.shape
    k = cand_ids.shape[-1]
    out = torch.empty(b, n, dtype=torch.long, device=projected.device)
    load_kernels(projected.device.type).dflash2_select_kernel[(b,)](
        projected.contiguous(), cand_logits.contiguous(), cand_ids.contiguous(), anchor.contiguous(),
        predecessor.contiguous(), successor.contiguous(), out, n, k, d,
        BLOCK_K=_pow2(k), BLOCK_D=_pow2(d), num_warps=1)
    return out


def qk_norm_rope(q_in: torch.Tensor, k_in: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, nh: int, nkv: int, hd: int):
    """q_in [B, T, ≥ nh·hd] and k_in [B, T, ≥ nkv·hd] (their heads from column 0, rows evenly
    strided: a fused projection's views or two projections), weight [nh+nkv, hd] (each head's
    norm multiplier), cos/sin [T, hd] -> q [B, nh, T, hd] and k [B, nkv, T, hd], normed
    per head and roped: `layers.Attention.project_qkv`'s q and k."""
    from metrale.plugins.triton_mode import load_kernels

    b, t, _ = q_in.shape
    for name, x in (("q_in", q_in), ("k_in", k_in)):
        if x.stride(-1) != 1 or x.stride(0) != t * x.stride(1):
            raise ValueError(f"qk_norm_rope: {name} {tuple(x.shape)} with strides {x.stride()}: its "
                             "rows must be evenly strided with unit-stride heads")
    if hd & (hd - 1):
        raise ValueError(f"qk_norm_rope: head_dim {hd} must be a power of two")
    q = torch.empty(b, nh, t, hd, dtype=q_in.dtype, device=q_in.device)
    k = torch.empty(b, nkv, t, hd, dtype=q_in.dtype, device=q_in.device)
    load_kernels(q_in.device.type).qk_norm_rope_kernel[(b * t, nh + nkv)](
        q_in, k_in, weight.contiguous(), cos.contiguous(), sin.contiguous(), q, k,
        t, nh, nkv, q_in.stride(1), k_in.stride(1), eps, HD=hd, num_warps=1)
    return q, k


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prepare(device: torch.device, dtype: torch.dtype) -> str:
    """Check each kernel on `device` against the PyTorch forms (small random inputs in
    `dtype`) and turn them on where all agree: '' then, else why they stay off."""
    _state["on"] = False
    switch = os.environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        from metrale.runtime.errors import ConfigError

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
        why = _agree(device, dtype)
    except Exception as exc:  # noqa: BLE001 - no triton, a compile or launch failure: stay off
        why = f"{type(exc).__name__}: {exc}"
    if why:
        why = f"fused step kernels off, running their PyTorch forms: {why}"
        log.warning(why)
        return why
    _state["on"] = True
    return ""


def _agree(device: torch.device, dtype: torch.dtype) -> str:
    """'' where both kernels give the PyTorch forms' results on this device, else what differed."""
    from metrale.runtime.models.configs import DecoderConfig
    from metrale.runtime.models.dflash import CandidateSelector
    from metrale.runtime.models.layers import Attention, rope_cos_sin

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
    got = dflash2_select(projected, cand_logits, cand_ids, anchor, sel.predecessor_codebook.to(dtype),
                         sel.successor_codebook.to(dtype))
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
    got = qk_norm_rope(qkv, qkv[..., 4 * 32:], attn.qk_norm_weight, cos, sin, cfg.rms_norm_eps, 4, 2, 32)
    for name, a, b in zip("qk", got, want):
        if not _close(a, b):
            return f"qk_norm_rope's {name} is {_off(a, b):.3g} off the PyTorch form's"
    from metrale.plugins.dynamic_conv import conv_math, dflash2_dynamic_conv_triton

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


def on_cpu_for_tests(on: bool = True) -> None:
    """Run the kernels on CPU tensors too (triton's interpreter): what the CPU tests of the
    models' fused paths use. Off again with `on=False`."""
    _state["on"] = _state["cpu"] = on
