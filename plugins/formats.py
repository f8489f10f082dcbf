"""The stored weight formats metrale runs, and their pure-PyTorch dequantization.

This module is the one definition of what the bytes of a quantized weight mean; the reference
ops (`fp8_gemm`, `nvfp4_gemm`), the torch backend and the tests all dequantize through it.
It depends on torch only (no ModelOpt), so the runtime can use it.

Formats, in ModelOpt's export names:

- FP8 per row: `weight` float8_e4m3fn [out, in], `weight_scale` float32 [out];
  w[r, c] = float(weight[r, c]) * weight_scale[r].
- NVFP4: `weight` uint8 [out, in/2] holding two 4-bit E2M1 codes per byte, element 2i in the
  low nibble and element 2i+1 in the high nibble; `weight_scale` float8_e4m3fn [out, in/16],
  one scale per 16 consecutive input elements; `weight_scale_2` float32 scalar (the global
  scale); w[r, c] = E2M1[code[r, c]] * (float(weight_scale[r, c // 16]) * weight_scale_2).

Invariant: the NVFP4 dequantize multiplies the two scales first and the E2M1 value last, the
order ModelOpt's own `NVFP4QTensor.dequantize` uses, so both give the same float32 bits.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest E2M1 magnitude
NVFP4_BLOCK = 16  # input elements sharing one FP8 block scale

# `--draft-weight-quantization` tiers, in the flag's order (`builder.quantize` says which
# tensors each copies); `--mtp-quantization` precisions of the MTP head's weights.
DRAFT_TIERS = ("declared", "fp8", "fp8-aux", "nvfp4")
MTP_QUANTIZATIONS = ("bf16", "fp8")

# E2M1 code -> value. Bit 3 is the sign, bits 0-2 index the magnitudes
# {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 is negative zero (a tiny negative weight rounds to it).
E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The E2M1 code -> value table as float32 [16] on `device`."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Split packed FP4 bytes into codes.

    packed: uint8 [..., n/2] -> codes uint8 [..., n], codes[..., 2i] = packed[..., i] & 0xF and
    codes[..., 2i+1] = packed[..., i] >> 4.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 weights must be uint8, got {packed.dtype}")
    low = packed & 0x0F  # [..., n/2]
    high = packed >> 4  # [..., n/2]
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """FP8 per-row weight -> float32 [out, in].

    weight: float8_e4m3fn [out, in]; weight_scale: float32 [out] (one scale per output row).
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(
            f"FP8 weight must be float8_e4m3fn [out, in], got {weight.dtype} {list(weight.shape)}"
        )
    if weight_scale.shape != (weight.shape[0],):
        raise ValueError(
            f"FP8 weight_scale must be [{weight.shape[0]}] (one per row), "
            f"got {list(weight_scale.shape)}"
        )
    return weight.to(torch.float32) * weight_scale.to(torch.float32)[:, None]


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """NVFP4 weight -> float32 [out, in].

    packed: uint8 [out, in/2]; block_scale: float8_e4m3fn [out, in/16];
    global_scale: float32 scalar (shape [] or [1]).
    """
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"NVFP4 weight must be uint8 [out, in/2], got {packed.dtype} {list(packed.shape)}"
        )
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    blocks = in_features // NVFP4_BLOCK
    if in_features % NVFP4_BLOCK or block_scale.shape != (out_features, blocks):
        raise ValueError(
            f"NVFP4 weight_scale must be [{out_features}, in/{NVFP4_BLOCK}] for a weight of "
            f"{in_features} inputs, got {list(block_scale.shape)}"
        )
    if block_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"NVFP4 weight_scale must be float8_e4m3fn, got {block_scale.dtype}")
    if global_scale.numel() != 1:
        raise ValueError(f"NVFP4 weight_scale_2 must be a scalar, got {list(global_scale.shape)}")
    table = e2m1_table(packed.device)  # float32 [16]
    values = table[unpack_fp4(packed).long()]  # float32 [out, in]
    # One float32 scale per block: the FP8 block scale times the global scale.
    scale = block_scale.to(torch.float32) * global_scale.to(torch.float32).reshape(())
    # scale: float32 [out, blocks]
    values = values.view(out_features, blocks, NVFP4_BLOCK) * scale.unsqueeze(-1)
    return values.reshape(out_features, in_features)
