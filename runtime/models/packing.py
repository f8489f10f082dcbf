"""How the decode loop packs a model's weights (`layers.pack_for_inference`): projections fused into
one matrix whose rows the unpacked linears keep as views, and routed experts stacked. A pack is
done once: a captured CUDA graph replays the addresses its weights had at capture.
"""

from __future__ import annotations

import torch
from torch import nn


def share_storage(linears, fused: torch.Tensor) -> None:
    """Point each linear's weight at its rows of `fused` (their concatenation, in order), so a
    packed model holds one copy of the weights and its unpacked modules still compute."""
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start:start + rows]
        start += rows


def fused_already(linears, fused: torch.Tensor | None) -> bool:
    """Are the linears' weights views of `fused` (a `pack` done)? Packing again would allocate a
    new fused copy, and anything that holds the old one's address (a captured CUDA graph) would
    read freed memory."""
    if fused is None:
        return False
    ptr = fused.untyped_storage().data_ptr()
    return all(type(lin) is nn.Linear and lin.weight.untyped_storage().data_ptr() == ptr for lin in linears)


def stack_nvfp4_experts(experts) -> tuple[torch.Tensor, ...] | None:
    """The routed experts' NVFP4 tensors stacked as `metrale::nvfp4_moe_w4a16` reads them
    (gate_up packed [E, 2I, H/2], block scales [E, 2I, H/16], global scales [E, 2] (gate's,
    up's), down packed [E, H, I/2], block scales [E, H, I/16], global scales [E]), or None
    unless every expert's three linears are NVFP4 (`qlinear.Nvfp4Linear`)."""
    lins = [(e.gate_proj, e.up_proj, e.down_proj) for e in experts]
    if not lins or any(getattr(lin, "kind", None) != "nvfp4" for trio in lins for lin in trio):
        return None
    cat = lambda name: torch.stack([torch.cat([getattr(g, name), getattr(u, name)])  # noqa: E731
                                    for g, u, _ in lins])
    down = lambda name: torch.stack([getattr(d, name) for _, _, d in lins])  # noqa: E731
    globals_ = torch.stack([torch.stack([g.weight_scale_2, u.weight_scale_2]) for g, u, _ in lins])
    return (cat("weight"), cat("weight_scale"), globals_.float(),
            down("weight"), down("weight_scale"), down("weight_scale_2").float())
