"""`metrale::fp8_w8a16_gemm`: the PyTorch reference of the FP8 per-row W8A16 GEMM.

Math, for x [..., in] (bfloat16 or float32), weight float8_e4m3fn [out, in] and weight_scale
float32 [out]:

    W[r, c] = float32(weight[r, c]) * weight_scale[r]          (exact dequantize, `formats`)
    y[..., r] = sum_c float32(x[..., c]) * W[r, c]              (float32 accumulation)
    returned as y.to(x.dtype)                                   [..., out]

Activations are never quantized (W8A16). This reference is the oracle the Triton kernel, the
ONNX node and the TensorRT plugin of the same op are checked against; it runs on any device
torch runs on. The op is registered with `torch.library.custom_op` (plus a fake kernel for
shape propagation) so exported graphs keep it as one node that a backend can replace.

Other faces: `fp8_w8a16_gemm_triton` launches `triton_kernels.fp8_w8a16_gemm_kernel` (the
interpreter on CPU tensors, a compiled kernel on CUDA ones); the ONNX node is
`metrale::Fp8W8A16Gemm(x, w, scale) -> y` (`onnx_ops`). The kernel applies the row scale to the
float32 accumulator instead of to each weight, so it matches this reference to float32 rounding,
not bit for bit.
"""

from __future__ import annotations

import torch

from metrale.plugins.formats import dequantize_fp8

OP_NAME = "metrale::fp8_w8a16_gemm"
# Tile sizes of the Triton kernel (the same constexprs are compiled ahead of time by `aot`).
TRITON_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}


@torch.library.custom_op(OP_NAME, mutates_args=())
def fp8_w8a16_gemm(
    x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """y = x @ dequant(weight_fp8, weight_scale).T in float32, returned in x's dtype."""
    _check_input(x, weight_fp8)
    w = dequantize_fp8(weight_fp8, weight_scale)  # float32 [out, in]
    y = x.to(torch.float32) @ w.T  # float32 [..., out]
    return y.to(x.dtype)


@fp8_w8a16_gemm.register_fake
def _fp8_w8a16_gemm_fake(
    x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    _check_input(x, weight_fp8)
    return x.new_empty((*x.shape[:-1], weight_fp8.shape[0]))


def _check_input(x: torch.Tensor, weight_fp8: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{OP_NAME}: activations must be bf16/fp16/fp32, got {x.dtype}")
    if weight_fp8.dim() != 2 or x.shape[-1] != weight_fp8.shape[1]:
        raise ValueError(
            f"{OP_NAME}: x has {x.shape[-1]} input features, weight is {list(weight_fp8.shape)}"
        )


def fp8_w8a16_gemm_triton(
    x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """The Triton face: same contract as `fp8_w8a16_gemm`; CPU tensors run in the interpreter."""
    from metrale.plugins.triton_mode import cdiv, load_kernels

    _check_input(x, weight_fp8)
    if weight_fp8.dtype != torch.float8_e4m3fn or weight_scale.shape != (weight_fp8.shape[0],):
        raise ValueError(
            f"{OP_NAME}: weight must be float8_e4m3fn [out, in] with a float32 [out] scale, got "
            f"{weight_fp8.dtype} {list(weight_fp8.shape)} and scale {list(weight_scale.shape)}"
        )
    kernels = load_kernels(x.device.type)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [M, K]
    m, k = x2.shape
    n = weight_fp8.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    b = TRITON_BLOCKS
    grid = (cdiv(m, b["BLOCK_M"]), cdiv(n, b["BLOCK_N"]))
    kernels.fp8_w8a16_gemm_kernel[grid](
        x2, weight_fp8.contiguous().view(torch.uint8), weight_scale.to(torch.float32).contiguous(),
        y, m, n, k, **b, DOT_F32=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=4, enable_fp_fusion=False,
    )
    return y.reshape(*x.shape[:-1], n)
