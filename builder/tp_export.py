"""Per-rank ONNX graphs of a tensor-parallel DFlash drafter (`<drafter>/rank{r}.onnx`).

A drafter built with `--draft-tp-size N` is exported once per rank r: the rank's sharded module,
built exactly as `runtime.artifact.engine.load_models(..., tp=TensorParallel(r, N))` builds it
(its KV heads, intermediate slice and vocab slice, filled from `rank{r}.safetensors`), traced
through the one-rank propose adapter (`onnx_export.DFlashPropose`) with the drafter's collectives as
`metrale`-domain nodes (opset `metrale` 1; attributes `group_size` = N and `rank` = r):

    AllReduce(x act [...]) -> y act [...]          the sum of x over the N ranks
    AllGather(x act [...]) -> y act [N, ...]       every rank's x stacked on a NEW LEADING rank
                                                   axis, rank order (NCCL's all-gather layout)

They come from swapping the drafter's (and its layers') `tp` for `ExportCollectives` while
tracing; the runtime modules are unchanged. Per propose graph: one AllReduce after each layer's
o_proj and one after its down_proj (2 per layer), and one AllGather of the rank's top candidates.

Graph I/O: the one-rank propose graph's (see `onnx_export`) with the rank's shapes — past/new K/V
hold the rank's nkv/N heads, `logits` [1, G, V_r] is the rank's vocab slice (global ids
vocab_start..), `hidden` and DFlash2's `selector_query` are whole (replicated) — plus
- `top_values` f32 [1, G, K], `top_ids` int64 [1, G, K]: the global top K = max(16,
  num_candidates) candidates of every slot, sorted by value, ties to the lower rank (the
  runtime's `TensorParallel.top_candidates`; the runtime uses slots 1.., the draft slots);
- `log_normalizer` f32 [1, G]: every slot's logsumexp over the whole vocabulary, which turns
  the values into log-probabilities: a draft tree's nodes at each depth are drawn from them, so
  a node has at most K children (a tree of up to K nodes is the one-rank drafter's);
- `rank_positions` int64 [N]: every rank's `position` input, gathered in the same message: the
  lockstep check (ranks whose values differ decoded different sequences and must be refused).
The AllGather message per rank is f32 [1, G, 2K+2]: K values, K global ids (exact in f32 below
2^24, which `check_drafter_split` guarantees), the logsumexp of the rank's slice and the position.

Invariant: the graphs of ranks 0..N-1 run together (each with its own collectives) compute the
one-rank drafter's outputs up to the all-reduce's summation order, and the same candidates.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from torch import nn

from metrale.builder import onnx_export as ox
from metrale.plugins import onnx_lowering as lw
from metrale.runtime.models.dflash import DFlashDrafter
from metrale.runtime.models.tp import TOP_CANDIDATES, TensorParallel

ALL_REDUCE, ALL_GATHER = "AllReduce", "AllGather"
COLLECTIVE_OPS = (ALL_REDUCE, ALL_GATHER)
TP_OUTPUTS = ("top_values", "top_ids", "log_normalizer", "rank_positions")


# -- the collectives as metrale nodes ----------------------------------------------------------


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_size: int, rank: int):
        # Only ever run by the tracer: the value is this rank's share; the node computes the sum.
        return x.clone()

    @staticmethod
    def symbolic(g, x, group_size: int, rank: int):
        out = g.op(f"{lw.DOMAIN}::{ALL_REDUCE}", x, group_size_i=group_size, rank_i=rank)
        out.setType(x.type())
        return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_size: int, rank: int):  # x [...] -> [N, ...] (trace-time copies)
        return x.unsqueeze(0).expand(group_size, *x.shape).clone()

    @staticmethod
    def symbolic(g, x, group_size: int, rank: int):
        from torch.onnx import symbolic_helper

        out = g.op(f"{lw.DOMAIN}::{ALL_GATHER}", x, group_size_i=group_size, rank_i=rank)
        sizes = symbolic_helper._get_tensor_sizes(x)
        out.setType(x.type() if sizes is None else x.type().with_sizes([group_size, *sizes]))
        return out


@dataclass(frozen=True)
class ExportCollectives:
    """Stands in for a `TensorParallel` while tracing: its collectives become metrale nodes."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduce.apply(x, self.size, self.rank)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return _AllGather.apply(x, self.size, self.rank)

    def gathered_candidates(self, logits: torch.Tensor, vocab_start: int, k: int,
                            position: torch.Tensor):
        """logits [1, G, V_r] of the rank's slice, position int64 [1] -> (values f32 [1, G, k],
        global ids int64 [1, G, k], the whole vocabulary's logsumexp f32 [1, G], every rank's
        position int64 [N]) from one AllGather."""
        logits = logits.float()
        kr = min(k, logits.shape[-1])
        vals, ids = logits.topk(kr, dim=-1)  # [1, G, kr]
        ids = (ids + vocab_start).float()
        if kr < k:  # a slice smaller than k: pad with candidates that never win
            pad = list(vals.shape[:-1]) + [k - kr]
            vals = torch.cat([vals, vals.new_full(pad, float("-inf"))], dim=-1)
            ids = torch.cat([ids, ids.new_zeros(pad)], dim=-1)
        lse = log_sum_exp(logits, vals[..., :1])  # [1, G, 1]
        pos = position.float().reshape(1, 1, 1).expand(vals.shape[0], vals.shape[1], 1)
        every = self.all_gather(torch.cat([vals, ids, lse, pos], dim=-1))  # [N, 1, G, 2k+2]
        # rank-major along the last axis: TopK's lower-index tie-break is ties to the lower rank
        all_vals = every[..., :k].permute(1, 2, 0, 3).flatten(2)  # [1, G, N·k]
        all_ids = every[..., k:2 * k].permute(1, 2, 0, 3).flatten(2)
        # axis 2, not -1: onnx.reference's GatherElements mishandles a negative axis
        top, order = all_vals.topk(k, dim=2)
        ranks_lse = every[..., 2 * k:2 * k + 1].permute(1, 2, 3, 0).flatten(2)  # [1, G, N]
        total = log_sum_exp(ranks_lse, top[..., :1]).squeeze(2)  # the best value is the max
        return top, all_ids.gather(2, order).long(), total, every[:, 0, 0, 2 * k + 1].long()


def log_sum_exp(x: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """logsumexp of x [..., n] over its last axis, given its maximum `peak` [..., 1]: from
    elementwise ops and a ReduceSum, which every graph runtime here lowers alike."""
    return peak + (x - peak).exp().sum(-1, keepdim=True).log()


def _tp_holders(drafter: nn.Module) -> list[nn.Module]:
    return [m for m in drafter.modules() if isinstance(getattr(m, "tp", None), TensorParallel)]


@contextlib.contextmanager
def export_collectives(drafter: DFlashDrafter):
    """Swap the `tp` of the drafter and its layers for `ExportCollectives`; restore on exit."""
    holders = _tp_holders(drafter)
    if not holders or drafter.tp is None:
        raise ValueError("export_collectives: the drafter has no TensorParallel (a one-rank drafter)")
    saved = [(m, m.tp) for m in holders]
    stand_in = ExportCollectives(drafter.tp.rank, drafter.tp.size)
    for m in holders:
        m.tp = stand_in
    try:
        yield stand_in
    finally:
        for m, tp in saved:
            m.tp = tp


# -- the per-rank propose graph ----------------------------------------------------------------


def candidate_count(drafter: DFlashDrafter) -> int:
    return max(TOP_CANDIDATES, drafter.config.num_candidates)


class DFlashProposeTP(nn.Module):
    """One rank's propose: the one-rank adapter plus the gathered candidates (module doc)."""

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.step = ox.DFlashPropose(drafter)

    def forward(self, context_features, past_key, past_value, position, block_embeds):
        d = self.step.drafter
        outs = self.step(context_features, past_key, past_value, position, block_embeds)
        cands = d.tp.gathered_candidates(outs[3], d.vocab_start, candidate_count(d), position)
        return (*outs, *cands)


def rank_graph_io(drafter: DFlashDrafter) -> ox.GraphIO:
    base = ox.graph_io("dflash", drafter)
    dyn = {**base.dynamic, "top_values": {1: "block"}, "top_ids": {1: "block"},
           "log_normalizer": {1: "block"}}
    return ox.GraphIO(base.inputs, base.outputs + TP_OUTPUTS, dyn)


def rank_example_inputs(drafter: DFlashDrafter, **kw) -> tuple[torch.Tensor, ...]:
    """`onnx_export.example_inputs` with the past K/V cut to the rank's KV heads."""
    feats, pk, pv, pos, block = ox.example_inputs("dflash", drafter, **kw)
    nkv = drafter.local.num_key_value_heads
    return feats, pk[:, :, :nkv].contiguous(), pv[:, :, :nkv].contiguous(), pos, block


def export_rank(drafter: DFlashDrafter) -> onnx.ModelProto:
    """The portable per-rank propose graph of a drafter built with a `TensorParallel`."""
    with export_collectives(drafter):
        return ox.export_module(DFlashProposeTP(drafter), rank_example_inputs(drafter),
                                rank_graph_io(drafter), custom_domain=True)


def collective_ops(model: onnx.ModelProto) -> dict[str, int]:
    """Count of AllReduce / AllGather nodes (a subset of `onnx_lowering.metrale_ops`)."""
    return {op: n for op, n in lw.metrale_ops(model).items() if op in COLLECTIVE_OPS}


# -- loading the rank modules ------------------------------------------------------------------


def load_rank_drafters(root: Path, name: str, size: int, dtype=None) -> list[DFlashDrafter]:
    """Rank 0..size-1 of drafter `name` under `root` (`config.json` + `rank{r}.safetensors`),
    each built and filled as `load_engine(..., tp=TensorParallel(r, size))` does."""
    from safetensors.torch import load_file

    from metrale.runtime.models.configs import DFlashConfig
    from metrale.runtime.artifact.engine import fill_engine_state

    cfg = DFlashConfig.from_hf(json.loads((Path(root) / name / "config.json").read_text()),
                               f"{name}/config.json")
    out = []
    for r in range(size):
        module = DFlashDrafter(cfg, TensorParallel(r, size)).to(dtype or torch.float32)
        tensors = load_file(str(Path(root) / name / f"rank{r}.safetensors"))
        out.append(fill_engine_state(module, tensors, f"{name}/rank{r}.safetensors"))
    return out
