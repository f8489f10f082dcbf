"""`metrale::draft_stop`: one draft step's confidence stop and top-16 candidates.

Math, for logits [R, V] (bf16/fp16/fp32, V >= 16), tau float32 [], cumulative bool/int [] and
running float32 [R] (the product of the chain's earlier top-1 probabilities, 1 at its start):

    top1_prob[r]   = max_v softmax(float32(logits[r]))[v]                 float32 [R]
    running_out[r] = running[r] · top1_prob[r]                            float32 [R]
    stop[r]        = running_out[r] < tau if cumulative else top1_prob[r] < tau   bool [R]
    cand_vals[r], cand_ids[r] = the 16 largest float32(logits[r]) and their ids
                                                           float32 [R, 16], int64 [R, 16]

`stop` is the chain stop of `--draft-confidence-stop` (`runtime.spec_mtp`: a chain continues
past a draft only while p >= TAU, or p_1·…·p_i >= TAU with `cum:`). Candidates are ordered by
value descending, equal values by id ascending (a stable sort): this is guaranteed, including
which of several equal values make the 16. `torch.topk` returns the same values but does not
order ties by id on CPU, so ids agree with it only where the 16 values (and the 16th against
the 17th) are distinct. NaN logits are outside the contract.

Other faces: `draft_stop_triton` (`triton_kernels.draft_stop_kernel`: one program per row,
online softmax sum and a running top-16 over chunks of the vocabulary; candidate values and ids
are exact, probabilities match to float32 rounding of the sum) and the ONNX node
`metrale::DraftStop(logits, tau, cumulative, running) -> (top1_prob, stop, running_out,
cand_vals, cand_ids)` (`onnx_ops`).
"""

from __future__ import annotations

import torch

OP_NAME = "metrale::draft_stop"
NUM_CANDIDATES = 16
TRITON_BLOCKS = {"BLOCK_V": 1024, "NUM_CAND": NUM_CANDIDATES}  # also the constexprs of `aot`


@torch.library.custom_op(OP_NAME, mutates_args=())
def draft_stop(
    logits: torch.Tensor, tau: torch.Tensor, cumulative: torch.Tensor, running: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top1_prob, stop, running_out, cand_vals, cand_ids) of logits [R, V]; see the module doc."""
    _check(logits, tau, cumulative, running)
    lf = logits.to(torch.float32)  # [R, V]
    top1 = torch.softmax(lf, dim=-1).max(dim=-1).values  # [R]
    running_out = running.to(torch.float32) * top1  # [R]
    tau32 = tau.to(torch.float32).reshape(())
    stop = running_out < tau32 if bool(cumulative) else top1 < tau32  # bool [R]
    ordered = torch.sort(lf, dim=-1, descending=True, stable=True)  # ties: lower id first
    return (top1, stop, running_out, ordered.values[:, :NUM_CANDIDATES].contiguous(),
            ordered.indices[:, :NUM_CANDIDATES].contiguous())


@draft_stop.register_fake
def _draft_stop_fake(logits, tau, cumulative, running):
    _check(logits, tau, cumulative, running)
    r = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (logits.new_empty((r,), **f32), logits.new_empty((r,), dtype=torch.bool),
            logits.new_empty((r,), **f32), logits.new_empty((r, NUM_CANDIDATES), **f32),
            logits.new_empty((r, NUM_CANDIDATES), dtype=torch.int64))


def _check(logits, tau, cumulative, running) -> None:
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32) or logits.dim() != 2:
        raise ValueError(f"{OP_NAME}: logits must be bf16/fp16/fp32 [R, V], got {logits.dtype} "
                         f"{list(logits.shape)}")
    if logits.shape[1] < NUM_CANDIDATES:
        raise ValueError(f"{OP_NAME}: the vocabulary must hold at least {NUM_CANDIDATES} "
                         f"tokens, got {logits.shape[1]}")
    if tau.numel() != 1 or cumulative.numel() != 1:
        raise ValueError(f"{OP_NAME}: tau and cumulative must be scalars, got "
                         f"{list(tau.shape)} and {list(cumulative.shape)}")
    if cumulative.is_floating_point():
        raise ValueError(f"{OP_NAME}: cumulative must be bool or integer, got {cumulative.dtype}")
    if running.shape != (logits.shape[0],):
        raise ValueError(f"{OP_NAME}: running must be [{logits.shape[0]}], got "
                         f"{list(running.shape)}")


def draft_stop_triton(logits: torch.Tensor, tau: torch.Tensor, cumulative: torch.Tensor,
                      running: torch.Tensor):
    """The Triton face: same contract as `draft_stop`; CPU tensors run in the interpreter."""
    from metrale.plugins.triton_mode import load_kernels

    _check(logits, tau, cumulative, running)
    kernels = load_kernels(logits.device.type)
    r, v = logits.shape
    dev = logits.device
    top1 = torch.empty(r, dtype=torch.float32, device=dev)
    stop = torch.empty(r, dtype=torch.bool, device=dev)
    running_out = torch.empty(r, dtype=torch.float32, device=dev)
    cand_vals = torch.empty((r, NUM_CANDIDATES), dtype=torch.float32, device=dev)
    cand_ids = torch.empty((r, NUM_CANDIDATES), dtype=torch.int64, device=dev)
    # bool tensors are one byte of 0/1: the kernel reads and writes them as int8.
    kernels.draft_stop_kernel[(r,)](
        logits.contiguous(), tau.to(torch.float32).reshape(1).contiguous(),
        (cumulative.reshape(1) != 0).view(torch.int8), running.to(torch.float32).contiguous(),
        top1, stop.view(torch.int8), running_out, cand_vals, cand_ids, v,
        **TRITON_BLOCKS, num_warps=4, enable_fp_fusion=False,
    )
    return top1, stop, running_out, cand_vals, cand_ids
