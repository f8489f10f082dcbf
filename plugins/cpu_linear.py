"""`metrale::linear_rows`: a projection of a compiled step's rows, y [N, C] = x [N, K] · B [K, C],
with a C++ kernel that the CPU packages (AOTInductor) call directly: the LM heads, the fused
q/k/v and gate/up projections, the attention outputs and MLP down projections, the MTP head's
and the drafters' context projections and DFlash2's conv and selector projections of the
target, MTP and drafter steps (`KernelLinear`, swapped in by the build:
`cpu_build.uses_linear_kernel`).

B is held in panels of 16 columns, [C/16, K, 16] (`cpu_panels.pack_panels`), float32 or, when
every value is a bfloat16 one (a bfloat16 checkpoint's, widened: the tiny target's), bfloat16,
widened exactly as the kernel loads it (`held`). Eagerly the op is its math in torch ops
(`linear_math`); in a package it is `cpu_linear.cpp`: register tiles of up to six rows by 16
columns with AVX2 (eight by 32 with AVX-512, `cpu_tiles.h`), every output one in-order chain of
fused multiply-adds over k, so a row's bits never depend on the other rows of the call.

Inductor's GEMM template, which the target's projections use otherwise, gives the same
row-invariance but reads B row-major, so a call takes longer there than in this kernel's panels;
torch's `linear` is quicker than the template, but its rows' bits depend on the row count, so a
batched step cannot use it. A drafter's step, which could (it only moves drafts), runs faster
through this kernel too: at its few rows and small widths the library's calls cost more than
their multiply-adds.
"""

from __future__ import annotations

import torch

from metrale.plugins.cpu_panels import PANEL, bfloat16_exact, pack_panels, unpack_panels

OP_NAME = "metrale::linear_rows"
SHIM = ("AOTITorchError aoti_torch_cpu_linear_rows(AtenTensorHandle x, AtenTensorHandle weight, "
        "AtenTensorHandle* ret0)")


@torch.library.custom_op(OP_NAME, mutates_args=())
def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, K], weight [C/16, K, 16] (B [K, C] in panels) -> y [N, C]."""
    return linear_math(x, weight)


@linear_rows.register_fake
def _(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0] * weight.shape[2])


def linear_math(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The op in torch ops (bfloat16 weights widened to x's dtype first, as the kernel does)."""
    return x @ unpack_panels(weight).to(x.dtype)


def held(linear_weight: torch.Tensor) -> torch.Tensor:
    """An `nn.Linear` weight [C, K] as the kernel takes it: its transpose B [K, C] in panels,
    as bfloat16 when it is float32 and every value is a bfloat16 one (widening is then exact:
    the same bits out), else as it is."""
    b = linear_weight.detach().t()
    if bfloat16_exact(b):
        b = b.to(torch.bfloat16)
    return pack_panels(b)


def fits(in_features: int, out_features: int) -> bool:
    """Whether the kernel takes a projection of these sizes: whole panels of output columns."""
    return out_features % PANEL == 0 and in_features >= 1


class KernelLinear(torch.nn.Module):
    """A bias-free projection computed by the kernel: y = x · weightᵀ for `weight` [C, K] (an
    `nn.Linear`'s, or a fused one), held as `held` gives it (a buffer: the compiled step's
    constant). Rows of any leading shape. With `pad`, C need not be whole panels: the weight
    gets rows of zeros up to the next panel, and their columns are dropped from the output
    (each column is its own chain, so the others' bits do not change): a MoE router's few
    columns."""

    def __init__(self, weight: torch.Tensor, pad: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        extra = -self.out_features % PANEL if pad else 0
        if extra:
            weight = torch.cat([weight.detach(), weight.new_zeros(extra, self.in_features)])
        self.register_buffer("panels", held(weight), persistent=False)

    @classmethod
    def of(cls, linear: torch.nn.Linear, pad: bool = False) -> "KernelLinear":
        if linear.bias is not None:
            raise ValueError("the kernel computes projections without a bias")
        return cls(linear.weight, pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.metrale.linear_rows(rows, self.panels)
        if y.shape[1] != self.out_features:  # padded: the zero rows' columns dropped
            y = y[:, :self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)
