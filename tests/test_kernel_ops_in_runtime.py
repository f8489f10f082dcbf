"""The torch backend runs DFlash2's dynamic convs and the MTP head's NVFP4 routed experts
through metrale's ops (`metrale::dflash2_dynamic_conv`, `metrale::nvfp4_moe_w4a16`), the ops
the exported graphs hold as nodes and the TensorRT engines as plugin layers."""

from __future__ import annotations

import pytest
import torch

from metrale.runtime.backends import load_engine
from metrale.runtime.models.layers import MoE, stack_nvfp4_experts


def _op_calls(fn, op: str) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == op)


def test_dflash2_convs_run_through_the_op(tiny_engine):
    d = tiny_engine.drafters["dflash2"]
    cfg = d.config
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 5, cfg.num_context_features * cfg.target_hidden_size, generator=gen)
    block = torch.randn(1, cfg.block_size, cfg.decoder.hidden_size, generator=gen)
    cache = d.new_cache(1, 16, torch.float32)
    with torch.no_grad():
        d.add_context(feats, cache)
        calls = _op_calls(lambda: d.forward_block(block, cache), "metrale::dflash2_dynamic_conv")
    assert calls == 2 * cfg.decoder.num_hidden_layers  # attention_conv and mlp_conv per layer
    dflash = tiny_engine.drafters["dflash"]
    with torch.no_grad():
        plain = dflash.new_cache(1, 16, torch.float32)
        dflash.add_context(feats, plain)
        assert _op_calls(lambda: dflash.forward_block(block, plain),
                         "metrale::dflash2_dynamic_conv") == 0


@pytest.fixture(scope="module")
def nvfp4_experts_engine(engine_factory):
    return load_engine(engine_factory("nvfp4", mtp_experts_nvfp4=True), components=("mtp",),
                       backend="torch")


def test_nvfp4_mtp_experts_run_the_grouped_op(nvfp4_experts_engine):
    head = nvfp4_experts_engine.mtp
    moes = [m for m in head.modules() if isinstance(m, MoE)]
    assert moes and all(stack_nvfp4_experts(m.experts) is not None for m in moes)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, moes[0].gate.in_features, generator=gen)
    with torch.no_grad():
        expert_by_expert = [m(x) for m in moes]  # unpacked: each expert's own NVFP4 linears
        nvfp4_experts_engine.pack()
        for m, before in zip(moes, expert_by_expert):
            assert _op_calls(lambda m=m: m(x), "metrale::nvfp4_moe_w4a16") == 1
            # one per-expert GEMM op is left: none (the shared expert is packed dense)
            assert _op_calls(lambda m=m: m(x), "metrale::nvfp4_w4a16_gemm") == 0
            torch.testing.assert_close(m(x), before, rtol=1e-5, atol=1e-6)
            assert before.abs().max() > 1e-3
