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
"""

from __future__ import annotations

import torch

from metrale.plugins.formats import dequantize_nvfp4

OP_NAME = "metrale::nvfp4_w4a16_gemm"


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
