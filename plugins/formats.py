"""The stored weight formats metrale runs, and their pure-PyTorch dequantization.

This module is the one definition of what the bytes of a quantized weight mean; the reference
ops (`fp8_gemm`, `nvfp4_gemm`), the torch backend and the tests all dequantize through it. Its
table (`FORMATS`, `DRAFT_TIER_FORMATS`) is the one place a format's facts live: its stored
tensors and their detection, its runtime linear, its ONNX node, where TensorRT runs it natively,
its byte size and its tensor-parallel cut unit; the tiers are data over it.
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

from dataclasses import dataclass
from typing import Callable

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest E2M1 magnitude
NVFP4_BLOCK = 16  # input elements sharing one FP8 block scale

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


# -- the format table ------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    """One stored weight format: everything metrale does with it is read from here.

    `leaves`: the tensors a linear stores besides an optional bias, in ModelOpt's export names,
    the stored weight first (`weight_dtype` is its dtype: with the leaves, how a stored linear is
    detected). `quant_algo`: the name in a quantization section (`hf_quant_config.json`).
    `linear`: the runtime module that runs it ("module:Class", `runtime.models.qlinear`).
    `onnx_op`: its metrale ONNX node (`plugins.onnx_lowering`). `native_sm`: the first SM whose
    TensorRT computes it natively (below, the node stays a plugin layer). `col_unit`: the input
    columns a tensor-parallel cut must fall between multiples of (its scale block).
    `stored_bytes(out, in)`: the bytes of one [out, in] weight with its scales. `section`: what
    its quantization section records besides the algorithm (ModelOpt's hf_quant_config keys)."""

    name: str
    quant_algo: str
    leaves: tuple[str, ...]
    weight_dtype: torch.dtype
    linear: str
    onnx_op: str
    native_sm: int
    col_unit: int
    stored_bytes: Callable[[int, int], int]
    dequantize: Callable[..., torch.Tensor]
    section: tuple[tuple[str, object], ...] = ()

    def native(self, sm: int) -> bool:
        return sm >= self.native_sm


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("fp8", "FP8", ("weight", "weight_scale"), torch.float8_e4m3fn,
           "metrale.runtime.models.qlinear:Fp8Linear", "Fp8W8A16Gemm", 89, 1,
           lambda out, inp: out * inp + 4 * out, dequantize_fp8, (("per_channel", True),)),
    Format("nvfp4", "NVFP4", ("weight", "weight_scale", "weight_scale_2"), torch.uint8,
           "metrale.runtime.models.qlinear:Nvfp4Linear", "NvFp4W4A16Gemm", 100, NVFP4_BLOCK,
           lambda out, inp: out * inp // 2 + out * inp // NVFP4_BLOCK + 4, dequantize_nvfp4,
           (("group_size", NVFP4_BLOCK), ("per_channel", False))),
)}

# `--draft-weight-quantization` tiers, in the flag's order: the format each stores its drafter's
# quantized linears in (`builder.quantize` says which linears each quantizes); None keeps the
# declared weights.
DRAFT_TIER_FORMATS: dict[str, str | None] = {"declared": None, "fp8": "fp8", "fp8-aux": "fp8",
                                             "nvfp4": "nvfp4"}
DRAFT_TIERS = tuple(DRAFT_TIER_FORMATS)
# `--mtp-quantization` precisions of the MTP head's weights (bf16: declared; fp8: every linear)
MTP_QUANTIZATIONS = ("bf16", "fp8")
assert all(f is None or f in FORMATS for f in DRAFT_TIER_FORMATS.values())


def format_named(name: str | None) -> Format | None:
    if name is None:
        return None
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})") from None


def format_of_algo(algo: str | None) -> Format | None:
    """The format a quantization section's `quant_algo` names (None: unquantized); an unknown
    one raises StopIteration."""
    if algo is None:
        return None
    return next(f for f in FORMATS.values() if f.quant_algo == algo)


def detect(tensors, prefix: str) -> Format | None:
    """The format of the linear stored at `prefix` (full names), None for a float weight with
    no scales; ValueError for anything else."""
    def key(leaf):
        return f"{prefix}.{leaf}" if prefix else leaf

    def has(leaf):
        return key(leaf) in tensors
    weight = tensors.get(key("weight"))
    scales = {leaf for f in FORMATS.values() for leaf in f.leaves[1:] if has(leaf)}
    if weight is not None and weight.dtype in (torch.bfloat16, torch.float16, torch.float32) and not scales:
        return None
    for f in FORMATS.values():
        if weight is not None and weight.dtype == f.weight_dtype and scales == set(f.leaves[1:]):
            return f
    raise ValueError("no stored format matches")
