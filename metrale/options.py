"""Typer option declarations shared by the commands; help texts come from one place.

The speculative flags' help is `runtime.spec.config.HELP` (the seeds' semantics). Every flag
defaults to `None` (not given) so `SpeculativeConfig.from_flags` can tell an explicit value
from a default and refuse flags given without their mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from metrale.plugins.formats import DRAFT_TIERS
from metrale.runtime.spec.config import HELP
from metrale.runtime.spec.help import BENCH_HELP

EngineDir = Annotated[Path, typer.Option("--engine-dir", help="An engine directory written by `metrale build`.")]
Device = Annotated[Optional[str], typer.Option(
    help="Torch device: cpu or cuda[:N]. Default: cpu, or cuda with --backend tensorrt.")]
BACKEND_HELP = ("What runs the models. auto (default): aoti on a CPU when the engine directory has "
                "CPU packages built for this machine; on a CUDA device the target's decode and verify "
                "steps replayed as CUDA graphs (eager torch if capturing fails); torch otherwise. "
                "torch: the engine directory's "
                "safetensors in eager PyTorch, on CPU or GPU (in bfloat16 on a CPU its verify rows "
                "equal one-row steps, so chunkwise verify emits plain greedy text). aoti: the "
                "AOTInductor packages of the target, the MTP head and the one-rank drafters (built "
                "with --cpu-engines aoti; CPU only, float32; a tensor-parallel drafter runs in eager "
                "PyTorch). onnxruntime: the engine directory's ONNX graphs (the ones TensorRT "
                "compiles) in onnxruntime on a CPU, float32, one process, the built weight tiers. "
                "tensorrt: its TensorRT engines for this GPU's SM, with CUDA graphs for the "
                "one-token decode steps and the block proposes (needs an NVIDIA GPU and engines built "
                "for its SM; one process, or with --nproc N one per rank of a --draft-tp-size N build, "
                "each running its own drafter engine).")
Backend = Annotated[str, typer.Option("--backend", metavar="auto|torch|aoti|onnxruntime|tensorrt", help=BACKEND_HELP)]
DTYPE_HELP = ("Activation dtype. auto (default): bfloat16 on a CUDA device, where it is native; "
              "float32 on a CPU, where plain decoding measured faster in it (and the aoti "
              "packages are float32); with --backend onnxruntime, float32 (the only one it "
              "takes); with --backend tensorrt, the dtype the engines were built "
              "in (metrale build's --trt-dtype, bfloat16 by default). float32 or bfloat16: that "
              "dtype (the tensorrt backend refuses one its engines were not built in).")
Dtype = Annotated[str, typer.Option(metavar="auto|float32|bfloat16", help=DTYPE_HELP)]

Speculative = Annotated[bool, typer.Option("--speculative", help=HELP["--speculative"])]
NumDrafts = Annotated[Optional[int], typer.Option("--num-drafts", metavar="K", help=HELP["--num-drafts"])]
ConfidenceStop = Annotated[Optional[str], typer.Option(
    "--draft-confidence-stop", metavar="TAU|cum:TAU", help=HELP["--draft-confidence-stop"])]
DFlash = Annotated[bool, typer.Option("--dflash", help=HELP["--dflash"])]
DFlashDrafter = Annotated[Optional[str], typer.Option("--dflash-drafter", metavar="NAME", help=HELP["--dflash-drafter"])]
Gamma = Annotated[Optional[int], typer.Option("--dflash-gamma", metavar="N", help=HELP["--dflash-gamma"])]
Ladder = Annotated[Optional[str], typer.Option("--dflash-draft-ladder", metavar="1,3,7", help=HELP["--dflash-draft-ladder"])]
AdaptiveK = Annotated[Optional[str], typer.Option(
    "--dflash-adaptive-k", metavar="drafts:ms,...", help=HELP["--dflash-adaptive-k"])]
Reprobe = Annotated[Optional[int], typer.Option(
    "--dflash-reprobe-interval", metavar="N", help=HELP["--dflash-reprobe-interval"])]
TreeBudget = Annotated[Optional[int], typer.Option(
    "--dflash-tree-budget", metavar="N", help=HELP["--dflash-tree-budget"])]
TreeVerify = Annotated[Optional[str], typer.Option(
    "--dflash-tree-verify", metavar="auto|forward|paths", help=HELP["--dflash-tree-verify"])]
ExactVerify = Annotated[bool, typer.Option("--exact-verify", help=HELP["--exact-verify"])]
DraftTp = Annotated[Optional[str], typer.Option("--draft-tp-size", metavar="N|auto", help=HELP["--draft-tp-size"])]
DraftTier = Annotated[Optional[str], typer.Option(
    "--draft-weight-quantization", metavar="|".join(DRAFT_TIERS),
    help=HELP["--draft-weight-quantization"])]
MtpNvfp4 = Annotated[Optional[bool], typer.Option(
    "--mtp-experts-nvfp4/--no-mtp-experts-nvfp4", help=HELP["--mtp-experts-nvfp4"], show_default=False)]
# bench runs every mode, each with its own speculative flags: the tier flags' own texts
BenchDraftTier = Annotated[Optional[str], typer.Option(
    "--draft-weight-quantization", metavar="|".join(DRAFT_TIERS),
    help=BENCH_HELP["--draft-weight-quantization"])]
BenchMtpNvfp4 = Annotated[Optional[bool], typer.Option(
    "--mtp-experts-nvfp4/--no-mtp-experts-nvfp4", help=BENCH_HELP["--mtp-experts-nvfp4"],
    show_default=False)]

DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
          "bf16": "bfloat16"}


def torch_dtype(name: str, device: str | None = "cpu"):
    """--dtype as a torch dtype on `device`: auto is bfloat16 on CUDA, float32 elsewhere."""
    import torch

    from metrale.runtime.errors import ConfigError

    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: expected one of auto, float32, bfloat16")
    if DTYPES[name] == "auto":
        cuda = device is not None and torch.device(device).type == "cuda"
        return torch.bfloat16 if cuda else torch.float32
    return getattr(torch, DTYPES[name])


# name, annotation, default: the speculative flags, in `SpeculativeConfig.from_flags` order.
SPEC_FLAGS = (
    ("speculative", Speculative, False), ("num_drafts", NumDrafts, None),
    ("draft_confidence_stop", ConfidenceStop, None), ("dflash", DFlash, False),
    ("dflash_gamma", Gamma, None), ("dflash_draft_ladder", Ladder, None),
    ("dflash_adaptive_k", AdaptiveK, None), ("dflash_reprobe_interval", Reprobe, None),
    ("dflash_tree_budget", TreeBudget, None), ("dflash_tree_verify", TreeVerify, None),
    ("exact_verify", ExactVerify, False), ("draft_tp_size", DraftTp, None),
    ("dflash_drafter", DFlashDrafter, None), ("draft_weight_quantization", DraftTier, None),
    ("mtp_experts_nvfp4", MtpNvfp4, None),
)


def with_spec_flags(on_error):
    """Give a command the speculative flags; it receives them parsed, as `spec`.

    The flags are appended to the command's signature (typer reads `__signature__`), parsed
    with `SpeculativeConfig.from_flags` — every refusal happens here, before any model loads —
    and errors go through `on_error` (the CLI's error context)."""
    import functools
    import inspect
    import typing

    def decorate(fn):
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
        kept = [p.replace(annotation=hints.get(p.name, p.annotation))
                for p in sig.parameters.values() if p.name != "spec"]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann)
                 for name, ann, default in SPEC_FLAGS]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            from metrale.runtime.spec.config import SpeculativeConfig

            flags = {name: kwargs.pop(name) for name, _, _ in SPEC_FLAGS}
            with on_error():
                spec = SpeculativeConfig.from_flags(**flags)
            return fn(*args, spec=spec, **kwargs)

        del command.__wrapped__  # typer must see the new signature, not the wrapped one
        command.__signature__ = sig.replace(parameters=kept + added)
        command.__annotations__ = {p.name: p.annotation for p in kept + added}
        return command

    return decorate
