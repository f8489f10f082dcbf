"""The ONNX face of the metrale custom ops: node builders and reference implementations.

Every op is a node in the `metrale` domain, opset version 1 (`opset_import()`); a TensorRT
plugin of the same name and domain implements it in an engine. The contract, inputs then
outputs (shapes as in each op's module; "act" is float, float16 or bfloat16, one per node):

    Fp8W8A16Gemm(x act [M, K], w FLOAT8E4M3FN [N, K], scale float [N]) -> y act [M, N]
    NvFp4W4A16Gemm(x act [M, K], packed uint8 [N, K/2], block_scale FLOAT8E4M3FN [N, K/16],
                   global_scale float []) -> y act [M, N]
    NvFp4MoeW4A16(x act [T, H], expert_ids int64 [T, k], weights act [T, k],
                  gate_up_packed uint8 [E, 2I, H/2], gate_up_scale FLOAT8E4M3FN [E, 2I, H/16],
                  gate_up_global float [E], down_packed uint8 [E, H, I/2],
                  down_scale FLOAT8E4M3FN [E, H, I/16], down_global float [E]) -> y act [T, H]
    DFlash2DynamicConv(x act [B, T, H], kernel act [B, T, G, 2]; attribute block: int)
                  -> y act [B, T, H]
    AllReduce(x act [...]; attributes group_size, rank: int) -> y act [...] (sum over the group)
    AllGather(x [...]; attributes group_size, rank: int) -> y [group_size, ...] (rank order,
                  on a new leading rank axis)

The collectives' OpRuns call `torch.distributed` (the caller's process group, e.g. gloo on CPU;
its world is the tensor-parallel group and must match the node's group_size and rank).

The `OpRun` classes below compute each node with the op's PyTorch reference (the oracle), so a
graph holding these nodes is checked on CPU with
`onnx.reference.ReferenceEvaluator(model, new_ops=REFERENCE_OPS)`. bfloat16 and FP8 arrays
(ml_dtypes in numpy) cross to torch bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import helper
from onnx.reference.op_run import OpRun

from metrale.plugins.dynamic_conv import dflash2_dynamic_conv
from metrale.plugins.fp8_gemm import fp8_w8a16_gemm
from metrale.plugins.nvfp4_gemm import nvfp4_w4a16_gemm
from metrale.plugins.nvfp4_moe import nvfp4_moe_w4a16

DOMAIN = "metrale"
OPSET_VERSION = 1

# numpy dtypes with no torch counterpart of the same name, crossed through an integer view.
_BITCAST = {
    np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn),
}
_TO_NUMPY = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
             torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn)}


def opset_import() -> onnx.OperatorSetIdProto:
    """The opset import a model holding metrale nodes must declare."""
    return helper.make_opsetid(DOMAIN, OPSET_VERSION)


def to_torch(a: np.ndarray) -> torch.Tensor:
    """numpy (ml_dtypes bfloat16/float8_e4m3fn included) -> CPU torch tensor, same bits."""
    a = np.ascontiguousarray(a)
    if a.dtype in _BITCAST:
        view, dtype = _BITCAST[a.dtype]
        return torch.from_numpy(a.view(view).copy()).view(dtype)
    return torch.from_numpy(a.copy())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """CPU torch tensor -> numpy (bfloat16/float8_e4m3fn as ml_dtypes), same bits."""
    t = t.detach().contiguous()
    if t.dtype in _TO_NUMPY:
        view, dtype = _TO_NUMPY[t.dtype]
        return t.view(view).numpy().view(dtype)
    return t.numpy()


# -- node builders ------------------------------------------------------------------------------

def fp8_w8a16_gemm_node(x: str, w: str, scale: str, y: str, name: str | None = None):
    return helper.make_node("Fp8W8A16Gemm", [x, w, scale], [y], name=name, domain=DOMAIN)


def nvfp4_w4a16_gemm_node(x: str, packed: str, block_scale: str, global_scale: str, y: str,
                          name: str | None = None):
    return helper.make_node("NvFp4W4A16Gemm", [x, packed, block_scale, global_scale], [y],
                            name=name, domain=DOMAIN)


def nvfp4_moe_w4a16_node(x: str, expert_ids: str, weights: str, gate_up_packed: str,
                         gate_up_scale: str, gate_up_global: str, down_packed: str,
                         down_scale: str, down_global: str, y: str, name: str | None = None):
    inputs = [x, expert_ids, weights, gate_up_packed, gate_up_scale, gate_up_global,
              down_packed, down_scale, down_global]
    return helper.make_node("NvFp4MoeW4A16", inputs, [y], name=name, domain=DOMAIN)


def dflash2_dynamic_conv_node(x: str, kernel: str, y: str, block: int, name: str | None = None):
    return helper.make_node("DFlash2DynamicConv", [x, kernel], [y], name=name, domain=DOMAIN,
                            block=int(block))



# -- reference implementations ------------------------------------------------------------------

class Fp8W8A16Gemm(OpRun):
    op_domain = DOMAIN

    def _run(self, x, w, scale):
        return (to_numpy(fp8_w8a16_gemm(to_torch(x), to_torch(w), to_torch(scale))),)


class NvFp4W4A16Gemm(OpRun):
    op_domain = DOMAIN

    def _run(self, x, packed, block_scale, global_scale):
        y = nvfp4_w4a16_gemm(to_torch(x), to_torch(packed), to_torch(block_scale),
                             to_torch(global_scale))
        return (to_numpy(y),)


class NvFp4MoeW4A16(OpRun):
    op_domain = DOMAIN

    def _run(self, *inputs):
        return (to_numpy(nvfp4_moe_w4a16(*[to_torch(a) for a in inputs])),)


class DFlash2DynamicConv(OpRun):
    op_domain = DOMAIN

    def _run(self, x, kernel, block=None):
        block = self.block if block is None else block
        return (to_numpy(dflash2_dynamic_conv(to_torch(x), to_torch(kernel), int(block))),)



def _check_group(op: str, group_size, rank) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"{op}: no torch.distributed process group (one rank's graph runs "
                           "together with the other ranks' graphs)")
    have = (dist.get_world_size(), dist.get_rank())
    if have != (int(group_size), int(rank)):
        raise RuntimeError(f"{op}: the node is rank {rank} of {group_size}, the process group "
                           f"is rank {have[1]} of {have[0]}")


def _collective_input(node, op, x, group_size, rank):
    """The node's attributes (or the evaluator's overrides), checked against the process group;
    -> (x as a torch tensor, group size)."""
    group_size = node.group_size if group_size is None else group_size
    rank = node.rank if rank is None else rank
    _check_group(op, group_size, rank)
    return to_torch(x), group_size


class AllReduce(OpRun):
    op_domain = DOMAIN

    def _run(self, x, group_size=None, rank=None):
        import torch.distributed as dist

        t, _ = _collective_input(self, "AllReduce", x, group_size, rank)
        dist.all_reduce(t)
        return (to_numpy(t),)


class AllGather(OpRun):
    op_domain = DOMAIN

    def _run(self, x, group_size=None, rank=None):
        import torch.distributed as dist

        t, group_size = _collective_input(self, "AllGather", x, group_size, rank)
        every = [torch.empty_like(t) for _ in range(int(group_size))]
        dist.all_gather(every, t)
        return (to_numpy(torch.stack(every)),)


REFERENCE_OPS = [Fp8W8A16Gemm, NvFp4W4A16Gemm, NvFp4MoeW4A16, DFlash2DynamicConv,
                 AllReduce, AllGather]
