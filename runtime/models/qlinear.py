"""Linear layers built from stored tensors, dispatching on the stored format.

Contract: `linear_from_tensors(prefix, tensors)` reads `{prefix}.weight` and, when present,
`{prefix}.weight_scale`, `{prefix}.weight_scale_2` and `{prefix}.bias` (ModelOpt's export
names) and returns a module whose forward(x [..., in]) -> [..., out] runs

- `torch.nn.functional.linear` for a plain floating-point weight,
- `metrale::fp8_w8a16_gemm` for an FP8 per-row weight (float8_e4m3fn + float32 scale),
- `metrale::nvfp4_w4a16_gemm` for an NVFP4 weight (packed uint8 + FP8 block scales +
  float32 global scale).

Activations are never quantized. The quantized layers call the reference ops of
`metrale.plugins`, so the torch backend dequantizes exactly as the plugins do. A weight set
that fits none of the formats raises `CheckpointError` naming the prefix and the dtypes.
This module imports the plugins, never the builder.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Literal

import torch
from torch import nn

import metrale.plugins.fp8_gemm  # noqa: F401  (registers torch.ops.metrale.fp8_w8a16_gemm)
import metrale.plugins.nvfp4_gemm  # noqa: F401  (registers torch.ops.metrale.nvfp4_w4a16_gemm)
from metrale.plugins import formats
from metrale.plugins.formats import dequantize_fp8, dequantize_nvfp4
from metrale.runtime.errors import CheckpointError

QuantKind = Literal["none", "fp8", "nvfp4"]
# every tensor a stored linear may hold: the formats' leaves, then the bias
LEAVES = (*dict.fromkeys(leaf for f in formats.FORMATS.values() for leaf in f.leaves), "bias")


def _key(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf


def _describe(prefix: str, tensors: Mapping[str, torch.Tensor]) -> str:
    parts = [f"{key}: {tensors[key].dtype}" for key in consumed_keys(prefix, tensors)]
    if _key(prefix, "weight") not in tensors:
        parts.insert(0, f"missing {_key(prefix, 'weight')}")
    return ", ".join(parts)


def consumed_keys(prefix: str, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys of `tensors` a linear at `prefix` reads (for strict loaders)."""
    return [_key(prefix, leaf) for leaf in LEAVES if _key(prefix, leaf) in tensors]


def quantized_kind(tensors: Mapping[str, torch.Tensor], prefix: str) -> QuantKind:
    """"none", or the name of the format (`formats.FORMATS`: "fp8", "nvfp4") of the weight stored
    at `prefix`, detected by the format table; anything else is refused."""
    try:
        fmt = formats.detect(tensors, prefix)
        return "none" if fmt is None else fmt.name
    except ValueError:
        pass
    raise CheckpointError(
        f"linear {prefix!r}: expected a bf16/fp16/fp32 weight, an FP8 weight (float8_e4m3fn) "
        f"with weight_scale, or an NVFP4 weight (uint8) with weight_scale and weight_scale_2; "
        f"got {_describe(prefix, tensors)}"
    )


class _StoredLinear(nn.Module):
    """Common part: the output features, the optional bias, and the bias add.

    `_FORMAT_BUFFERS` name the tensors whose dtype is the stored format: `Module.to(dtype)`,
    `.half()` and the like move them to another device but never recast them (float8 counts
    as floating point to torch, and a float32 scale cast to bf16 would lose bits).
    """

    kind: QuantKind
    _FORMAT_BUFFERS: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("bias", bias)  # [out] or None

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers[name] for name in self._FORMAT_BUFFERS}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self

    def dense_weight(self) -> torch.Tensor:
        """The float32 [out, in] weight the op computes with, dequantized exactly as it does."""
        raise NotImplementedError

    def pack(self) -> None:
        """Dequantize once for the decode loop: forward then multiplies by the cached float32
        weight, the same arithmetic the op does on every call, so the result is bit-identical."""
        self.register_buffer("dequantized", self.dense_weight(), persistent=False)

    def _run(self, x: torch.Tensor, *op_args: torch.Tensor) -> torch.Tensor:
        cached = self._buffers.get("dequantized")
        if cached is None:
            return self._add_bias(self.op(x, *op_args))
        return self._add_bias((x.to(torch.float32) @ cached.T).to(x.dtype))

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class DenseLinear(_StoredLinear):
    """A plain floating-point weight [out, in]."""

    kind: QuantKind = "none"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)  # [out, in]

    def dense_weight(self) -> torch.Tensor:
        return self.weight

    def pack(self) -> None:  # nothing to dequantize
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, weight, bias)


class Fp8Linear(_StoredLinear):
    """An FP8 per-row weight, run by `metrale::fp8_w8a16_gemm`."""

    kind: QuantKind = "fp8"
    op = torch.ops.metrale.fp8_w8a16_gemm
    _FORMAT_BUFFERS = formats.FORMATS["fp8"].leaves

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)  # float8_e4m3fn [out, in]
        self.register_buffer("weight_scale", weight_scale)  # float32 [out]

    @classmethod
    def from_tensors(cls, prefix: str, tensors: Mapping[str, torch.Tensor], bias) -> "Fp8Linear":
        weight, scale = tensors[_key(prefix, "weight")], tensors[_key(prefix, "weight_scale")]
        out_features = weight.shape[0]
        # A per-tensor scale (scalar, as ModelOpt's per-tensor FP8 exports store it) is the
        # per-row scale repeated; [out, 1] is the per-row scale before ModelOpt squeezes it.
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(out_features)
        if scale.numel() != out_features:
            raise CheckpointError(
                f"linear {prefix!r}: FP8 weight_scale must hold 1 or {out_features} values, "
                f"got {list(scale.shape)}"
            )
        return cls(weight, scale.reshape(out_features).float().contiguous(), bias)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self._run(x, self.weight, self.weight_scale)


class Nvfp4Linear(_StoredLinear):
    """An NVFP4 weight, run by `metrale::nvfp4_w4a16_gemm`."""

    kind: QuantKind = "nvfp4"
    op = torch.ops.metrale.nvfp4_w4a16_gemm
    _FORMAT_BUFFERS = formats.FORMATS["nvfp4"].leaves

    def __init__(
        self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
        bias: torch.Tensor | None,
    ):
        super().__init__(weight.shape[1] * 2, weight.shape[0], bias)
        self.register_buffer("weight", weight)  # uint8 [out, in/2]
        self.register_buffer("weight_scale", weight_scale)  # float8_e4m3fn [out, in/16]
        self.register_buffer("weight_scale_2", weight_scale_2)  # float32 []

    @classmethod
    def from_tensors(cls, prefix: str, tensors: Mapping[str, torch.Tensor], bias) -> "Nvfp4Linear":
        weight, scale = tensors[_key(prefix, "weight")], tensors[_key(prefix, "weight_scale")]
        out_features = weight.shape[0]
        in_features = weight.shape[1] * 2
        if scale.dtype != torch.float8_e4m3fn or scale.shape != (out_features, in_features // 16):
            raise CheckpointError(
                f"linear {prefix!r}: NVFP4 weight_scale must be float8_e4m3fn "
                f"[{out_features}, {in_features // 16}], got {scale.dtype} {list(scale.shape)}"
            )
        scale_2 = tensors[_key(prefix, "weight_scale_2")]
        if scale_2.numel() != 1:
            raise CheckpointError(
                f"linear {prefix!r}: NVFP4 weight_scale_2 must be a scalar, got {list(scale_2.shape)}"
            )
        return cls(weight, scale, scale_2.reshape(()).float(), bias)

    def dense_weight(self) -> torch.Tensor:
        return dequantize_nvfp4(self.weight, self.weight_scale, self.weight_scale_2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self._run(x, self.weight, self.weight_scale, self.weight_scale_2)


def linear_from_tensors(prefix: str, tensors: Mapping[str, torch.Tensor]) -> _StoredLinear:
    """The linear stored at `prefix` in `tensors` (full names, e.g. `layers.0.mlp.up_proj`)."""
    kind = quantized_kind(tensors, prefix)
    weight = tensors[_key(prefix, "weight")]
    if weight.dim() != 2:
        raise CheckpointError(
            f"linear {prefix!r}: weight must be 2-D [out, in], got {list(weight.shape)}"
        )
    out_features = weight.shape[0]
    bias = tensors.get(_key(prefix, "bias"))
    if bias is not None and bias.shape != (out_features,):
        raise CheckpointError(
            f"linear {prefix!r}: bias must be [{out_features}], got {list(bias.shape)}"
        )
    if kind == "none":
        return DenseLinear(weight, bias)
    module, _, name = formats.FORMATS[kind].linear.partition(":")
    return getattr(importlib.import_module(module), name).from_tensors(prefix, tensors, bias)


# the format table names these linears: one per format, under its own name
assert {(f.name, f.linear) for f in formats.FORMATS.values()} == {
    (c.kind, f"{__name__}:{c.__name__}") for c in (Fp8Linear, Nvfp4Linear)}
