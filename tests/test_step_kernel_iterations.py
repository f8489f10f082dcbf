"""Whole iterations (`spec.iteration`, the capture stand-in) on the decode step's Triton kernels,
run in Triton's interpreter as a GPU would run them: every q/k norm with rotary and every lane
attention of the target and the drafter takes its kernel, and each speculative mode's greedy
iterations emit the plain iterations' tokens on the same kernels. The MoE layers keep their
PyTorch form here: the interpreter runs the MoE kernels' programs one by one, seconds a verify
(`test_step_kernels` checks them against that form, and a row's output alone as in a batch)."""

from __future__ import annotations

import pytest
from test_kernels import interpreter, needs_triton  # noqa: F401 - `interpreter`: the fixture needs_triton uses
from test_step_kernels import step_kernels_on_cpu  # noqa: F401 - the fixture

from metrale.runtime.backends import cuda_graphs
from metrale.runtime.backends.cuda_graphs import EagerGraphs
from metrale.runtime.models.layers import MoE
from metrale.runtime.spec.iteration import DFlashIteration, PlainIteration
from metrale.runtime.spec.iteration_loop import IterationLoop
from metrale.runtime.spec.tree_iteration import DFlashTreeIteration

SLOTS, TOKENS = 128, 6


@needs_triton
def test_iterations_on_the_step_kernels_emit_plain_iterations_tokens(step_kernels_on_cpu, tiny_engine_dir,
                                                                      tiny_prompts):
    from metrale.runtime.backends import load_engine

    engine = load_engine(tiny_engine_dir).pack()
    eos = engine.tokenizer.eos_token_ids
    counts, trees = {"lane_attention": 0, "qk_norm_rope": 0}, []
    make = {
        "plain": lambda: PlainIteration(engine.target, slots=SLOTS),
        "dflash2 k=7": lambda: DFlashIteration(engine.target, engine.drafters["dflash2"], 7, slots=SLOTS),
        "dflash2 tree 8": lambda: DFlashTreeIteration(engine.target, engine.drafters["dflash2"], 8, slots=SLOTS),
    }
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cuda_graphs, "WARMUP", 1)  # (one run makes what a first run makes; a GPU runs three)
        moe_forward = MoE.forward

        def pytorch_moe(self, x, *args):
            step_kernels_on_cpu._state["on"] = False
            try:
                return moe_forward(self, x, *args)
            finally:
                step_kernels_on_cpu._state["on"] = True

        m.setattr(MoE, "forward", pytorch_moe)
        for name in counts:
            real = getattr(step_kernels_on_cpu, name)
            m.setattr(step_kernels_on_cpu, name,
                      lambda *a, _n=name, _f=real: counts.__setitem__(_n, counts[_n] + 1) or _f(*a))
        lane = step_kernels_on_cpu.lane_attention
        m.setattr(step_kernels_on_cpu, "lane_attention",  # a tree's rows: what `hidden` leaves them
                  lambda *a: trees.append(a[4] is not None) or lane(*a))
        tokens, emitted = {}, {}
        for mode, it in make.items():
            # replays unchecked: the interpreter moves each kernel's tensors through host memory,
            # which no graph replays (test_iteration checks the replays of every mode without it)
            loop = IterationLoop(it(), EagerGraphs(check=False))
            runs = [loop.generate(tiny_prompts[0][:8], TOKENS, eos)]
            tokens[mode] = [r.token_ids for r in runs]
            emitted[mode] = [n for r in runs for n in r.emitted]
    assert all(tokens[mode] == tokens["plain"] for mode in make), tokens
    assert all(max(emitted[mode]) > 1 for mode in make if mode != "plain"), emitted
    assert all(n > 0 for n in counts.values()) and any(trees) and not all(trees), counts
