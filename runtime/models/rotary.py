"""Rotary position embeddings' cos and sin (rotate-half layout): computed per call, or
gathered from a table shared by every model, layer and step (`rope_table`), as a compiled step
and a GPU step read them (`rope_at`). `layers.apply_rope` applies them."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [T] (int64) -> cos, sin [T, hd] in `dtype` (rotate-half layout)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


_ROPE_TABLES: dict = {}  # (head_dim, theta, dtype, device) -> (cos, sin) [P, hd]
_STEP_KEYS: set = set()  # the keys whose tables `rope_tables` built for GPU steps


def _table_key(head_dim: int, theta: float, dtype: torch.dtype, device) -> tuple:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device
        device = torch.device("cuda", torch.cuda.current_device())
    return head_dim, float(theta), dtype, device


def rope_table(head_dim: int, theta: float, dtype: torch.dtype, device, length: int = 0):
    """cos, sin [P, hd] for positions 0..P−1, P ≥ length: built once per head size, base, dtype
    and device, and grown on demand (every model, layer and step shares it)."""
    key = _table_key(head_dim, theta, dtype, device)
    table = _ROPE_TABLES.get(key)
    if table is None or table[0].shape[0] < length:
        if torch.compiler.is_compiling():
            raise RuntimeError(f"a compiled step reads rotary positions up to {length}; build the "
                               "table before tracing (rotary.rope_table)")
        with torch.inference_mode(False):  # a table made while decoding must serve training too
            table = rope_cos_sin(torch.arange(length, device=device), head_dim, theta, dtype)
        _ROPE_TABLES[key] = table
    return table


def rope_at(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [T, hd] at positions [T]: computed eagerly; in a compiled step (torch.export,
    torch.compile) gathered from the shared table (`rope_table`, which the step builds first),
    a constant of the graph (derived in the graph, inductor computes cos and sin again inside
    the attention's loops, which makes a drafter step several times slower). On a GPU, where
    a step costs its launches, gathered from the table too once one exists (`rope_tables`):
    two gathers instead of a dozen ops, the same bits (each table row is the same arithmetic
    on its position); a position past the table takes its last row, which only a sequence past
    the context the table was built for would reach."""
    if torch.compiler.is_compiling():
        cos, sin = rope_table(head_dim, theta, dtype, positions.device)
        return cos[positions], sin[positions]
    if gathers_rope(positions):
        key = _table_key(head_dim, theta, dtype, positions.device)
        if key in _STEP_KEYS:
            table = _ROPE_TABLES[key]
            rows = positions.clamp(max=table[0].shape[0] - 1)
            return table[0][rows], table[1][rows]
    return rope_cos_sin(positions, head_dim, theta, dtype)


def gathers_rope(positions: torch.Tensor) -> bool:
    """Does `rope_at` gather from a step table for these positions? On a GPU, outside a trace."""
    return positions.is_cuda and not torch._C._is_tracing()


def rope_tables(configs, dtype: torch.dtype, device, margin: int = 1024) -> None:
    """Build the shared rotary table of each decoder config (head size and base) on `device`,
    covering its context and `margin` positions past it (a drafter's block beyond the last
    accepted position, which the serve's context limit keeps within it): what a GPU step
    gathers from (`rope_at`)."""
    for cfg in configs:
        key = _table_key(cfg.head_dim, cfg.rope_theta, dtype, device)
        rope_table(*key, cfg.max_position_embeddings + margin)
        _STEP_KEYS.add(key)
