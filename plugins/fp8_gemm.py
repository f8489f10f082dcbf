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
"""

from __future__ import annotations

import torch

from metrale.plugins.formats import dequantize_fp8

OP_NAME = "metrale::fp8_w8a16_gemm"


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
