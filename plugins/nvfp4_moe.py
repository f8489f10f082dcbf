"""`metrale::nvfp4_moe_w4a16`: the grouped NVFP4 W4A16 MoE experts (the routed part of a MoE).

Math, for x [T, H] (bf16/fp16/fp32), expert_ids int64 [T, k], weights [T, k] in x's dtype (the
router's top-k weights, already renormalised if the model does so) and per expert e of E:

    GU_e = dequant(gate_up_packed[e], gate_up_scale[e])  float32 [2I, H]: rows 0..I-1 are
           gate_proj, scaled by gate_up_global[e, 0]; rows I..2I-1 up_proj, by gate_up_global[e, 1]
           (ModelOpt quantizes the two projections apart, each with its own global scale)
    D_e  = dequant(down_packed[e], down_scale[e], down_global[e])           float32 [H, I]
    y[t] = sum_j weights[t, j] * D_e (silu(g) * u),  [g; u] = GU_e x[t],  e = expert_ids[t, j]

computed in float32 and returned in x's dtype [T, H]. This is `runtime.models.layers.MoE`'s routed
part (its `experts[e]` MLPs) with dequantized expert weights; it rounds once at the end where
an x-dtype MLP rounds after each projection, so it equals `MoE` exactly in float32 up to
summation order. The router and the shared expert stay outside the op. The NVFP4 format is
`formats.dequantize_nvfp4` per expert; all experts share I and H.

Other faces: `nvfp4_moe_w4a16_triton` (two kernels: `nvfp4_moe_gate_up_kernel` writes
silu(g)*u per routed (token, expert) pair to a float32 workspace [T*k, I], then
`nvfp4_moe_down_kernel` reduces each token's k pairs through their down projections), and the
ONNX node `metrale::NvFp4MoeW4A16` (`onnx_ops`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from metrale.plugins.formats import NVFP4_BLOCK, dequantize_nvfp4

OP_NAME = "metrale::nvfp4_moe_w4a16"
# Tile sizes of the two Triton kernels (also the constexprs `aot` compiles).
GATE_UP_BLOCKS = {"BLOCK_I": 32, "BLOCK_H": 64}
DOWN_BLOCKS = {"BLOCK_H": 32, "BLOCK_I": 64}


@torch.library.custom_op(OP_NAME, mutates_args=())
def nvfp4_moe_w4a16(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor, gate_up_global: torch.Tensor,
    down_packed: torch.Tensor, down_scale: torch.Tensor, down_global: torch.Tensor,
) -> torch.Tensor:
    """y [T, H] = sum_j weights[:, j] * expert_{ids[:, j]}(x), experts dequantized from NVFP4."""
    e, _ = _check(x, expert_ids, weights, gate_up_packed, gate_up_scale, gate_up_global,
                  down_packed, down_scale, down_global)
    gate_up, down, gate_up_of, down_of = dense_experts(
        gate_up_packed, gate_up_scale, gate_up_global, down_packed, down_scale,
        down_global)  # f32 [E, 2I, H], [E, H, I], and per expert its views
    xf = x.to(torch.float32)  # [T, H]
    wf = weights.to(torch.float32)
    if expert_ids.numel() <= e:  # few rows: each routed pair one mat-vec on its expert's weights
        return routed_matvecs(xf, expert_ids, wf, gate_up_of, down_of).to(x.dtype)
    out = torch.zeros_like(xf)  # [T, H] f32
    for ex in expert_ids.unique().tolist():
        token, slot = torch.nonzero(expert_ids == ex, as_tuple=True)  # [n], [n]
        gate, up = F.linear(xf[token], gate_up[ex]).chunk(2, dim=-1)  # [n, I] each
        out.index_add_(0, token, F.linear(F.silu(gate) * up, down[ex]) * wf[token, slot][:, None])
    return out.to(x.dtype)


def routed_matvecs(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up_of,
                   down_of) -> torch.Tensor:
    """x [T, H], expert_ids/weights [T, k], per expert its gate/up [2I, H] and down [H, I]
    weights -> [T, H]: each routed pair one mat-vec pair, a row's pairs summed in expert-id order
    (as a grouped sum over the experts adds them). The routing is read on the host, which on a
    CPU is no synchronisation."""
    rows = []
    for row, row_ids, row_w in zip(x, expert_ids.tolist(), weights.tolist()):  # row [H]
        acc = None
        for ex, w in sorted(zip(row_ids, row_w)):
            gate, up = F.linear(row, gate_up_of[ex]).chunk(2)  # [I] each
            y = torch.mv(down_of[ex], F.silu(gate).mul_(up)).mul_(w)  # [H]
            acc = y if acc is None else acc.add_(y)
        rows.append(acc)
    return torch.stack(rows)


# Dequantized experts by the stacked tensors they came from: the op reads an NVFP4 weight set
# once, as a GEMM library packs its weights once, since weights are constants at inference (a
# set whose storage moved is read again).
_DENSE = WeakIdKeyDictionary()


def dense_experts(gate_up_packed, gate_up_scale, gate_up_global, down_packed, down_scale,
                  down_global) -> tuple:
    """The experts dequantized (`formats.dequantize_nvfp4`, per expert and projection with its
    own global scale): gate/up float32 [E, 2I, H] (gate rows first), down float32 [E, H, I],
    and the lists of their per-expert views."""
    tensors = (gate_up_packed, gate_up_scale, gate_up_global, down_packed, down_scale, down_global)
    where = tuple(t.data_ptr() for t in tensors)
    hit = _DENSE.get(gate_up_packed)
    if hit is not None and hit[0] == where:
        return hit[1]
    inter = gate_up_packed.shape[1] // 2
    halves = (slice(0, inter), slice(inter, 2 * inter))
    gate_up = torch.stack([
        torch.cat([dequantize_nvfp4(gate_up_packed[e, rows], gate_up_scale[e, rows],
                                    gate_up_global[e, half]) for half, rows in enumerate(halves)])
        for e in range(gate_up_packed.shape[0])])
    down = torch.stack([dequantize_nvfp4(down_packed[e], down_scale[e], down_global[e])
                        for e in range(down_packed.shape[0])])
    dense = (gate_up, down, list(gate_up.unbind(0)), list(down.unbind(0)))
    _DENSE[gate_up_packed] = (where, dense)
    return dense


@nvfp4_moe_w4a16.register_fake
def _nvfp4_moe_w4a16_fake(x, expert_ids, weights, gate_up_packed, gate_up_scale, gate_up_global,
                          down_packed, down_scale, down_global):
    _check(x, expert_ids, weights, gate_up_packed, gate_up_scale, gate_up_global, down_packed,
           down_scale, down_global, check_ids=False)
    return torch.empty_like(x)


def _check(x, expert_ids, weights, gate_up_packed, gate_up_scale, gate_up_global, down_packed,
           down_scale, down_global, check_ids: bool = True) -> tuple[int, int]:
    """Validate shapes and dtypes; return (experts E, intermediate I)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.dim() != 2:
        raise ValueError(f"{OP_NAME}: x must be bf16/fp16/fp32 [T, H], got {x.dtype} "
                         f"{list(x.shape)}")
    t, h = x.shape
    if expert_ids.dtype != torch.int64 or expert_ids.dim() != 2 or expert_ids.shape[0] != t:
        raise ValueError(f"{OP_NAME}: expert_ids must be int64 [{t}, k], got {expert_ids.dtype} "
                         f"{list(expert_ids.shape)}")
    if weights.shape != expert_ids.shape or weights.dtype != x.dtype:
        raise ValueError(f"{OP_NAME}: weights must be {x.dtype} {list(expert_ids.shape)} (x's "
                         f"dtype, ids' shape), got {weights.dtype} {list(weights.shape)}")
    if gate_up_packed.dtype != torch.uint8 or gate_up_packed.dim() != 3:
        raise ValueError(f"{OP_NAME}: gate_up packed must be uint8 [E, 2I, H/2], got "
                         f"{gate_up_packed.dtype} {list(gate_up_packed.shape)}")
    e, two_i = gate_up_packed.shape[0], gate_up_packed.shape[1]
    inter = two_i // 2
    if two_i % 2 or inter % NVFP4_BLOCK or h % NVFP4_BLOCK:
        raise ValueError(f"{OP_NAME}: H={h} and I={two_i / 2:g} must be multiples of "
                         f"{NVFP4_BLOCK}")
    expected = {
        "gate_up packed": (gate_up_packed, (e, two_i, h // 2), torch.uint8),
        "gate_up block scales": (gate_up_scale, (e, two_i, h // NVFP4_BLOCK), torch.float8_e4m3fn),
        "gate_up global scales": (gate_up_global, (e, 2), torch.float32),
        "down packed": (down_packed, (e, h, inter // 2), torch.uint8),
        "down block scales": (down_scale, (e, h, inter // NVFP4_BLOCK), torch.float8_e4m3fn),
        "down global scales": (down_global, (e,), torch.float32),
    }
    for name, (tensor, shape, dtype) in expected.items():
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{OP_NAME}: {name} must be {dtype} {list(shape)}, got "
                             f"{tensor.dtype} {list(tensor.shape)}")
    if check_ids and expert_ids.numel() and not (
            0 <= int(expert_ids.min()) and int(expert_ids.max()) < e):
        raise ValueError(f"{OP_NAME}: expert ids must lie in [0, {e}), got "
                         f"[{int(expert_ids.min())}, {int(expert_ids.max())}]")
    return e, inter


def nvfp4_moe_w4a16_triton(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
    gate_up_packed: torch.Tensor, gate_up_scale: torch.Tensor, gate_up_global: torch.Tensor,
    down_packed: torch.Tensor, down_scale: torch.Tensor, down_global: torch.Tensor,
) -> torch.Tensor:
    """The Triton face: same contract as `nvfp4_moe_w4a16`; CPU tensors run in the interpreter."""
    from metrale.plugins.triton_mode import cdiv, load_kernels

    _, inter = _check(x, expert_ids, weights, gate_up_packed, gate_up_scale, gate_up_global,
                      down_packed, down_scale, down_global)
    kernels = load_kernels(x.device.type)
    t, h = x.shape
    k = expert_ids.shape[1]
    x = x.contiguous()
    ids = expert_ids.contiguous().view(-1)  # i64 [T*k]
    act = torch.empty((t * k, inter), dtype=torch.float32, device=x.device)  # workspace
    y = torch.empty_like(x)  # [T, H]
    if t * k == 0:
        return y.zero_()
    gb = GATE_UP_BLOCKS
    kernels.nvfp4_moe_gate_up_kernel[(t * k, cdiv(inter, gb["BLOCK_I"]))](
        x, ids, gate_up_packed.contiguous(), gate_up_scale.contiguous().view(torch.uint8),
        gate_up_global.contiguous(), act, h, inter, k, **gb, num_warps=4, enable_fp_fusion=False,
    )
    db = DOWN_BLOCKS
    kernels.nvfp4_moe_down_kernel[(t, cdiv(h, db["BLOCK_H"]))](
        act, ids, weights.contiguous().view(-1), down_packed.contiguous(),
        down_scale.contiguous().view(torch.uint8), down_global.contiguous(), y, h, inter, k,
        **db, num_warps=4, enable_fp_fusion=False,
    )
    return y
