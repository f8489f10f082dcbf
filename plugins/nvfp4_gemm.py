"""`metrale::nvfp4_w4a16_gemm`: the PyTorch reference of the NVFP4 W4A16 GEMM.

Math, for x [..., in] (bfloat16 or float32), packed uint8 [out, in/2] (element 2i in the low
nibble), block_scale float8_e4m3fn [out, in/16] and global_scale float32 scalar:

    S[r, b]   = float32(block_scale[r, b]) * global_scale       (one scale per 16 inputs)
    W[r, c]   = E2M1[code[r, c]] * S[r, c // 16]                (exact dequantize, `formats`)
    y[..., r] = sum_c float32(x[..., c]) * W[r, c]              (float32 accumulation)
    returned as y.to(x.dtype)                                   [..., out]

Activations stay in their own precision (W4A16). This reference is the oracle the Triton
kernel, the ONNX node and the TensorRT plugin of the same op are checked against. Registered
with `torch.library.custom_op` plus a fake kernel so exported graphs keep it as one node.

Other faces: `nvfp4_w4a16_gemm_triton` launches `triton_kernels.nvfp4_w4a16_gemm_kernel` (the
interpreter on CPU tensors, a compiled kernel on CUDA ones); the ONNX node is
`metrale::NvFp4W4A16Gemm(x, packed, block_scale, global_scale) -> y` (`onnx_ops`). The kernel
multiplies E2M1 by the FP8 block scale in the weight (exact in bf16/fp16) and the global scale
into the float32 accumulator, so it matches this reference to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from metrale.plugins.formats import NVFP4_BLOCK, dequantize_nvfp4

OP_NAME = "metrale::nvfp4_w4a16_gemm"
# Tile sizes of the Triton kernel (the same constexprs are compiled ahead of time by `aot`);
# BLOCK_K is a multiple of the 16-element NVFP4 block.
TRITON_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}


@torch.library.custom_op(OP_NAME, mutates_args=())
def nvfp4_w4a16_gemm(
    x: torch.Tensor, packed_u8: torch.Tensor, block_scale_fp8: torch.Tensor,
    global_scale: torch.Tensor,
) -> torch.Tensor:
    """y = x @ dequant(packed_u8, block_scale_fp8, global_scale).T in float32, in x's dtype."""
    _check_input(x, packed_u8)
    w = dequantize_nvfp4(packed_u8, block_scale_fp8, global_scale)  # float32 [out, in]
    y = x.to(torch.float32) @ w.T  # float32 [..., out]
    return y.to(x.dtype)


@nvfp4_w4a16_gemm.register_fake
def _nvfp4_w4a16_gemm_fake(
    x: torch.Tensor, packed_u8: torch.Tensor, block_scale_fp8: torch.Tensor,
    global_scale: torch.Tensor,
) -> torch.Tensor:
    _check_input(x, packed_u8)
    return x.new_empty((*x.shape[:-1], packed_u8.shape[0]))


def _check_input(x: torch.Tensor, packed_u8: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{OP_NAME}: activations must be bf16/fp16/fp32, got {x.dtype}")
    if packed_u8.dim() != 2 or x.shape[-1] != 2 * packed_u8.shape[1]:
        raise ValueError(
            f"{OP_NAME}: x has {x.shape[-1]} input features, packed weight is "
            f"{list(packed_u8.shape)} (two inputs per byte)"
        )


def nvfp4_w4a16_gemm_triton(
    x: torch.Tensor, packed_u8: torch.Tensor, block_scale_fp8: torch.Tensor,
    global_scale: torch.Tensor,
) -> torch.Tensor:
    """The Triton face: same contract as `nvfp4_w4a16_gemm`; CPU tensors run in the interpreter."""
    from metrale.plugins.triton_mode import cdiv, load_kernels

    _check_input(x, packed_u8)
    n, k = packed_u8.shape[0], 2 * packed_u8.shape[1]
    if (packed_u8.dtype != torch.uint8 or k % NVFP4_BLOCK
            or block_scale_fp8.dtype != torch.float8_e4m3fn
            or block_scale_fp8.shape != (n, k // NVFP4_BLOCK) or global_scale.numel() != 1):
        raise ValueError(
            f"{OP_NAME}: expected packed uint8 [out, in/2], block_scale float8_e4m3fn "
            f"[out, in/16] and a scalar global scale, got {packed_u8.dtype} "
            f"{list(packed_u8.shape)}, {block_scale_fp8.dtype} {list(block_scale_fp8.shape)}, "
            f"{list(global_scale.shape)}"
        )
    kernels = load_kernels(x.device.type)
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    b = TRITON_BLOCKS
    grid = (cdiv(m, b["BLOCK_M"]), cdiv(n, b["BLOCK_N"]))
    kernels.nvfp4_w4a16_gemm_kernel[grid](
        x2, packed_u8.contiguous(), block_scale_fp8.contiguous().view(torch.uint8),
        global_scale.to(torch.float32).reshape(1).contiguous(), y, m, n, k,
        **b, DOT_F32=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=4, enable_fp_fusion=False,
    )
    return y.reshape(*x.shape[:-1], n)
