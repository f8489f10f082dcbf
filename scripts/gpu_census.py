"""The kernels one whole iteration launches on a GPU, per mode, counted on a CPU:

    python scripts/gpu_census.py ENGINE_DIR [--json OUT.json] [--modes plain,mtp k=3,...]

A CUDA graph replays one node per kernel its capture launched, and at the tiny default's sizes a
node costs about what its launch does, so an iteration's kernel count is most of its time on a
GPU. `metrale bench` records the ops one iteration dispatches on the device it runs on; on a CPU
those are the CPU's forms (RMSNorm as LayerNorm of [x, -x], rotary in four ops, the selector in
PyTorch ops), not what a GPU runs. Here the models take their GPU branches on CPU tensors, in
bfloat16 (`gpu_paths`):

- RMSNorm as one `F.rms_norm` (one fused kernel on CUDA), counted as one kernel;
- rotary cos/sin gathered from the shared table, as `rotary.rope_at` does on a GPU;
- the Triton step kernels (`plugins.step_kernels`: q/k norm with rotary, DFlash2's selector and
  dynamic conv, a MoE layer's router and experts, the iterations' attention) as stubs that
  count a launch and write zeros into their integer outputs (valid ids) and nothing into the
  others.

Counted (`Census`): every ATen op dispatched within the iteration but views (no kernel) and
`empty`-like allocations (none either), plus the Triton launches. An ATen op is taken as one
kernel: a few launch two on CUDA (a split-K GEMM, a large top-k), so the counts are a floor.
Values computed under the stubs are not the model's, so only the counts mean anything here.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
MODES = ("plain", "mtp k=3", "dflash k=7", "dflash2 k=7", "dflash2 tree 16")
# allocations: no kernel runs (a `new_zeros` or `zeros` fills, and is counted)
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class Census(TorchDispatchMode):
    """The kernels dispatched while active, by op (`kernels`), the stubs' launches included."""

    def __init__(self):
        super().__init__()
        self.kernels: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.namespace == "aten" and not func.is_view:
            name = func.overloadpacket.__name__
            if name not in ALLOCATIONS:
                self.kernels[name] += 1
        return func(*args, **(kwargs or {}))

    def launched(self, name: str) -> None:
        if not self.paused:
            self.kernels[name] += 1

    @contextlib.contextmanager
    def pause(self):
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused


class _StubKernels:
    """`step_kernels`' module of Triton kernels, each launch counted and run as zeros."""

    def __init__(self, census_of):
        self._census_of = census_of

    def __getattr__(self, name: str):
        census_of = self._census_of

        class Kernel:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    census = census_of()
                    if census is not None:
                        census.launched(f"triton {name.removesuffix('_kernel')}")
                    with census.pause() if census is not None else contextlib.nullcontext():
                        for t in args:
                            if isinstance(t, torch.Tensor) and not t.is_floating_point():
                                t.zero_()
                return launch
        return Kernel()


@contextlib.contextmanager
def gpu_paths(engine, census_of):
    """`engine`'s models on their GPU branches, on CPU tensors, while active (see the module's
    docstring; the rotary tables built as a CUDA load builds them); `census_of()` gives the
    census counting now, or None. Everything is restored on exit."""
    from metrale.plugins import step_kernels
    from metrale.runtime.backends import engine_rope_tables
    from metrale.runtime.models import layers, rotary

    def rms_norm(self, x):
        census = census_of()
        weight = 1.0 + self.weight if self.zero_centred else self.weight
        with census.pause() if census is not None else contextlib.nullcontext():
            out = F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), self.eps)
        if census is not None:
            census.launched("rms_norm")
        return out

    saved = (dict(step_kernels._state), layers.RMSNorm.forward, rotary.gathers_rope, set(rotary._STEP_KEYS))
    engine_rope_tables(engine)
    step_kernels._state.update(on=True, cpu=True, kernels=_StubKernels(census_of))
    layers.RMSNorm.forward = rms_norm
    rotary.gathers_rope = lambda positions: not torch._C._is_tracing()
    try:
        yield
    finally:
        step_kernels._state.clear()
        step_kernels._state.update(saved[0])
        layers.RMSNorm.forward, rotary.gathers_rope = saved[1], saved[2]
        rotary._STEP_KEYS.clear()
        rotary._STEP_KEYS.update(saved[3])


def iteration(engine, mode: str, slots: int = 256):
    """The whole iteration of `mode` (one of MODES' forms: "plain", "mtp k=K", "dflash k=K",
    "dflash2 k=K", "<drafter> tree N") on `engine`'s models, greedy."""
    from metrale.runtime.spec.iteration import DFlashIteration, MTPIteration, PlainIteration
    from metrale.runtime.spec.tree_iteration import DFlashTreeIteration

    words = mode.split()
    if words == ["plain"]:
        return PlainIteration(engine.target, slots=slots)
    if words[0] == "mtp" and words[1].startswith("k="):
        return MTPIteration(engine.target, engine.mtp, k=int(words[1][2:]), slots=slots)
    if words[0] in engine.drafters and words[1].startswith("k="):
        return DFlashIteration(engine.target, engine.drafters[words[0]], int(words[1][2:]), slots=slots)
    if words[0] in engine.drafters and words[1] == "tree":
        return DFlashTreeIteration(engine.target, engine.drafters[words[0]], int(words[2]), slots=slots)
    raise SystemExit(f"--modes: {mode!r} is not one of plain, mtp k=K, <drafter> k=K, <drafter> tree N")


def census(engine, modes, prompt: list[int]) -> dict:
    """Per mode: the kernels one iteration launches on the GPU paths (`total`, `by_op`), after a
    first iteration of the same request."""
    counting: list[Census] = []
    out = {}
    with gpu_paths(engine, lambda: counting[0] if counting else None), torch.inference_mode():
        for mode in modes:
            it = iteration(engine, mode)
            it.check_room(len(prompt), 16)
            it.prefill(0, prompt)
            it()
            with Census() as count:
                counting.append(count)
                try:
                    it()
                finally:
                    counting.clear()
            out[mode] = {"total": sum(count.kernels.values()), "by_op": dict(count.kernels.most_common())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT.parent))
    from metrale.runtime.backends import load_engine

    torch.set_num_threads(1)
    engine = load_engine(args.engine_dir, dtype=torch.bfloat16).pack()
    prompt = engine.tokenizer.encode("def main(argv):\n    return")
    result = census(engine, [m.strip() for m in args.modes.split(",")], prompt)
    for mode, row in result.items():
        ops = ", ".join(f"{k} {v}" for k, v in row["by_op"].items())
        print(f"{mode}: {row['total']} kernels ({ops})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
