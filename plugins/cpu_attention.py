"""`metrale::pooled_attention`: the attention of a batched step's rows, each over its own
sequence's cache in a pool, as one op with a C++ kernel that the CPU packages call directly.

    out [T, nh·hd]: row t, head h attends to slots 0..last_visible[t] of sequence seq[t]'s
    K [nkv, hd, S] and V [S, nkv, hd] (KV head h // (nh / nkv)), scaled by hd^-1/2

`metrale::pooled_tree_attention` takes `hide` [T] int64 besides: bit d of hide[t] hides slot
last_visible[t] − 1 − d from row t (a draft tree's verify rows, `step_caches.PooledKV`: a node
sees the slots before the tree's first draft, then its ancestors' only). The kernel takes a row's
visible slots in order as if they were its first ones, so a tree node's row has the bits of the
same node's row in a chain verify of its path.

Eagerly the ops are `pooled_math`, the masked math over all S slots (what the compiled steps run
where the kernel is not available); in a package it is `cpu_attention.cpp`, which reads only the
row's visible slots: inductor's code for the masked math gathers each row's whole sequence of S
slots from the pool and multiplies all of them, so a request whose cache is sized for 128 slots
would pay for 128 at every step from its first token.
A row's bits depend on its query, its sequence's visible slots and their count only — not on
the other rows of the call, the pool's slot count or its sequence count.

Compiled with metrale's other CPU kernels into one library (`cpu_kernels`): float32, x86 CPUs
with AVX-512 or AVX2 and FMA (the same bits with either), head sizes of whole 16-float vectors
(`fits`).
"""

from __future__ import annotations

import torch

OP_NAME = "metrale::pooled_attention"
SHIM = ("AOTITorchError aoti_torch_cpu_pooled_attention(AtenTensorHandle q, AtenTensorHandle k_pool, "
        "AtenTensorHandle v_pool, AtenTensorHandle seq, AtenTensorHandle last_visible, AtenTensorHandle* ret0)")
TREE_SHIM = ("AOTITorchError aoti_torch_cpu_pooled_tree_attention(AtenTensorHandle q, AtenTensorHandle k_pool, "
             "AtenTensorHandle v_pool, AtenTensorHandle seq, AtenTensorHandle last_visible, "
             "AtenTensorHandle hide, AtenTensorHandle* ret0)")
HIDE_BITS = 63  # slots a row's `hide` reaches back: a tree of up to 64 drafts after its root
MAX_HEAD_DIM = 256  # as the kernel's MAX_HD


def visible_slots(s: int, last_visible: torch.Tensor, hide: torch.Tensor | None = None) -> torch.Tensor:
    """[T, S] bool: slot j visible to row t iff j <= last_visible[t] and, with `hide`, bit
    last_visible[t] − 1 − j of hide[t] is clear."""
    j = torch.arange(s, device=last_visible.device)
    visible = j[None, :] <= last_visible[:, None]
    if hide is None:
        return visible
    d = last_visible[:, None] - 1 - j[None, :]
    bit = torch.bitwise_right_shift(hide[:, None], d.clamp(0, HIDE_BITS)) & 1
    return visible & ~((d >= 0) & (d <= HIDE_BITS) & (bit == 1))


def pooled_math(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seq: torch.Tensor,
                last_visible: torch.Tensor, hide: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, nh, hd] (normed, roped); k_pool [B, nkv, hd, S]; v_pool [B, S, nkv, hd]; row t reads
    sequence seq[t], slot j visible iff j <= last_visible[t] -> [T, nh·hd] (head h reads KV head
    h // (nh / nkv)). Written as reductions over one row's data: a row's bits do not depend on
    the call's other rows."""
    t, nh, hd = q.shape
    nkv, s = k_pool.shape[1], k_pool.shape[3]
    g = nh // nkv
    kt = k_pool[seq]  # [T, nkv, hd, S]
    scores = (q.reshape(t, nkv, g, hd, 1) * kt.view(t, nkv, 1, hd, s)).sum(3) * hd ** -0.5  # [T, nkv, g, S]
    visible = visible_slots(s, last_visible, hide)  # [T, S]
    probs = torch.softmax(scores.masked_fill(~visible[:, None, None, :], float("-inf")), dim=-1)
    v = v_pool[seq]  # [T, S, nkv, hd]
    out = (probs.permute(0, 3, 1, 2).unsqueeze(-1) * v.view(t, s, nkv, 1, hd)).sum(1)  # [T, nkv, g, hd]
    return out.reshape(t, nh * hd)


@torch.library.custom_op(OP_NAME, mutates_args=())
def pooled_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seq: torch.Tensor,
                     last_visible: torch.Tensor) -> torch.Tensor:
    """As `pooled_math` (contiguous inputs)."""
    return pooled_math(q, k_pool, v_pool, seq, last_visible)


@pooled_attention.register_fake
def _(q, k_pool, v_pool, seq, last_visible):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("metrale::pooled_tree_attention", mutates_args=())
def pooled_tree_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seq: torch.Tensor,
                          last_visible: torch.Tensor, hide: torch.Tensor) -> torch.Tensor:
    """As `pooled_math` with `hide` (contiguous inputs)."""
    return pooled_math(q, k_pool, v_pool, seq, last_visible, hide)


@pooled_tree_attention.register_fake
def _(q, k_pool, v_pool, seq, last_visible, hide):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def fits(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether the kernel takes attention of these sizes: heads of whole 16-float vectors (up
    to MAX_HEAD_DIM; whole vectors of either ISA's width, 16 or 8), query heads in whole groups
    per KV head."""
    return head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and kv_heads > 0 and heads % kv_heads == 0
