"""ONNX export of the engine components: adapters vs the runtime, graphs vs torch, SM lowering.

Graphs with only standard ops run in onnxruntime; graphs with metrale-domain nodes or FP4
DequantizeLinear (which onnxruntime does not implement) run in `onnx.reference` with the two
metrale ops below, whose math is the plugins' PyTorch references. They read their weight inputs
as raw bytes, so they also run the SM-lowered graphs whose plugin weights are retyped int8.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from torch import nn

from metrale.builder import onnx_export as ox
from metrale.plugins import onnx_lowering as lw
from metrale.plugins.fp8_gemm import fp8_w8a16_gemm
from metrale.plugins.dynamic_conv import dflash2_dynamic_conv
from metrale.plugins.nvfp4_gemm import nvfp4_w4a16_gemm
from metrale.plugins.nvfp4_moe import nvfp4_moe_w4a16
from metrale.runtime.models import qlinear
from metrale.runtime.models.dflash import DynamicConv
from metrale.runtime.models.layers import MoE, stack_nvfp4_experts


def _bytes(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).copy())


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True))


class Fp8W8A16Gemm(OpRun):
    op_domain = "metrale"

    def _run(self, x, w, scale):
        y = fp8_w8a16_gemm(_t(x), _bytes(w).view(torch.float8_e4m3fn), _t(scale))
        return (y.numpy(),)


class NvFp4W4A16Gemm(OpRun):
    op_domain = "metrale"

    def _run(self, x, packed, block_scale, global_scale):
        y = nvfp4_w4a16_gemm(_t(x), _bytes(packed), _bytes(block_scale).view(torch.float8_e4m3fn),
                             _t(global_scale).float())
        return (y.numpy(),)


class DFlash2DynamicConv(OpRun):
    op_domain = "metrale"

    def _run(self, x, kernel, block=None):
        return (dflash2_dynamic_conv(_t(x), _t(kernel), int(block)).numpy(),)


class NvFp4MoeW4A16(OpRun):
    op_domain = "metrale"

    def _run(self, x, ids, w, gu_p, gu_s, gu_g, dn_p, dn_s, dn_g):
        fp8 = lambda a: _bytes(a).view(torch.float8_e4m3fn)  # noqa: E731
        y = nvfp4_moe_w4a16(_t(x), _t(ids), _t(w), _bytes(gu_p), fp8(gu_s), _t(gu_g).float(),
                            _bytes(dn_p), fp8(dn_s), _t(dn_g).float())
        return (y.numpy(),)


RAW_BYTE_OPS = [Fp8W8A16Gemm, NvFp4W4A16Gemm, DFlash2DynamicConv, NvFp4MoeW4A16]


def _has_fp4(model: onnx.ModelProto) -> bool:
    return any(t.data_type == TensorProto.FLOAT4E2M1 for t in model.graph.initializer)


def run_graph(model: onnx.ModelProto, feeds: dict) -> tuple[str, list[np.ndarray]]:
    if lw.metrale_ops(model) or _has_fp4(model):
        ref = ReferenceEvaluator(model, new_ops=RAW_BYTE_OPS)
        return "reference", ref.run(None, feeds)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return "onnxruntime", sess.run(None, feeds)


# -- one quantized linear, hand-worked values ----------------------------------------------


class OneLinear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.proj = linear

    def forward(self, x):
        return self.proj(x)


IO = ox.GraphIO(("x",), ("y",), {"x": {1: "t"}, "y": {1: "t"}})


def _init_types(model):
    return {t.name.rsplit(".", 1)[-1]: (t.data_type, list(t.dims)) for t in model.graph.initializer}


def test_fp8_linear_node_and_lowerings():
    # W = [[1, 2], [3, 4]] (exact in E4M3), row scales [0.5, 2]; x = [1, 2]:
    # y0 = (1·1 + 2·2)·0.5 = 2.5, y1 = (1·3 + 2·4)·2 = 22.
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).to(torch.float8_e4m3fn)
    lin = qlinear.Fp8Linear(w, torch.tensor([0.5, 2.0]), None)
    model = ox.export_module(OneLinear(lin), (torch.ones(1, 3, 2),), IO)
    x = np.array([[[1.0, 2.0]]], dtype=np.float32)
    (node,) = [n for n in model.graph.node if n.domain == "metrale"]
    assert node.op_type == "Fp8W8A16Gemm"
    assert {(o.domain, o.version) for o in model.opset_import} >= {("metrale", 1)}
    types = _init_types(model)
    assert types["weight"] == (TensorProto.FLOAT8E4M3FN, [2, 2])
    assert types["weight_scale"] == (TensorProto.FLOAT, [2])
    assert isinstance(model.graph.node[0], onnx.NodeProto)
    for sm, engine, ops in [(None, "reference", {"Fp8W8A16Gemm": 1}), (86, "reference", {"Fp8W8A16Gemm": 1}),
                            (89, "onnxruntime", {}), (120, "onnxruntime", {})]:
        g = model if sm is None else lw.lower_for_sm(model, sm)
        assert lw.metrale_ops(g) == ops
        how, (y,) = run_graph(g, {"x": x})
        assert how == engine
        np.testing.assert_array_equal(y, [[[2.5, 22.0]]])
    # Below SM89 the plugin gets the FP8 bits as int8; on SM89 a per-row DequantizeLinear.
    low = lw.lower_for_sm(model, 86)
    weight = next(t for t in low.graph.initializer if t.name.endswith("weight"))
    assert weight.data_type == TensorProto.INT8 and weight.raw_data == w.view(torch.uint8).numpy().tobytes()
    dq = [n for n in lw.lower_for_sm(model, 89).graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == 1 and dq[0].attribute[0].name == "axis" and dq[0].attribute[0].i == 0
    assert all(o.domain != "metrale" for o in lw.lower_for_sm(model, 89).opset_import)


def test_nvfp4_linear_node_and_lowerings():
    # Row 0 codes (2, 9, 7, 0...) = (1.0, -0.5, 6.0, 0...), row 1 all code 1 (0.5); element 2i
    # is the low nibble: bytes 0x92, 0x07, 0... and 0x11 × 8. Block scales 2 and 4 times the
    # global 0.25 give 0.5 and 1.0. With x = ones(16): y0 = (1 − 0.5 + 6)·0.5 = 3.25,
    # y1 = 16·0.5·1.0 = 8.
    packed = torch.zeros(2, 8, dtype=torch.uint8)
    packed[0, 0], packed[0, 1], packed[1, :] = 0x92, 0x07, 0x11
    bs = torch.tensor([[2.0], [4.0]]).to(torch.float8_e4m3fn)
    lin = qlinear.Nvfp4Linear(packed, bs, torch.tensor(0.25), None)
    model = ox.export_module(OneLinear(lin), (torch.ones(1, 3, 16),), IO)
    types = _init_types(model)
    assert types["weight"] == (TensorProto.UINT8, [2, 8])
    assert types["weight_scale"] == (TensorProto.FLOAT8E4M3FN, [2, 1])
    assert types["weight_scale_2"] == (TensorProto.FLOAT, [])
    x = np.ones((1, 1, 16), dtype=np.float32)
    for sm, ops in [(None, {"NvFp4W4A16Gemm": 1}), (89, {"NvFp4W4A16Gemm": 1}), (120, {})]:
        g = model if sm is None else lw.lower_for_sm(model, sm)
        assert lw.metrale_ops(g) == ops
        _, (y,) = run_graph(g, {"x": x})
        np.testing.assert_array_equal(y, [[[3.25, 8.0]]])
    sm120 = lw.lower_for_sm(model, 120)
    fp4 = [t for t in sm120.graph.initializer if t.data_type == TensorProto.FLOAT4E2M1]
    assert len(fp4) == 1 and list(fp4[0].dims) == [2, 16]
    assert fp4[0].raw_data == packed.numpy().tobytes()  # the same bytes, reinterpreted
    dqs = [n for n in sm120.graph.node if n.op_type == "DequantizeLinear"]
    assert [{a.name: a.i for a in n.attribute} for n in dqs] == [{}, {"axis": 1, "block_size": 16}]
    assert max(o.version for o in sm120.opset_import if o.domain == "") == 23
    sm89 = lw.lower_for_sm(model, 89)
    assert {t.name.rsplit(".", 1)[-1]: t.data_type for t in sm89.graph.initializer} == {
        "weight": TensorProto.INT8, "weight_scale": TensorProto.INT8, "weight_scale_2": TensorProto.FLOAT}


# -- adapters vs the runtime's own cached forward ---------------------------------------------


def _stale(cache_tensor, valid):
    """A copy with garbage past `valid`: the adapters must mask it out."""
    out = cache_tensor.clone()
    out[..., valid:, :] = 7.0
    return out


def test_target_step_matches_runtime_forward(tiny_engine):
    model = tiny_engine.target
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=gen)
    new = torch.randint(0, model.config.vocab_size, (1, 3), generator=gen)
    taps = (3, 0)
    cache = model.new_cache(1, 12)
    with torch.no_grad():
        model(prompt, cache)
        pk, pv = _stale(cache.k, 5), _stale(cache.v, 5)
        ref = model(new, cache, taps=taps)
        causal = torch.ones(3, 3, dtype=torch.bool).tril()
        logits, nk, nv, tapped, last = ox.TargetStep(model, taps)(new, pk, pv, torch.tensor([5]), causal)
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tapped, ref.taps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, ref.last_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nk, cache.k[:, :, :, 5:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nv, cache.v[:, :, :, 5:8], atol=1e-5, rtol=1e-5)


def test_target_step_runs_a_draft_trees_rows_as_the_eager_tree_forward(tiny_engine):
    """With a tree's mask, each new row sits at the position its depth gives and sees the past
    and its ancestors only: the eager model's one tree forward (`TreeKV`)."""
    from metrale.runtime.models.step_caches import TreeKV
    from metrale.runtime.spec.ddtree import Tree

    model = tiny_engine.target
    gen = torch.Generator().manual_seed(4)
    parents, depths = [-1], [0]
    for i in range(1, 9):
        parents.append(int(torch.randint(0, i, (1,), generator=gen)))
        depths.append(depths[parents[-1]] + 1)
    tree = Tree(tuple(torch.randint(0, model.config.vocab_size, (9,), generator=gen).tolist()),
                tuple(parents), tuple(depths))
    assert max(depths) < 8  # not a chain: some rows must hide drafts before them
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=gen)
    cache = model.new_cache(1, 20)
    with torch.no_grad():
        model(prompt, cache)
        pk, pv = _stale(cache.k, 5), _stale(cache.v, 5)
        ref = model(torch.tensor([tree.tokens]), TreeKV(cache, tree), taps=(1,))
        logits, nk, nv, tapped, _ = ox.TargetStep(model, (1,))(
            torch.tensor([tree.tokens]), pk, pv, torch.tensor([5]), tree.mask())
        chain = ox.TargetStep(model, (1,))(torch.tensor([tree.tokens]), pk, pv, torch.tensor([5]),
                                           torch.ones(9, 9, dtype=torch.bool).tril())[0]
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tapped, ref.taps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nk, cache.k[:, :, :, 5:14], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits, chain, atol=1e-3)  # the mask matters: a chain's rows differ


def test_mtp_step_matches_runtime_forward(tiny_engine):
    head = tiny_engine.mtp
    h = head.config.decoder.hidden_size
    gen = torch.Generator().manual_seed(1)
    emb, hid = torch.randn(1, 6, h, generator=gen), torch.randn(1, 6, h, generator=gen)
    cache = head.new_cache(1, 10, torch.float32)
    with torch.no_grad():
        head(emb[:, :4], hid[:, :4], cache)
        pk, pv = _stale(cache.k, 4), _stale(cache.v, 4)
        ref_logits, ref_h = head(emb[:, 4:], hid[:, 4:], cache)
        logits, h_out, nk, nv = ox.MTPStep(head)(emb[:, 4:], hid[:, 4:], pk, pv, torch.tensor([4]))
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h_out, ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nk, cache.k[:, :, :, 4:6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nv, cache.v[:, :, :, 4:6], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_dflash_propose_matches_runtime(tiny_engine, name):
    d = tiny_engine.drafters[name]
    cfg = d.config
    gen = torch.Generator().manual_seed(2)
    feats = torch.randn(1, 6, cfg.num_context_features * cfg.target_hidden_size, generator=gen)
    block = torch.randn(1, cfg.block_size, cfg.decoder.hidden_size, generator=gen)
    cache = d.new_cache(1, 16, torch.float32)
    with torch.no_grad():
        d.add_context(feats[:, :4], cache)
        pk, pv = _stale(cache.k, 4), _stale(cache.v, 4)
        outs = ox.DFlashPropose(d)(feats[:, 4:], pk, pv, torch.tensor([4]), block)
        d.add_context(feats[:, 4:], cache)
        hidden, logits = d.forward_block(block, cache)
    nk, nv, o_hidden, o_logits = outs[:4]
    torch.testing.assert_close(o_hidden, hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o_logits, logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nk, cache.k[:, :, :, 4:6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nv, cache.v[:, :, :, 4:6], atol=1e-5, rtol=1e-5)
    if cfg.version == 2:
        sel = d.candidate_selector.hidden_projection(hidden)
        torch.testing.assert_close(outs[4], sel, atol=1e-5, rtol=1e-5)
    else:
        assert len(outs) == 4


# -- whole component graphs vs torch -----------------------------------------------------------


def _components(engine):
    yield "target", engine.target, (0, 1, 3)
    yield "mtp", engine.mtp, ()
    for d in engine.drafters.values():
        yield "dflash", d, ()


def _check_component(kind, module, taps):
    model = ox.export_component(kind, module, taps=taps)
    onnx.checker.check_model(model)
    gio = ox.graph_io(kind, module, taps)
    # Other lengths than the trace's (t=3, past=4, context=2): the axes must be dynamic.
    ins = ox.example_inputs(kind, module, t=5, past=9, position=6, context=3, seed=4)
    with torch.no_grad():
        ref = ox.adapter(kind, module, taps)(*ins)
    feeds = {n: v.numpy() for n, v in zip(gio.inputs, ins)}
    for sm in (None, 89, 120, "onnxruntime"):
        g = (model if sm is None else lw.lower_for_onnxruntime(model) if sm == "onnxruntime"
             else lw.lower_for_sm(model, sm))
        how, outs = run_graph(g, feeds)
        assert how == "onnxruntime" or sm != "onnxruntime"  # standard ops only
        assert [o.name for o in g.graph.output] == list(gio.outputs)
        diff = max(float(np.abs(o - r.numpy()).max()) for o, r in zip(outs, ref))
        assert diff < 5e-5, (kind, sm, how, diff)
    return model


@pytest.fixture(scope="module")
def nvfp4_engine(engine_factory):
    from metrale.runtime.backends import load_engine

    return load_engine(engine_factory("nvfp4", mtp_experts_nvfp4=True))


def _kernel_nodes(module) -> dict[str, int]:
    """The op nodes a component's graph holds besides its quantized linears: one per DFlash2
    dynamic conv and one per MoE of NVFP4 experts."""
    convs = sum(isinstance(m, DynamicConv) for m in module.modules())
    grouped = sum(isinstance(m, MoE) and stack_nvfp4_experts(m.experts) is not None
                  for m in module.modules())
    return {k: n for k, n in (("DFlash2DynamicConv", convs), ("NvFp4MoeW4A16", grouped)) if n}


def test_fp8_engine_graphs_match_torch(tiny_engine):
    for kind, module, taps in _components(tiny_engine):
        model = _check_component(kind, module, taps)
        quantized = sum(isinstance(m, qlinear.Fp8Linear) for m in module.modules())
        assert lw.metrale_ops(model) == {**({"Fp8W8A16Gemm": quantized} if quantized else {}),
                                         **_kernel_nodes(module)}
        assert lw.metrale_ops(lw.lower_for_onnxruntime(model)) == {}


def test_nvfp4_engine_graphs_match_torch(nvfp4_engine):
    # the MTP head's routed experts are NVFP4 too (--mtp-experts-nvfp4): one grouped node, and
    # only the shared expert's linears are GEMM nodes
    grouped = [m for m in nvfp4_engine.mtp.modules() if isinstance(m, MoE)]
    assert grouped and all(stack_nvfp4_experts(m.experts) is not None for m in grouped)
    for kind, module, taps in _components(nvfp4_engine):
        model = _check_component(kind, module, taps)
        routed = {id(lin) for m in module.modules() if isinstance(m, MoE)
                  and stack_nvfp4_experts(m.experts) is not None for lin in m.experts.modules()}
        quantized = sum(isinstance(m, qlinear.Nvfp4Linear) and id(m) not in routed
                        for m in module.modules())
        kernels = _kernel_nodes(module)
        assert lw.metrale_ops(model) == {**({"NvFp4W4A16Gemm": quantized} if quantized else {}),
                                         **kernels}
        assert lw.metrale_ops(lw.lower_for_sm(model, 120)) == kernels  # no native path for these
        assert lw.metrale_ops(lw.lower_for_onnxruntime(model)) == {}


def test_export_leaves_the_model_unchanged(nvfp4_engine):
    d = nvfp4_engine.drafters["dflash"]
    before = [type(m) for m in d.modules()]
    ox.export_component("dflash", d)
    assert [type(m) for m in d.modules()] == before
    assert isinstance(d.lm_head, qlinear.Nvfp4Linear)


def test_unknown_kind_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="allowed: target, mtp, dflash"):
        ox.graph_io("medusa", tiny_engine.target)


def test_portable_graph_runs_with_the_plugins_reference_ops(nvfp4_engine):
    onnx_ops = pytest.importorskip("metrale.plugins.onnx_ops")
    d = nvfp4_engine.drafters["dflash2"]
    model = ox.export_component("dflash", d)
    gio = ox.graph_io("dflash", d)
    ins = ox.example_inputs("dflash", d, past=5, position=3, context=4, seed=7)
    with torch.no_grad():
        ref = ox.DFlashPropose(d)(*ins)
    feeds = {n: v.numpy() for n, v in zip(gio.inputs, ins)}
    outs = ReferenceEvaluator(model, new_ops=onnx_ops.REFERENCE_OPS).run(None, feeds)
    for o, r in zip(outs, ref):
        np.testing.assert_allclose(o, r.numpy(), atol=5e-5, rtol=0)


def test_a_linear_of_an_unknown_format_is_refused_not_exported_as_nvfp4():
    lin = qlinear.Nvfp4Linear(torch.zeros(2, 8, dtype=torch.uint8),
                              torch.ones(2, 1).to(torch.float8_e4m3fn), torch.tensor(0.25), None)
    lin.kind = "mxfp8"  # a format the export has no node for
    with pytest.raises(ValueError, match="'mxfp8' linear has no metrale ONNX node"):
        ox._ExportLinear(lin)(torch.ones(1, 16))
