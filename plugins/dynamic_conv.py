"""`metrale::dflash2_dynamic_conv`: DFlash2's two-tap grouped dynamic conv over block slots.

Math, for x [B, T, H] (bf16/fp16/fp32; T = nb·block, nb blocks of `block` slots), kernel
[B, T, G, 2] in x's dtype (per slot and channel group, already base_kernel + kernel_projection(x)) and
channel c in group g = c // (H/G):

    y[b, t, c] = kernel[b, t, g, 0]·x[b, t, c] + kernel[b, t, g, 1]·x[b, t−1, c]

where the second tap is absent (x[t−1] = 0) at each block's first slot, t % block == 0. This is
`runtime.models.dflash.DynamicConv.forward` after its kernel projection. Both products and their sum
are float32 and the result is rounded once to x's dtype: identical to `DynamicConv` in float32;
for bf16 it rounds once where `DynamicConv` in bf16 rounds three times.

Other faces: `dflash2_dynamic_conv_triton` (`triton_kernels.dflash2_dynamic_conv_kernel`,
bit-identical to this reference: the kernel rounds in the same order with FP fusion off) and
the ONNX node `metrale::DFlash2DynamicConv(x, kernel) -> y` with integer attribute `block`
(`onnx_ops`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.plugins import step_kernels
from metrale.plugins import triton_mode

OP_NAME = "metrale::dflash2_dynamic_conv"
TRITON_BLOCKS = {"BLOCK_H": 256}  # channels per program (also the constexpr `aot` compiles)


@torch.library.custom_op(OP_NAME, mutates_args=())
def dflash2_dynamic_conv(x: torch.Tensor, kernel: torch.Tensor, block: int) -> torch.Tensor:
    """y [B, T, H] from x [B, T, H] and kernel [B, T, G, 2] over blocks of `block` slots: on a
    GPU whose step kernels passed their check, the Triton kernel's one launch (`step_kernels`)."""
    if step_kernels.use(x):
        return dflash2_dynamic_conv_triton(x, kernel, block, step_kernels.kernels(x.device.type))
    _check(x, kernel, block)
    return conv_math(x, kernel, block)


def conv_math(x: torch.Tensor, kernel: torch.Tensor, block: int) -> torch.Tensor:
    """The op's math in plain torch ops (no checks): what it computes eagerly, and what a graph
    compiled by inductor holds in its place (`inductor_decompositions`)."""
    b, t, h = x.shape
    g = kernel.shape[2]
    xg = x.to(torch.float32).view(b, t // block, block, g, h // g)  # [B, nb, Bs, G, H/G]
    prev = F.pad(xg, (0, 0, 0, 0, 1, 0))[:, :, :-1]  # x[t−1] within each block, 0 at slot 0
    k = kernel.to(torch.float32).view(b, t // block, block, g, 2, 1)
    y = k[..., 0, :] * xg + k[..., 1, :] * prev  # [B, nb, Bs, G, H/G] f32
    return y.reshape(b, t, h).to(x.dtype)


def _setup_backward(ctx, inputs, output):
    x, kernel, block = inputs
    ctx.save_for_backward(x, kernel)
    ctx.block = block


def _backward(ctx, grad):
    """d/dx and d/dkernel of the op's math, in float32 (the drafters train through it):
    dk[.., 0] = Σ_c dy·x, dk[.., 1] = Σ_c dy·x[t−1], dx[t] = k0[t]·dy[t] + k1[t+1]·dy[t+1] with
    the second term absent at each block's last slot."""
    x, kernel = ctx.saved_tensors
    b, t, h = x.shape
    g, block = kernel.shape[2], ctx.block
    shape = (b, t // block, block, g, h // g)
    dy = grad.to(torch.float32).reshape(shape)
    xg = x.to(torch.float32).view(shape)
    prev = F.pad(xg, (0, 0, 0, 0, 1, 0))[:, :, :-1]
    k = kernel.to(torch.float32).view(*shape[:4], 2, 1)
    dk = torch.stack([(dy * xg).sum(-1), (dy * prev).sum(-1)], dim=-1)  # [B, nb, Bs, G, 2]
    later = F.pad((k[..., 1, :] * dy)[:, :, 1:], (0, 0, 0, 0, 0, 1))  # k1[t+1]·dy[t+1], 0 at the end
    dx = k[..., 0, :] * dy + later
    return dx.reshape(b, t, h).to(x.dtype), dk.reshape(b, t, g, 2).to(kernel.dtype), None


dflash2_dynamic_conv.register_autograd(_backward, setup_context=_setup_backward)


def inductor_decompositions() -> dict:
    """{the op: its math} for `ExportedProgram.run_decompositions` before an AOTInductor compile
    (the packages hold the op's arithmetic, fused by inductor, not a call back into Python)."""
    return {torch.ops.metrale.dflash2_dynamic_conv.default: conv_math}


@dflash2_dynamic_conv.register_fake
def _dflash2_dynamic_conv_fake(x: torch.Tensor, kernel: torch.Tensor, block: int) -> torch.Tensor:
    _check(x, kernel, block, check_length=False)
    return torch.empty_like(x)


def _check(x: torch.Tensor, kernel: torch.Tensor, block: int,
           check_length: bool = True) -> tuple[int, int, int, int]:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.dim() != 3:
        raise ValueError(f"{OP_NAME}: x must be bf16/fp16/fp32 [B, T, H], got {x.dtype} "
                         f"{list(x.shape)}")
    b, t, h = x.shape
    if (kernel.dim() != 4 or kernel.shape[:2] != (b, t) or kernel.shape[3] != 2
            or kernel.dtype != x.dtype):
        raise ValueError(f"{OP_NAME}: kernel must be {x.dtype} [{b}, {t}, G, 2] (x's dtype), got "
                         f"{kernel.dtype} {list(kernel.shape)}")
    g = kernel.shape[2]
    if g < 1 or h % g:
        raise ValueError(f"{OP_NAME}: hidden size {h} is not divisible by {g} conv groups")
    if block < 1 or (check_length and t % block):
        raise ValueError(f"{OP_NAME}: block must be >= 1 and divide the {t} slots, got {block}")
    return b, t, h, g


def dflash2_dynamic_conv_triton(x: torch.Tensor, kernel: torch.Tensor, block: int,
                                kernels=None) -> torch.Tensor:
    """The Triton face: same contract as `dflash2_dynamic_conv`; CPU tensors run in the
    interpreter. `kernels`: the kernels' module where the caller holds it (a decode step)."""
    b, t, h, g = _check(x, kernel, block)
    kernels = kernels if kernels is not None else triton_mode.load_kernels(x.device.type)
    x = x.contiguous()
    y = torch.empty_like(x)  # [B, T, H]
    bh = TRITON_BLOCKS["BLOCK_H"]
    kernels.dflash2_dynamic_conv_kernel[(b * t, triton_mode.cdiv(h, bh))](
        x, kernel.contiguous(), y, t, h, g, block, BLOCK_H=bh, num_warps=4,
        enable_fp_fusion=False,
    )
    return y
