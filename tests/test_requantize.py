"""Weight tiers at load: `--draft-weight-quantization` and `--mtp-experts-nvfp4` on generate,
serve and bench, requantized with ModelOpt from the declared weights an engine directory keeps.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from metrale.builder.requantize import check_plans, requantized_states, states_for
from metrale.runtime.artifact.engine_dir import load_manifest
from metrale.runtime.errors import ConfigError, EngineDirError, QuantizationError
from metrale.runtime.spec.config import SpeculativeConfig

DRAFTERS = ("dflash", "dflash2")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(as_bytes(a[k]), as_bytes(b[k]))
        for k in a)


def test_the_engine_keeps_declared_weights(tiny_engine_dir, engine_factory):
    m = load_manifest(tiny_engine_dir)  # built at fp8: declared weights beside the rank file
    declared = engine_factory("declared")
    for name in DRAFTERS:
        info = m.components[name]
        assert info.declared == f"{name}/declared.safetensors" and info.declared in info.files
        # the declared file is exactly what a declared-tier build stores as its rank file
        assert same_bytes(load_file(str(tiny_engine_dir / info.declared)),
                          load_file(str(declared / name / "rank0.safetensors")))
        assert load_manifest(declared).components[name].declared == f"{name}/rank0.safetensors"
    mtp = m.components["mtp"]  # a BF16 head: its rank file is its declared weights
    assert mtp.declared == "mtp/rank0.safetensors"


@pytest.mark.parametrize("tier", ["declared", "fp8-aux", "nvfp4"])
def test_a_tier_at_load_has_the_bytes_of_a_build_at_that_tier(tiny_engine_dir, engine_factory, tier):
    states = requantized_states(tiny_engine_dir, load_manifest(tiny_engine_dir), draft_tier=tier,
                                drafters=DRAFTERS)
    built = engine_factory(tier)
    for name in DRAFTERS:
        state, source = states[name]
        assert f"quantized at load to {tier} (built: fp8)" in source
        assert same_bytes(state, load_file(str(built / name / "rank0.safetensors"))), name
    # the built tier needs nothing
    assert requantized_states(tiny_engine_dir, load_manifest(tiny_engine_dir), draft_tier="fp8",
                              drafters=DRAFTERS) == {}


def test_mtp_experts_nvfp4_at_load_has_the_build_bytes_both_ways(tiny_engine_dir, engine_factory):
    nvfp4 = engine_factory("fp8", mtp_experts_nvfp4=True)
    state, source = requantized_states(tiny_engine_dir, load_manifest(tiny_engine_dir),
                                       mtp_experts_nvfp4=True)["mtp"]
    assert "experts quantized at load to NVFP4 (built: BF16 experts)" in source
    assert same_bytes(state, load_file(str(nvfp4 / "mtp" / "rank0.safetensors")))
    m = load_manifest(nvfp4)
    assert m.components["mtp"].declared == "mtp/declared.safetensors"
    back, _ = requantized_states(nvfp4, m, mtp_experts_nvfp4=False)["mtp"]
    assert same_bytes(back, load_file(str(tiny_engine_dir / "mtp" / "rank0.safetensors")))
    assert requantized_states(nvfp4, m, mtp_experts_nvfp4=True) == {}


def test_refusals_at_load(tiny_engine_dir, engine_factory):
    fp8_head = engine_factory("fp8", mtp_quantization="fp8")
    with pytest.raises(QuantizationError, match=r"--mtp-experts-nvfp4 needs --mtp-quantization bf16"):
        requantized_states(fp8_head, load_manifest(fp8_head), mtp_experts_nvfp4=True)
    m = load_manifest(tiny_engine_dir)
    older = replace(m, components={n: i.model_copy(update={"declared": None})
                                   for n, i in m.components.items()})
    with pytest.raises(EngineDirError, match=r"--draft-weight-quantization nvfp4: engine directory "
                                             r".* keeps no declared weights for dflash \(an older"):
        requantized_states(tiny_engine_dir, older, draft_tier="nvfp4", drafters=("dflash",))
    with pytest.raises(ConfigError, match=r"--draft-weight-quantization nvfp4: the TensorRT plans "
                                          r"of engine directory .* were built with drafter weights "
                                          r"at fp8"):
        check_plans(tiny_engine_dir, m, draft_tier="nvfp4")
    with pytest.raises(ConfigError, match=r"--mtp-experts-nvfp4: the TensorRT plans .* experts in BF16"):
        check_plans(tiny_engine_dir, m, mtp_experts_nvfp4=True)
    check_plans(tiny_engine_dir, m, draft_tier="fp8", mtp_experts_nvfp4=False)  # as built
    bf16 = replace(m, build={**m.build, "trt_dtype": "bfloat16"})
    check_plans(tiny_engine_dir, bf16, dtype="auto")
    check_plans(tiny_engine_dir, bf16, dtype="bf16")
    with pytest.raises(ConfigError, match=r"--dtype float32: the TensorRT plans of engine directory "
                                          r".* compute in bfloat16; use --dtype auto or bfloat16, or "
                                          r"rebuild with --trt-dtype float32"):
        check_plans(tiny_engine_dir, bf16, dtype="float32")


def test_a_build_record_that_contradicts_the_drafters_is_refused(tiny_engine_dir):
    """The build record says which tier a flag at load would requantize from; one that names
    another tier than the drafters' weights are in (a hand-edited manifest) would skip that
    requantization, so it is refused, naming the drafter and both."""
    m = load_manifest(tiny_engine_dir)
    for tier in ("nvfp4", "declared"):
        edited = replace(m, build={**m.build, "draft_weight_quantization": tier})
        with pytest.raises(EngineDirError, match=rf"build.draft_weight_quantization is {tier}, but "
                                                 r"drafter dflash's weights are FP8"):
            requantized_states(tiny_engine_dir, edited, draft_tier="nvfp4", drafters=("dflash",))
    with pytest.raises(EngineDirError, match=r"'int4' is not one of declared, fp8, fp8-aux, nvfp4"):
        check_plans(tiny_engine_dir, replace(m, build={**m.build, "draft_weight_quantization": "int4"}))


def test_flags_need_their_mode():
    with pytest.raises(ConfigError, match='--draft-weight-quantization "nvfp4" requires --dflash'):
        SpeculativeConfig.from_flags(draft_weight_quantization="nvfp4")
    with pytest.raises(ConfigError, match=r'--draft-weight-quantization "int4": expected one of '
                                          r"declared, fp8, fp8-aux, nvfp4"):
        SpeculativeConfig.from_flags(dflash=True, draft_weight_quantization="int4")
    spec = SpeculativeConfig.from_flags(speculative=True, mtp_experts_nvfp4=True)
    assert spec.mtp_experts_nvfp4 is True and spec.draft_weight_quantization is None


def test_decoding_on_a_tier_chosen_at_load_equals_the_built_tier(tiny_engine_dir, engine_factory,
                                                                 tiny_prompts):
    """Same bytes, same drafts: a serve of the fp8 engine at nvfp4 decodes as the nvfp4 build."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator

    spec = SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash2",
                                        draft_weight_quantization="nvfp4")
    at_load = load_engine(tiny_engine_dir, states=states_for(tiny_engine_dir, load_manifest(tiny_engine_dir), spec))
    built = load_engine(engine_factory("nvfp4"))
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    for ids in tiny_prompts[:3]:
        a = EngineGenerator(at_load, spec).generate(ids, greedy)
        b = EngineGenerator(built, spec).generate(ids, greedy)
        assert a.token_ids == b.token_ids
        assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]
    assert "dflash2" in at_load.requantized and "dflash" not in at_load.requantized


def test_generate_cli_takes_the_tier_flags(tiny_engine_dir):
    from metrale.cli import app

    runner = CliRunner()
    args = ["generate", "--engine-dir", str(tiny_engine_dir), "--prompt", "def main(", "--max-tokens",
            "12", "--backend", "torch", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    r = runner.invoke(app, args + ["--dflash", "--draft-weight-quantization", "nvfp4", "--exact-verify"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["token_ids"] == plain["token_ids"]  # lossless on any tier
    r = runner.invoke(app, args + ["--speculative", "--mtp-experts-nvfp4", "--exact-verify"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["token_ids"] == plain["token_ids"]
    r = runner.invoke(app, args + ["--draft-weight-quantization", "nvfp4"])
    assert r.exit_code == 2 and '--draft-weight-quantization "nvfp4" requires --dflash' in r.output


def test_aoti_runs_a_requantized_drafter_eagerly(aoti_engine_dir):
    from metrale.runtime.models.dflash import DFlashDrafter
    from metrale.runtime.backends import load_engine

    m = load_manifest(aoti_engine_dir)
    states = requantized_states(aoti_engine_dir, m, draft_tier="nvfp4", drafters=("dflash",))
    engine = load_engine(aoti_engine_dir, backend="aoti", states=states)
    assert engine.backend.name == "aoti"
    assert isinstance(engine.drafters["dflash"], DFlashDrafter)  # eager: packages hold fp8
    assert not isinstance(engine.drafters["dflash2"], DFlashDrafter)  # its package, as built
    assert "dflash runs eagerly: its CPU packages hold the weights it was built with" in engine.backend_note
