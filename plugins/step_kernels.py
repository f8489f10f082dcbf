"""One launch where a GPU decode step ran a handful: DFlash2's candidate selection, Qwen3's q/k
norm with rotary and DFlash2's dynamic conv, as Triton kernels
(`triton_kernels.dflash2_select_kernel`, `triton_kernels.qk_norm_rope_kernel`, and the conv op's
own `dflash2_dynamic_conv_kernel`).

At the tiny sizes a decode step runs, a step's time on a GPU is its launches (or, replayed as
a CUDA graph, its nodes), not its arithmetic. The selector's left-to-right pick is about eight
small ops per draft slot, so a block of 7 drafts is some 56 launches; the per-head norm and the
rotary of q and k are about a dozen per layer, the conv's float32 math about eight. Each becomes
one launch here.

The models call these through `use(t)`: true for a CUDA tensor outside a trace and without
autograd, once the engine's load has run each kernel on this device against the PyTorch forms
and they agreed (`runtime.backends.step_check.prepare`, which turns them on with `enable`). A
device where triton is missing (or imported in interpreter mode), or where a kernel fails or
disagrees, keeps the PyTorch forms, and the load says why; so does METRALE_STEP_KERNELS=0 in the
environment. Exported graphs and CPU packages always trace the PyTorch forms.

The kernels compute in float32 and round once where the PyTorch forms round per op, so the
norm and rotary can differ from the eager forms' in the last bits of a 16-bit output, and the
selector, which scores in float32 where the PyTorch form scores in the model's dtype, can pick
another candidate at a near-tie (a draft: the verify decides what is emitted). A step's rows stay
independent of each other, and plain and speculative decoding run the same kernels, so greedy
speculative output stays plain decoding's.
"""

from __future__ import annotations

import torch

from metrale.plugins.triton_mode import cdiv

# on: checked on the device; cpu: tests run them on CPU tensors (the interpreter); kernels: the
# module of kernels, loaded once when they are turned on
_state = {"on": False, "cpu": False, "kernels": None}
MOE_BLOCK = 32  # the MoE kernels' tile: 32 outputs of a program by 64 inputs a step
LANE_BLOCK_S = 64  # the slots `lane_attention` scores at a time
# the most query rows (rows × query heads per key/value head) one `lane_attention` program holds:
# a step's and a tree's of up to 32 nodes; a prompt's rows, more, take the PyTorch form
LANE_MAX_ROWS = 128


def use(t: torch.Tensor) -> bool:
    """Does a step on `t`'s device run the kernels here? (A CUDA tensor, not traced, no autograd
    (the kernels have no backward), kernels checked on the device; `layers.tracing` is the same
    test of a trace.)"""
    return (_state["on"] and (t.is_cuda or _state["cpu"]) and not torch.is_grad_enabled()
            and not (torch._C._is_tracing() or torch.compiler.is_compiling()))


def dflash2_select(projected: torch.Tensor, cand_logits: torch.Tensor, cand_ids: torch.Tensor,
                   anchor: torch.Tensor, predecessor: torch.Tensor, successor: torch.Tensor) -> torch.Tensor:
    """`dflash.CandidateSelector.select_candidates` in one launch: projected [B, n, D] (the
    slots' hidden projection), the candidates' logits and ids [B, n, K], anchor [B], the
    codebooks [V, D] -> the drafts [B, n] int64."""
    b, n, d = projected.shape
    k = cand_ids.shape[-1]
    out = torch.empty(b, n, dtype=torch.long, device=projected.device)
    kernels(projected.device.type).dflash2_select_kernel[(b,)](
        projected.contiguous(), cand_logits.contiguous(), cand_ids.contiguous(), anchor.contiguous(),
        predecessor.contiguous(), successor.contiguous(), out, n, k, d,
        BLOCK_K=_pow2(k), BLOCK_D=_pow2(d), num_warps=1)
    return out


def qk_norm_rope(q_in: torch.Tensor, k_in: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, nh: int, nkv: int, hd: int):
    """q_in [B, T, ≥ nh·hd] and k_in [B, T, ≥ nkv·hd] (their heads from column 0: a fused
    projection's views or two projections), weight [nh+nkv, hd] (each head's norm multiplier),
    cos/sin [T, hd] -> q [B, nh, T, hd] and k [B, nkv, T, hd], normed per head and roped:
    `layers.Attention.project_qkv`'s q and k. hd is a power of two."""
    b, t, _ = q_in.shape
    if hd & (hd - 1):
        raise ValueError(f"qk_norm_rope: head_dim {hd} must be a power of two")
    q_rows, k_rows = (_rows(x, b * t) for x in (q_in, k_in))
    q = torch.empty(b, nh, t, hd, dtype=q_in.dtype, device=q_in.device)
    k = torch.empty(b, nkv, t, hd, dtype=q_in.dtype, device=q_in.device)
    kernels(q_in.device.type).qk_norm_rope_kernel[(b * t, nh + nkv)](
        q_rows, k_rows, weight.contiguous(), cos.contiguous(), sin.contiguous(), q, k,
        t, nh, nkv, q_rows.stride(0), k_rows.stride(0), eps, HD=hd, num_warps=1)
    return q, k


def moe_experts(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_k: int, norm_topk: bool) -> torch.Tensor:
    """`layers.MoE.route` then its routed experts (`MoE._dense_experts`' math) in three launches
    where the PyTorch forms run thirteen: x [N, H], the router's weight [E, H], the stacked
    experts' gate/up [E·2I, H] and down [E, I, H] (`MoE.pack`'s), all in x's dtype -> [N, H].
    Each row reads only its k experts' weights (the dense form multiplies the others by zero),
    and rounds where the PyTorch forms round, so it gives their results up to the order of each
    dot product's sum."""
    n, h = x.shape
    e, inter, _ = down.shape
    x = x.contiguous()
    ids = torch.empty(n, top_k, dtype=torch.long, device=x.device)
    weights = torch.empty(n, top_k, dtype=x.dtype, device=x.device)
    act = torch.empty(n * top_k, inter, dtype=torch.float32, device=x.device)
    y = torch.empty(n, h, dtype=x.dtype, device=x.device)
    k = kernels(x.device.type)
    k.moe_route_kernel[(n,)](x, router_weight.contiguous(), ids, weights, h, e, top_k, NORM=norm_topk,
                             BLOCK_E=_pow2(e), BLOCK_H=min(64, _pow2(h)))
    k.moe_gate_up_kernel[(n * top_k, cdiv(inter, MOE_BLOCK))](x, ids, gate_up.contiguous(), act, h, inter, top_k,
                                                              BLOCK_I=MOE_BLOCK, BLOCK_H=2 * MOE_BLOCK)
    k.moe_down_kernel[(n, cdiv(h, MOE_BLOCK))](act, ids, weights, down.contiguous(), y, h, inter, top_k,
                                              BLOCK_H=MOE_BLOCK, BLOCK_I=2 * MOE_BLOCK)
    return y


def lane_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last_visible: torch.Tensor,
                   hidden: torch.Tensor | None, rows: int) -> torch.Tensor:
    """`step_caches.LaneKV.attend` in one launch where the PyTorch form runs five (the scaling,
    the two products, the mask, the softmax) and the mask's two: q [1, nh, B·R, hd] (hd a power
    of two of at least 16), the pool's views k [B, nkv, hd, S] and v [B, nkv, S, hd], each row's
    last visible slot [B·R] (int64), or, for a draft tree's rows, `hidden` [B, 1, R, S] (bool:
    the slots a row may not see) -> [1, B·R, nh·hd]. It rounds where the PyTorch form rounds."""
    _, nh, n, hd = q.shape
    b, nkv, _, s = k.shape
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty(n, nh * hd, dtype=q.dtype, device=q.device)
    tree = hidden is not None
    last_visible = last_visible.contiguous()  # (often a lane's one value expanded over its rows)
    hid = hidden.reshape(b, rows, s).contiguous().view(torch.uint8) if tree else last_visible
    kernels(q.device.type).lane_attention_kernel[(b, nkv)](
        q[0].contiguous(), k, v, last_visible, hid, out, rows, s, nkv, nh // nkv, hd ** -0.5,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        HD=hd, BLOCK_M=max(16, _pow2(nh // nkv * rows)), BLOCK_S=LANE_BLOCK_S, TREE=tree,
        DOT_F32=q.dtype == torch.float32 or not q.is_cuda)
    return out[None]


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, T, F] as n = B·T evenly strided rows of unit-stride columns: a view where the
    layout allows one (a fused projection's slice), else a copy."""
    rows = x.reshape(n, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def enable(on: bool) -> None:
    """Turn the kernels on for CUDA tensors (after their check on the device:
    `backends.step_check.prepare`) or off."""
    _state["on"] = on
    _state["kernels"] = _load("cuda") if on else None


def kernels(device_type: str):
    """The kernels' module: the one loaded when they were turned on (a decode step loads
    nothing), else loaded for `device_type` (the load's check, tests)."""
    return _state["kernels"] if _state["kernels"] is not None else _load(device_type)


def _load(device_type: str):
    from metrale.plugins.triton_mode import load_kernels

    return load_kernels(device_type)


def on_cpu_for_tests(on: bool = True) -> None:
    """Run the kernels on CPU tensors too (triton's interpreter): what the CPU tests of the
    models' fused paths use. Off again with `on=False`."""
    _state["on"] = _state["cpu"] = on
    _state["kernels"] = _load("cpu") if on else None
