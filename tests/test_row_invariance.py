"""Batch-invariant verify on the eager torch backend in bfloat16 (CPU): each row of a k+1-row
verify forward is bit-identical to the one-row decode step at its position, so chunkwise
speculation emits plain greedy decoding's text in every mode, without --exact-verify.
(The aoti backend's float32 promise is tested in test_aoti_backend.)"""

import json

import pytest
import torch
from conftest import CHUNKWISE_MODES, assert_verify_rows_are_one_row_steps


@pytest.fixture(scope="module")
def bf16_engine(tiny_engine_dir):
    from metrale.runtime.backends import load_engine

    engine = load_engine(tiny_engine_dir, backend="torch", dtype=torch.bfloat16).pack()
    assert engine.rows_invariant
    return engine


@pytest.fixture(scope="module")
def held_out(tiny_recipe, bf16_engine) -> list[list[int]]:
    texts = json.loads((tiny_recipe.target.checkpoint.parent / "prompts.json").read_text())
    assert len(texts) == 24
    return [bf16_engine.tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("k", range(8))
def test_verify_rows_equal_one_row_steps(bf16_engine, k):
    assert_verify_rows_are_one_row_steps(bf16_engine.target, k, seed=200 + k, trials=3)


def test_float32_eager_does_not_claim_it(tiny_engine):
    assert tiny_engine.dtype == torch.float32 and not tiny_engine.rows_invariant


def test_every_chunkwise_mode_emits_plain_greedy_text(bf16_engine, held_out):
    """The 24 held-out prompts × 128 tokens, bfloat16, chunkwise verify, every mode."""
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    params = SamplingParams(temperature=0.0, max_tokens=128)
    plain = [EngineGenerator(bf16_engine).generate(ids, params).token_ids for ids in held_out]
    for flags in CHUNKWISE_MODES:
        gen = EngineGenerator(bf16_engine, SpeculativeConfig.from_flags(**flags))
        verified = 0
        for ids, want in zip(held_out, plain):
            res = gen.generate(ids, params)
            assert res.token_ids == want, flags
            verified += res.metrics.drafts_verified
        assert verified > 0
