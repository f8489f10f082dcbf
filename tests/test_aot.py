"""Ahead-of-time compilation of the Triton kernels to cubins for sm89, sm90, sm100 and sm120 with
no GPU. Compiling needs triton in compiled (not interpreter) mode, so it runs in a subprocess:
`test_kernels` puts this pytest process in interpreter mode."""

import hashlib
import importlib.util
import json
import struct

import pytest

from metrale.plugins import aot

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton==3.9.0)")

SMS = (89, 90, 100, 120)
QUICK = ("nvfp4_w4a16_gemm_kernel", "dflash2_dynamic_conv_kernel", "dflash2_select_kernel",
         "qk_norm_rope_kernel", "moe_route_kernel", "moe_gate_up_kernel", "moe_down_kernel",
         "lane_attention_kernel")  # in spec order
EM_CUDA = 190  # ELF e_machine of NVIDIA CUDA objects


def check_outputs(out_dir, results, names, acts=("bf16",)):
    keys = [n.removesuffix("_kernel") for n in names]
    assert [(m["kernel"], m["sm"], m["act"]) for m in results] == [
        (k, sm, act) for k in keys for sm in SMS for act in acts]
    specs = {s["name"]: s for s in aot.kernel_specs("bf16") + aot.step_kernel_specs("bf16")}
    for meta in results:
        stem = f"{meta['kernel']}.sm{meta['sm']}.{meta['act']}"
        cubin = (out_dir / f"{stem}.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF" and len(cubin) == meta["bytes"] > 1000
        assert struct.unpack_from("<H", cubin, 18)[0] == EM_CUDA  # e_machine
        assert hashlib.sha256(cubin).hexdigest() == meta["sha256"]
        on_disk = json.loads((out_dir / f"{stem}.json").read_text())
        assert on_disk == meta
        spec = specs[meta["symbol"]]
        assert meta["symbol"] == meta["kernel"] + "_kernel" and meta["cubin"] == f"{stem}.cubin"
        assert meta["block"] == [32 * meta["num_warps"], 1, 1] and meta["num_warps"] == spec["num_warps"]
        assert meta["args"] == list(spec["signature"]) and meta["grid"] == spec["grid"]
        assert meta["constexprs"].items() >= spec["blocks"].items()
        assert meta["arch"] == ("sm_89" if meta["sm"] == 89 else f"sm_{meta['sm']}a")
        assert meta["shared"] >= 0 and meta["enable_fp_fusion"] is False
        assert meta["scratch_args"] == 2  # this Triton appends global and profile scratch
    # One binary per target and dtype: no two SMs (or dtypes) share a cubin.
    for key in keys:
        assert len({m["sha256"] for m in results if m["kernel"] == key}) == len(SMS) * len(acts)


def test_quick_kernels_compile_for_every_target_sm(tmp_path):
    results = aot.compile_kernels_in_subprocess(tmp_path, SMS, kernels=QUICK)
    check_outputs(tmp_path, results, QUICK)


def test_a_cubin_is_compiled_per_activation_dtype(tmp_path):
    # the GEMM's pointers (and dot path) differ per dtype: an fp32 cubin must never be the one a
    # bf16 engine launches, so each dtype gets its own file, key and binary
    jobs = [("fp8_w8a16_gemm_kernel", 89, "fp32"), ("fp8_w8a16_gemm_kernel", 89, "bf16")]
    results = aot.compile_jobs_in_subprocess(tmp_path, jobs)
    assert [(m["kernel"], m["sm"], m["act"]) for m in results] == [
        ("fp8_w8a16_gemm", 89, "fp32"), ("fp8_w8a16_gemm", 89, "bf16")]
    assert results[0]["signature"]["x_ptr"] == "*fp32" and results[1]["signature"]["x_ptr"] == "*bf16"
    assert results[0]["sha256"] != results[1]["sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fp8_w8a16_gemm.sm89.bf16.cubin", "fp8_w8a16_gemm.sm89.bf16.json",
        "fp8_w8a16_gemm.sm89.fp32.cubin", "fp8_w8a16_gemm.sm89.fp32.json"]


def test_kernel_jobs_order_and_refusals():
    assert aot.kernel_jobs((89, 120), ("fp32", "bf16"), ("fp8_w8a16_gemm_kernel",)) == [
        ("fp8_w8a16_gemm_kernel", 89, "fp32"), ("fp8_w8a16_gemm_kernel", 89, "bf16"),
        ("fp8_w8a16_gemm_kernel", 120, "fp32"), ("fp8_w8a16_gemm_kernel", 120, "bf16")]
    with pytest.raises(ValueError, match=r"activation dtypes \['f16'\]: allowed fp32, fp16, bf16"):
        aot.kernel_jobs((89,), ("f16",))
    with pytest.raises(ValueError, match="unknown kernel jobs"):
        aot.compile_jobs("/nonexistent", [("fp8_w8a16_gemm_kernel", 89, "int8")])


@pytest.mark.slow
def test_all_kernels_compile_for_every_target_sm(tmp_path):
    results = aot.compile_kernels_in_subprocess(tmp_path, SMS)
    names = tuple(s["name"] for s in aot.kernel_specs())
    assert names == ("fp8_w8a16_gemm_kernel", "nvfp4_w4a16_gemm_kernel", "nvfp4_moe_gate_up_kernel",
                     "nvfp4_moe_down_kernel", "dflash2_dynamic_conv_kernel")
    check_outputs(tmp_path, results, names)


def test_specs_name_every_kernel_argument():
    # Imported here, after collection, so this process's triton mode is whatever test_kernels set.
    from metrale.plugins.triton_mode import load_kernels, triton_interprets

    module = load_kernels("cpu" if triton_interprets() else "cuda")
    for spec in aot.kernel_specs("bf16") + aot.step_kernel_specs("bf16"):
        fn = getattr(module, spec["name"])
        assert list(fn.arg_names) == [a for a in fn.arg_names
                                      if a in spec["signature"] or a in spec["blocks"]]
        assert set(fn.arg_names) == set(spec["signature"]) | set(spec["blocks"])


def test_unknown_kernel_is_refused(tmp_path):
    # Refused before anything is compiled, so this runs in-process whatever triton's mode.
    with pytest.raises(ValueError, match=r"unknown kernels \['no_such_kernel'\]"):
        aot.compile_kernels(tmp_path, (89,), kernels=("no_such_kernel",))
    assert list(tmp_path.iterdir()) == []
