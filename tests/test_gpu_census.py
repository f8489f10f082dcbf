"""scripts/gpu_census.py: the kernels a whole iteration launches on the GPU paths, counted on a
CPU. The Triton step kernels and the fused RMSNorm count one launch each where the GPU runs them
(per layer, per drafter block; a MoE layer's three), an iteration counts fewer kernels than the CPU's forms dispatch
ops, and the models are back on their CPU paths afterwards, their tokens unchanged."""

from __future__ import annotations

from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest
import torch

from metrale.runtime.backends.host_reads import OpCount


@pytest.fixture(scope="module")
def census_script():
    spec = spec_from_file_location("gpu_census", Path(__file__).resolve().parent.parent / "scripts" / "gpu_census.py")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    from metrale.runtime.backends import load_engine

    return load_engine(tiny_engine_dir, dtype=torch.bfloat16).pack()


def _plain_tokens(census_script, engine, prompt: list[int], n: int = 6) -> list[int]:
    it = census_script.iteration(engine, "plain")
    with torch.inference_mode():
        it.check_room(len(prompt), 16)
        it.prefill(0, prompt)
        for _ in range(n):
            it()
    return it.state.tokens[0, :int(it.state.count[0])].tolist()


def test_the_census_counts_the_gpu_launches(census_script, engine):
    from metrale.plugins import step_kernels
    from metrale.runtime.models import layers, rotary

    prompt = engine.tokenizer.encode("def main(argv):\n    return")
    before = (dict(step_kernels._state), layers.RMSNorm.forward, rotary.gathers_rope, set(rotary._STEP_KEYS))
    tokens = _plain_tokens(census_script, engine, prompt)
    assert len(tokens) >= 6
    counts = census_script.census(engine, ["plain", "dflash2 k=7"], prompt)

    target_layers = engine.target.config.num_hidden_layers
    drafter_layers = engine.drafters["dflash2"].config.decoder.num_hidden_layers
    plain, dflash2 = counts["plain"]["by_op"], counts["dflash2 k=7"]["by_op"]
    assert plain["triton qk_norm_rope"] == plain["triton lane_attention"] == target_layers
    assert plain["triton moe_route"] == plain["triton moe_gate_up"] == plain["triton moe_down"] == target_layers
    assert "softmax" not in plain and "topk" not in plain  # the attention's and the router's, in the kernels
    assert plain["rms_norm"] == 2 * target_layers + 1  # each layer's two, then the final norm
    assert "layer_norm" not in plain and "triton dflash2_select" not in plain
    assert dflash2["triton dflash2_select"] == 1  # the whole block's selection in one launch
    assert dflash2["triton dflash2_dynamic_conv"] >= drafter_layers
    assert dflash2["triton qk_norm_rope"] == target_layers + drafter_layers
    assert counts["plain"]["total"] == sum(plain.values()) < counts["dflash2 k=7"]["total"]

    # the CPU's forms of the same iteration dispatch more ops than the GPU launches kernels
    it = census_script.iteration(engine, "plain")
    with torch.inference_mode():
        it.check_room(len(prompt), 16)
        it.prefill(0, prompt)
        it()
        with OpCount() as ops:
            it()
    assert ops.ops > counts["plain"]["total"]

    after = (dict(step_kernels._state), layers.RMSNorm.forward, rotary.gathers_rope, set(rotary._STEP_KEYS))
    assert after == before
    assert _plain_tokens(census_script, engine, prompt) == tokens


def test_the_census_refuses_an_unknown_mode(census_script, engine):
    with pytest.raises(SystemExit, match="'dflash3 k=2' is not one of"):
        census_script.iteration(engine, "dflash3 k=2")
