"""CPU-only TensorRT-RTX engine builds for the tiny engine, and the TensorRT import layer.

Engines are built for SM89 and SM120 with no GPU. Per drafter tier the quantized linears must
reach the engine by the expected path: NVFP4 on SM89 through the metrale plugin, on SM120
natively (FP4 DequantizeLinear); FP8 natively on both.
"""

from __future__ import annotations

import os

import pytest

from metrale.builder import trt_build as tb
from metrale.builder.trt_env import (
    TrtFlavor, TrtUnavailable, ensure_rtx_soname_link, load_trt,
)
from metrale.runtime.models import qlinear
from metrale.runtime.models.dflash import DynamicConv
from metrale.runtime.errors import ConfigError

SMS = (89, 120)


# -- the import layer (no TensorRT needed) ---------------------------------------------------


def test_soname_link_created_once_and_relative(tmp_path):
    (tmp_path / "libtensorrt_rtx.so.1").write_bytes(b"\x7fELF")
    link = ensure_rtx_soname_link(tmp_path)
    assert link == tmp_path / "libtensorrt_rtx.so"
    assert link.is_symlink() and os.readlink(link) == "libtensorrt_rtx.so.1"
    assert link.read_bytes() == b"\x7fELF"
    assert ensure_rtx_soname_link(tmp_path) == link  # idempotent


def test_soname_link_replaces_a_dangling_link(tmp_path):
    (tmp_path / "libtensorrt_rtx.so.1").write_bytes(b"lib")
    os.symlink("gone.so", tmp_path / "libtensorrt_rtx.so")
    link = ensure_rtx_soname_link(tmp_path)
    assert link.read_bytes() == b"lib"


def test_soname_link_skipped_without_the_versioned_library(tmp_path):
    assert ensure_rtx_soname_link(tmp_path) is None
    assert not (tmp_path / "libtensorrt_rtx.so").exists()


def test_flavor_values():
    assert TrtFlavor.parse("rtx") is TrtFlavor.RTX
    with pytest.raises(ConfigError, match="--trt-flavor 'cuda'.*auto, rtx, tensorrt, none"):
        TrtFlavor.parse("cuda")
    assert load_trt("none") is None


def test_full_tensorrt_needs_a_gpu_or_package():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(TrtUnavailable, match="--trt-flavor tensorrt"):
        load_trt("tensorrt")


# -- real builds with TensorRT-RTX -------------------------------------------------------------


@pytest.fixture(scope="module")
def rtx():
    pytest.importorskip("tensorrt_rtx")
    return load_trt("rtx")


def test_rtx_sm_check(rtx):
    assert {89, 120} <= set(rtx.supported_sms())
    with pytest.raises(ConfigError, match="--target-sm 89,90.*SM 90"):
        tb.check_sms(rtx, (89, 90), explicit=True)
    assert tb.check_sms(rtx, (89, 90), explicit=False) == (89,)


def _quantized(module) -> dict[str, int]:
    counts = {}
    for m in module.modules():
        if isinstance(m, (qlinear.Fp8Linear, qlinear.Nvfp4Linear)):
            op = "Fp8W8A16Gemm" if m.kind == "fp8" else "NvFp4W4A16Gemm"
            counts[op] = counts.get(op, 0) + 1
    return counts


def _convs(module) -> dict[str, int]:
    """DFlash2's dynamic convs: one plugin node each, on every SM (no native path)."""
    n = sum(isinstance(m, DynamicConv) for m in module.modules())
    return {"DFlash2DynamicConv": n} if n else {}


@pytest.mark.parametrize("tier", ["declared", "fp8", "fp8-aux", "nvfp4"])
def test_drafter_engines_per_tier(rtx, engine_factory, tmp_path, tier):
    from metrale.runtime.backends import load_engine

    engine = load_engine(engine_factory(tier), components=("dflash", "dflash2"))
    # The target and the head do not depend on the drafter tier: left out here.
    drafters = tb.StagedModels(target=None, drafters=engine.drafters)
    result = tb.write_engines(tmp_path, drafters, flavor="rtx", target_sm=SMS)
    assert result["trt_flavor"] == "rtx" and result["target_sm"] == list(SMS)
    for name, drafter in engine.drafters.items():
        info = result["components"][name]
        expected, convs = _quantized(drafter), _convs(drafter)
        assert bool(convs) == (name == "dflash2")
        # the portable graph: one node per quantized linear and per dynamic conv
        assert info["plugin_ops"] == {**expected, **convs}
        if tier == "declared":
            assert expected == {}
        for sm in SMS:
            built = info["engines"][str(sm)]
            path = tmp_path / built["file"]
            assert built["file"] == f"{name}/rank0.sm{sm}.engine"
            assert path.stat().st_size == built["bytes"] > 10_000
            # NVFP4 needs the plugin below SM100; FP8 is native from SM89.
            plugin = {**(expected if (tier == "nvfp4" and sm == 89) else {}), **convs}
            assert built["plugins"] == plugin
            # the cubins the build compiles: these layers' ops in the graph's dtype (float32)
            assert built["plugin_acts"] == {op: ["fp32"] for op in plugin}
        assert set(info["files"]) == {f"{name}/rank0.onnx"} | {f"{name}/rank0.sm{sm}.engine" for sm in SMS}
        assert info["tap_index"] == [0, 1, 2]


def test_target_and_nvfp4_mtp_engines(rtx, engine_factory, tmp_path):
    from metrale.runtime.backends import load_engine

    engine = load_engine(engine_factory("nvfp4", mtp_experts_nvfp4=True), components=("mtp",))
    result = tb.write_engines(tmp_path, engine, flavor="rtx", target_sm=SMS)
    target, mtp = result["components"]["target"], result["components"]["mtp"]
    assert target["plugin_ops"] == {} and "taps" not in target  # no drafter loaded: no taps
    assert _quantized(engine.mtp) == {"NvFp4W4A16Gemm": 27}  # 8 routed + 1 shared expert, 3 linears each
    # the 8 routed experts are one grouped node; the shared expert's 3 linears stay GEMMs
    assert mtp["plugin_ops"] == {"NvFp4MoeW4A16": 1, "NvFp4W4A16Gemm": 3}
    assert mtp["engines"]["89"]["plugins"] == mtp["plugin_ops"]
    assert mtp["engines"]["89"]["plugin_acts"] == {"NvFp4MoeW4A16": ["fp32"], "NvFp4W4A16Gemm": ["fp32"]}
    # SM120: the GEMMs dequantize FP4 natively; the grouped experts stay the plugin
    assert mtp["engines"]["120"]["plugins"] == {"NvFp4MoeW4A16": 1}
    assert mtp["engines"]["120"]["plugin_acts"] == {"NvFp4MoeW4A16": ["fp32"]}
    for name in ("target", "mtp"):
        for sm in SMS:
            built = result["components"][name]["engines"][str(sm)]
            assert (tmp_path / built["file"]).stat().st_size == built["bytes"] > 10_000


def test_export_and_build_into_a_writer_without_tensorrt(tiny_engine, tmp_path):
    from metrale.builder.recipe import BuildOptions
    from metrale.runtime.artifact.engine_dir import EngineDirWriter

    with EngineDirWriter(tmp_path / "eng") as w:
        result = tb.export_and_build(w, tiny_engine, BuildOptions(trt_flavor="none"))
    assert result["trt_flavor"] == "none" and result["target_sm"] == []
    assert result["skipped_sm"] == [89, 120]
    names = set(result["components"])
    assert names == {"target", "mtp", "dflash", "dflash2"}
    for name in names:
        assert result["components"][name]["engines"] == {}
        assert set(w.manifest.files) >= {f"{name}/rank0.onnx"}
    assert result["components"]["target"]["taps"] == [0, 1, 3]
    assert result["components"]["target"]["io"]["outputs"] == [
        "logits", "new_key", "new_value", "taps", "last_hidden"]


def test_engine_profile_ranges(tiny_engine):
    p = tb.EngineProfile(max_tokens=64, max_context=512)
    assert p.ranges("target", tiny_engine.target) == {"tokens": (1, 8, 64), "past": (1, 256, 512)}
    # The tiny drafter: block 8; its context positions come from the target's prefix.
    d = p.ranges("dflash", tiny_engine.drafters["dflash"])
    assert d["block"] == (1, 8, 8) and d["context"] == (1, 8, 64)


def test_kernel_library_reads_aot_output(tmp_path):
    import json

    from metrale.plugins.trt_plugin import KernelImage, KernelLibrary

    meta = {"kernel": "nvfp4_w4a16_gemm", "symbol": "nvfp4_w4a16_gemm_kernel", "sm": 89,
            "act": "bf16", "cubin": "nvfp4_w4a16_gemm.sm89.bf16.cubin", "num_warps": 4,
            "shared": 8192, "global_scratch_size": 0, "profile_scratch_size": 0,
            "constexprs": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}}
    (tmp_path / "nvfp4_w4a16_gemm.sm89.bf16.cubin").write_bytes(b"cubin-bytes")
    (tmp_path / "nvfp4_w4a16_gemm.sm89.bf16.json").write_text(json.dumps(meta))
    lib = KernelLibrary.from_dir(tmp_path)
    assert lib.images == {"nvfp4_w4a16_gemm.sm89.bf16": KernelImage(
        b"cubin-bytes", "nvfp4_w4a16_gemm_kernel", 4, 8192, 16, 64,
        constexprs={"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64})}
    assert lib.missing(["nvfp4_w4a16_gemm.sm89.fp32", "nvfp4_w4a16_gemm.sm89.bf16"]) == [
        "nvfp4_w4a16_gemm.sm89.fp32"]
    with pytest.raises(RuntimeError, match="no kernel 'nvfp4_w4a16_gemm.sm89.fp32'.*have: "
                                           r"nvfp4_w4a16_gemm\.sm89\.bf16"):
        lib.function("nvfp4_w4a16_gemm.sm89.fp32")  # same op and SM, another dtype: refused
    # a folder compiled before kernels were keyed by dtype is refused, naming the file
    (tmp_path / "nvfp4_w4a16_gemm.sm89.bf16.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "act"}))
    with pytest.raises(ValueError, match=r"nvfp4_w4a16_gemm\.sm89\.bf16\.json: no activation dtype"):
        KernelLibrary.from_dir(tmp_path)


def test_plugin_creators_registered_per_sm(rtx):
    from metrale.plugins.trt_plugin import register_plugins

    first = register_plugins(rtx.trt, 89)
    again = register_plugins(rtx.trt, 120)  # replaces, never duplicates
    registry = rtx.trt.get_plugin_registry()
    for op in ("Fp8W8A16Gemm", "NvFp4W4A16Gemm"):
        assert registry.get_creator(op, "1", "") is not None
        assert again.creators[op].sm == 120 and first.creators[op].sm == 89


def _gemm_graph(extra_fp32_node: bool = True):
    """One NVFP4 GEMM node on x in bfloat16 and (optionally) one on x cast to float32."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    n, k = 16, 32
    inits = [numpy_helper.from_array(np.zeros((n, k // 2), np.int8), "packed"),
             numpy_helper.from_array(np.zeros((n, k // 16), np.int8), "scales"),
             numpy_helper.from_array(np.array(1.0, np.float32), "gs")]
    gemm = lambda x, y, name: helper.make_node("NvFp4W4A16Gemm", [x, "packed", "scales", "gs"],  # noqa: E731
                                               [y], name=name, domain="metrale")
    nodes = [gemm("x", "y16", "bf16_gemm")]
    outputs = [helper.make_tensor_value_info("y16", TensorProto.BFLOAT16, [2, n])]
    if extra_fp32_node:
        nodes += [helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
                  gemm("x32", "y32", "fp32_gemm")]
        outputs.append(helper.make_tensor_value_info("y32", TensorProto.FLOAT, [2, n]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16,
                                                                         [2, k])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid("metrale", 1)])
    return model, gemm


def _parse(trt, model):
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(model.SerializeToString())
    return builder, network, parser


def test_plugin_layers_report_the_activation_dtype_they_run_in(rtx):
    # x in bfloat16, and x cast to float32: the parsed, strongly typed network says which cubin
    # each plugin layer launches — bf16 for one, fp32 for the other
    from metrale.plugins.trt_plugin import register_plugins

    model, gemm = _gemm_graph()
    trt = rtx.trt
    plugins = register_plugins(trt, 89)  # noqa: F841 - held while the network uses them
    _, network, _ = _parse(trt, model)
    assert tb.plugin_activations(trt, network, model, "g") == {"NvFp4W4A16Gemm": ["bf16", "fp32"]}
    model.graph.node.append(gemm("x32", "y_extra", "third"))  # a node the network lacks
    with pytest.raises(tb.EngineBuildError, match="3 metrale kernel nodes became 2 plugin layers"):
        tb.plugin_activations(trt, network, model, "g")


def test_plugin_objects_are_released_when_tensorrt_destroys_them(rtx):
    # TensorRT holds the Python plugins by borrowed pointers and calls destroy() when it is done:
    # the keeper then lets them go, so builds (and contexts) come and go without it growing
    import gc

    from metrale.builder.trt_env import rtx_compute_capabilities
    from metrale.plugins.trt_plugin import register_plugins

    trt = rtx.trt
    plugins = register_plugins(trt, 89)
    keeper = plugins.library.keep_alive
    model, _ = _gemm_graph(extra_fp32_node=False)
    for _ in range(2):
        builder, network, parser = _parse(trt, model)
        assert len(keeper) >= 1  # the node's plugin, held while the network lives
        config = builder.create_builder_config()
        config.num_compute_capabilities = 1
        config.set_compute_capability(rtx_compute_capabilities(trt)[89], 0)
        assert builder.build_serialized_network(network, config) is not None
        del builder, network, parser, config
        gc.collect()
        assert len(keeper) == 0
