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
pair's expert weights anew and keeps one accumulator per loop. Measured single-threaded on
the tiny target's layer (E = 8, H = I = 128, top-2) on an AVX-512 machine, the layer alone
(inductor's code for the same math -> the kernel): 1 row 42 -> 8 us, 16 rows 150 -> 60 us,
32 rows 260 -> 116 us; the whole target package step (4 layers, best of 7, one after the
other): 1 row 104 -> 98 us, 8 rows 497 -> 434 us, 16 rows 1,333 -> 1,124 us, 32 rows 3,185 ->
2,559 us. With AVX2 (an AMD EPYC of the Zen 3 generation) the kernel alone takes about 7, 45
and 100 us for 1, 8 and 32 rows, where `routed_math` in eager torch takes 190 to 260, 800 and
4,000 to 4,500 us.

Float32 experts whose weights are all bfloat16 values (a bfloat16 checkpoint's, widened: the
tiny target's) are held as bfloat16 (`narrowed`) and widened exactly in the kernel's loads, so the
bits are unchanged and a step streams half the bytes; the kernel also fetches each tile's weight
rows 16 rows ahead (they lie 2I or H floats apart). A batched step at 32 rows reads every
expert, more than the L2 holds. Measured with AVX2, 32 rows, 4 layers in turn, per layer: with
the caches warm, 116-199 us float32 against 117-153 us; after a 64 MB sweep, weights from
memory, 365-388 us (float32, no prefetch), 325-333 (float32) and 210-264 (bfloat16). The
tiny target's package at 32 running sequences in serving, median of 4 runs: 2.9 -> 2.25 ms.

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
