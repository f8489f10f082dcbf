"""`metrale build` on the embedded tiny recipe: the engine directory contract, tiers, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from metrale.builder.build import build_engine
from metrale.runtime.backends import load_engine
from metrale.runtime.artifact.engine_dir import load_manifest
from metrale.runtime.errors import ConfigError, EngineDirError, MetraleError


def test_engine_dir_round_trip(tiny_engine_dir, tiny_recipe):
    m = load_manifest(tiny_engine_dir)
    assert set(m.components) == {"target", "mtp", "dflash", "dflash2"}
    assert m.build["draft_weight_quantization"] == "fp8"
    for name in ("target", "mtp", "dflash", "dflash2"):
        assert f"{name}/rank0.safetensors" in m.files
        assert len(m.sources[name]["sha256"]) == 64
    assert "tokenizer/tokenizer.json" in m.files
    # every file is listed with its size
    on_disk = {p.relative_to(tiny_engine_dir).as_posix(): p.stat().st_size
               for p in tiny_engine_dir.rglob("*") if p.is_file() and p.name != "config.json" or
               (p.is_file() and p.parent != tiny_engine_dir)}
    assert {k: v["size"] for k, v in m.files.items()} == on_disk
    # the target's weights are the checkpoint's, untouched (bf16 both sides)
    ck = load_file(str(tiny_recipe.target.checkpoint / "model.safetensors"))
    eng = load_file(str(tiny_engine_dir / "target" / "rank0.safetensors"))
    assert ck.keys() == eng.keys()
    assert all(torch.equal(ck[k], eng[k]) for k in ck)


def test_flipped_byte_is_refused_naming_the_file(engine_factory, tmp_path):
    import shutil

    src = engine_factory("fp8")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    f = copy / "dflash" / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(EngineDirError, match="dflash/rank0.safetensors"):
        load_engine(copy)


@pytest.mark.parametrize("tier", ["declared", "fp8", "fp8-aux", "nvfp4"])
def test_tiers_store_the_seed_sets(engine_factory, tier):
    d = engine_factory(tier)
    m = load_manifest(d)
    for name in ("dflash", "dflash2"):
        st = load_file(str(d / name / "rank0.safetensors"))
        quantized = sorted(k[: -len(".weight_scale")] for k in st if k.endswith(".weight_scale"))
        core = [k for k in quantized if k.startswith("layers.") and k.split(".")[-1].endswith("_proj")
                and ("self_attn" in k or ".mlp." in k)]
        aux = [k for k in quantized if k not in core and k != "lm_head"]
        if tier == "declared":
            assert quantized == []
            continue
        n_layers = 2
        assert len(core) == n_layers * 7 and "lm_head" in quantized
        if tier == "fp8":
            assert aux == []
        else:
            expect_aux = {"fc", "context_kv_proj"}
            if name == "dflash2":
                expect_aux |= {f"layers.{i}.{c}.kernel_projection" for i in range(n_layers)
                               for c in ("attention_conv", "mlp_conv")}
                expect_aux |= {"candidate_selector.hidden_projection"}
            assert set(aux) == expect_aux
        dtype = torch.uint8 if tier == "nvfp4" else torch.float8_e4m3fn
        assert all(st[f"{k}.weight"].dtype == dtype for k in quantized)
        assert sorted(m.components[name].quant_algo.quantized_modules) == quantized
    # the target is never quantized
    assert not any(k.endswith("weight_scale") for k in load_file(str(d / "target" / "rank0.safetensors")))


def test_tier_bytes_follow_the_estimate(engine_factory):
    sizes = {t: load_manifest(engine_factory(t)).components["dflash"].weight_bytes
             for t in ("declared", "fp8", "fp8-aux", "nvfp4")}
    assert sizes["nvfp4"] < sizes["fp8-aux"] < sizes["fp8"] < sizes["declared"]
    est = load_manifest(engine_factory("fp8")).memory_estimate["dflash"]
    assert est == sizes


def test_quantized_drafters_still_draft(engine_factory, tiny_prompts):
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    engine = load_engine(engine_factory("nvfp4"))
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True))
    r = gen.decoder().generate(tiny_prompts[0], SamplingParams(temperature=0.0, max_tokens=24))
    assert r.metrics.tau > 1.0


def test_mtp_experts_nvfp4_build(engine_factory):
    d = engine_factory("fp8", mtp_experts_nvfp4=True)
    st = load_file(str(d / "mtp" / "rank0.safetensors"))
    experts = [k for k in st if ".experts." in k or ".shared_expert." in k]
    assert experts and all(st[k].dtype == torch.uint8 for k in experts if k.endswith("proj.weight"))
    assert st["layer.mlp.gate.weight"].dtype == torch.bfloat16  # the router keeps its precision
    assert st["layer.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_refusals_leave_no_directory(tiny_recipe, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(MetraleError, match="mtp.quantization"):
        build_engine(tiny_recipe.with_build(mtp_experts_nvfp4=True, mtp_quantization="fp8"), out)
    with pytest.raises(ConfigError, match="draft_weight_quantization"):
        tiny_recipe.with_build(draft_weight_quantization="int3")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging directory left behind


def test_manifest_is_json_with_sorted_keys(tiny_engine_dir):
    text = (tiny_engine_dir / "config.json").read_text()
    assert json.loads(text)["format_version"] == 1


def test_cubin_jobs_are_what_the_engines_plugin_layers_launch():
    from metrale.builder.build import cubin_jobs
    from metrale.plugins.trt_plugin import KERNELS_OF_OP

    components = {
        "dflash": {"engines": {
            "89": {"plugins": {"NvFp4W4A16Gemm": 7}, "plugin_acts": {"NvFp4W4A16Gemm": ["bf16", "fp32"]}},
            "120": {"plugins": {}, "plugin_acts": {}}}},  # native FP4: no cubin for SM120
        "dflash2": {"engines": {  # a tensor-parallel drafter: collectives call NCCL, no cubin
            "89": {"plugins": {"NvFp4W4A16Gemm": 7, "AllReduce": 4, "DFlash2DynamicConv": 4},
                   "plugin_acts": {"NvFp4W4A16Gemm": ["fp32"], "DFlash2DynamicConv": ["fp32"]},
                   "ranks": []}}},
        "mtp": {"engines": {"86": {"plugins": {"Fp8W8A16Gemm": 3, "NvFp4MoeW4A16": 1},
                                   "plugin_acts": {"Fp8W8A16Gemm": ["fp16"], "NvFp4MoeW4A16": ["fp16"]}}}},
    }
    assert cubin_jobs(components, KERNELS_OF_OP) == [  # the MoE launches two kernels
        ("dflash2_dynamic_conv_kernel", 89, "fp32"), ("fp8_w8a16_gemm_kernel", 86, "fp16"),
        ("nvfp4_moe_down_kernel", 86, "fp16"), ("nvfp4_moe_gate_up_kernel", 86, "fp16"),
        ("nvfp4_w4a16_gemm_kernel", 89, "bf16"), ("nvfp4_w4a16_gemm_kernel", 89, "fp32")]
    assert cubin_jobs({"target": {"engines": {"89": {"plugins": {}}}}}, KERNELS_OF_OP) == []
    with pytest.raises(ConfigError, match="component mtp: the SM86 engine has Fp8W8A16Gemm plugin layers"):
        cubin_jobs({"mtp": {"engines": {"86": {"plugins": {"Fp8W8A16Gemm": 3}}}}}, KERNELS_OF_OP)
