"""`metrale::routed_experts`: a MoE layer's routed experts as one op, with a C++ kernel that the
CPU packages (AOTInductor) call directly.

    y [N, H] = sum_j weights[:, j] * D_e (silu(g) * u),  [g; u] = GU_e x,  e = ids[:, j]

with gate_up [E, H, 2I] (gate columns [0, I), up [I, 2I)) and down [E, I, H], each expert's matrix
held in the kernels' panels of 16 columns (`cpu_panels.pack_panels`: [E, 2I/16, H, 16] and
[E, H/16, I, 16]), so a tile reads its weights from contiguous memory. Eagerly the op is
its math in torch ops (`routed_math`); in a package it is `cpu_moe.cpp`: the (row, slot) pairs
grouped by expert, each expert's weights read once per call for all of its pairs, up to sixteen
vector accumulators to a register tile with AVX-512 (eight pairs x 32 columns down to one pair x
128), up to twelve with AVX2 (six pairs x 16 columns down to one pair x 64), every output one
in-order chain of fused multiply-adds, so a row's bits never depend on the other rows of the
call, the tile's shape or the vector width. Inductor's own code for the same math reads each
pair's expert weights anew and keeps one accumulator per loop.

Float32 experts whose weights are all bfloat16 values (a bfloat16 checkpoint's, widened: the
tiny target's) are held as bfloat16 (`narrowed`) and widened exactly in the kernel's loads, so the
bits are unchanged and a step streams half the bytes; the kernel also fetches each tile's weight
rows 16 rows ahead (they lie 2I or H floats apart). A batched step of many rows reads every
expert, more than the L2 holds, so its weights come from memory: that is where the halved bytes
and the prefetch pay.

The kernel and its C shim, `aoti_torch_cpu_routed_experts`, are compiled with metrale's other
CPU kernels into one library linked into the package (`cpu_kernels`): float32, on x86 CPUs with
AVX-512 or AVX2 and FMA; elsewhere the compiled step keeps inductor's code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.plugins.cpu_panels import bfloat16_exact, unpack_panels

OP_NAME = "metrale::routed_experts"
SHIM = ("AOTITorchError aoti_torch_cpu_routed_experts(AtenTensorHandle x, AtenTensorHandle ids, "
        "AtenTensorHandle weights, AtenTensorHandle gate_up, AtenTensorHandle down, AtenTensorHandle* ret0)")


@torch.library.custom_op(OP_NAME, mutates_args=())
def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """x [N, H], ids/weights [N, k], gate_up [E, 2I/16, H, 16], down [E, H/16, I, 16] (in
    panels) -> y [N, H]."""
    return routed_math(x, ids, weights, gate_up, down)


@routed_experts.register_fake
def _(x, ids, weights, gate_up, down):
    return x.new_empty(x.shape)


def routed_math(x, ids, weights, gate_up, down) -> torch.Tensor:
    """The op in torch ops: each pair's expert on its row, the pairs summed in slot order
    (bfloat16 expert weights widened to x's dtype first, as the kernel does)."""
    gate_up, down = unpack_panels(gate_up).to(x.dtype), unpack_panels(down).to(x.dtype)
    gate, up = torch.einsum("nh,nkhj->nkj", x, gate_up[ids]).chunk(2, dim=-1)  # [N, k, I]
    y = torch.einsum("nki,nkih->nkh", F.silu(gate) * up, down[ids])  # [N, k, H]
    return (y * weights.unsqueeze(-1)).sum(1)


def narrowed(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert weights as the kernel should hold them: as bfloat16 when both are float32 and
    every value is a bfloat16 one (widening them back is then exact: the same bits out), else
    as they are."""
    if bfloat16_exact(gate_up) and bfloat16_exact(down):
        return gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
    return gate_up, down


def fits(intermediate: int, hidden: int) -> bool:
    """Whether the kernel takes experts of these sizes: whole 16-float vectors (so whole vectors
    of either ISA's width, 16 or 8)."""
    return intermediate % 16 == 0 and hidden % 16 == 0
