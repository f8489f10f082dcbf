"""The layout in which metrale's CPU kernels read a weight matrix (`cpu_tiles.h`): panels of
PANEL columns, each group of columns with its K rows one after another."""

from __future__ import annotations

import torch

PANEL = 16  # columns a panel of a kernel's weight matrix


def pack_panels(b: torch.Tensor) -> torch.Tensor:
    """A weight matrix B [..., K, C] (C a multiple of PANEL) in panels, [..., C/PANEL, K, PANEL]:
    each group of PANEL columns with its K rows one after another, the layout the kernels' tiles
    read (`cpu_tiles.h`)."""
    *lead, k, c = b.shape
    if c % PANEL:
        raise ValueError(f"{c} columns: the kernels take whole panels of {PANEL}")
    return b.reshape(*lead, k, c // PANEL, PANEL).transpose(-3, -2).contiguous()


def unpack_panels(p: torch.Tensor) -> torch.Tensor:
    """`pack_panels`'s inverse: [..., C/PANEL, K, PANEL] -> B [..., K, C]."""
    *lead, groups, k, width = p.shape
    return p.transpose(-3, -2).reshape(*lead, k, groups * width)


def bfloat16_exact(t: torch.Tensor) -> bool:
    """Whether `t` is float32 and every value is a bfloat16 one: held as bfloat16 and widened
    back as the kernels load it, it gives the same bits."""
    return t.dtype == torch.float32 and torch.equal(t.to(torch.bfloat16).float(), t)
