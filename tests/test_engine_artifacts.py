"""`metrale build --trt-flavor rtx` end to end: ONNX graphs, engines and cubins land in the engine
directory with checksums, and an altered engine or cubin is refused naming the file."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from metrale.runtime.backends import load_engine
from metrale.runtime.artifact.engine_dir import load_manifest
from metrale.runtime.errors import EngineDirError

pytest.importorskip("tensorrt_rtx")
# only look for triton: importing it here would fix its mode before the kernel tests can turn
# on the interpreter (the cubins are compiled in a subprocess anyway)
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (the kernels extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def built(engine_factory):
    return engine_factory("nvfp4", trt_flavor="rtx", target_sm=(89,), mtp_experts_nvfp4=True)


def test_engines_onnx_and_cubins_are_recorded(built):
    m = load_manifest(built)
    assert m.build["trt_flavor"] == "rtx" and m.build["engine_sm"] == [89]
    for name in ("target", "mtp", "dflash", "dflash2"):
        assert f"{name}/rank0.onnx" in m.files
        assert f"{name}/rank0.sm89.engine" in m.files
        assert m.files[f"{name}/rank0.sm89.engine"]["size"] > 100_000
    # NVFP4 has no native path below SM100: the drafters' GEMMs are plugin layers, whose
    # kernels are compiled to cubins for the SM and shipped in plugins/
    q = m.components["dflash"].quant_algo
    assert m.components["dflash"].engines["89"].plugins == {"NvFp4W4A16Gemm": len(q.quantized_modules)}
    # the engines are exported in bfloat16 (--trt-dtype's default): the plugin layers run bf16
    # activations, and exactly that cubin (kernel, SM, dtype) is compiled — no other kernel,
    # dtype or SM
    assert m.build["trt_dtype"] == "bfloat16"
    assert m.components["dflash"].engines["89"].plugin_acts == {"NvFp4W4A16Gemm": ["bf16"]}
    # DFlash2's dynamic convs are plugin layers too: their kernel ships beside the GEMM's
    assert m.components["dflash2"].engines["89"].plugin_acts == {
        "DFlash2DynamicConv": ["bf16"], "NvFp4W4A16Gemm": ["bf16"]}
    # the MTP head's NVFP4 routed experts are one grouped plugin layer, in bf16 too: its two
    # kernels ship as well
    assert m.components["mtp"].engines["89"].plugin_acts == {
        "NvFp4MoeW4A16": ["bf16"], "NvFp4W4A16Gemm": ["bf16"]}
    kernels = ("dflash2_dynamic_conv", "nvfp4_moe_down", "nvfp4_moe_gate_up", "nvfp4_w4a16_gemm")
    assert sorted(f for f in m.files if f.startswith("plugins/")) == [
        f"plugins/{k}.sm89.bf16.{ext}" for k in kernels for ext in ("cubin", "json")]
    assert [(p["kernel"], p["sm"], p["act"]) for p in m.plugins] == [(k, 89, "bf16") for k in kernels]


@pytest.mark.parametrize("victim", ["dflash/rank0.sm89.engine",
                                    "plugins/nvfp4_w4a16_gemm.sm89.bf16.cubin"])
def test_altered_engine_or_cubin_is_refused(built, tmp_path, victim):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    f = copy / victim
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(EngineDirError, match=victim.replace(".", r"\.")):
        load_engine(copy)
