"""ONNX faces of the metrale ops: nodes in the `metrale` domain evaluated on CPU with
`onnx.reference.ReferenceEvaluator` and the OpRun classes, checked against the torch references
and against hand-worked values."""

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from metrale.plugins import dynamic_conv, fp8_gemm, nvfp4_gemm, nvfp4_moe
from metrale.plugins import onnx_ops
from metrale.plugins.onnx_ops import REFERENCE_OPS, to_numpy, to_torch


def run_graph(nodes, inputs, outputs, feeds, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    onnx_ops.opset_import()])
    onnx.checker.check_model(model)
    return ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None, feeds)


def init(name, t: torch.Tensor):
    return numpy_helper.from_array(to_numpy(t), name)


def vinfo(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def test_opset_import_and_domain():
    assert (onnx_ops.opset_import().domain, onnx_ops.opset_import().version) == ("metrale", 1)
    node = onnx_ops.dflash2_dynamic_conv_node("x", "k", "y", block=4)
    assert (node.domain, node.op_type, node.attribute[0].name, node.attribute[0].i) == (
        "metrale", "DFlash2DynamicConv", "block", 4)


def test_bits_cross_between_numpy_and_torch():
    t = torch.tensor([1.5, -448.0, 0.001953125]).to(torch.float8_e4m3fn)
    a = to_numpy(t)
    assert a.dtype == ml_dtypes.float8_e4m3fn and a.view(np.uint8).tolist() == [0x3C, 0xFE, 0x01]
    assert torch.equal(to_torch(a).view(torch.uint8), t.view(torch.uint8))
    b = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    assert to_numpy(b).astype(np.float32).tolist() == [1.0, -2.5]


def test_fp8_gemm_node_hand_example():
    # y = x @ (w * scale).T: w rows [1, -2] * 0.5 and [0.5, 448] * 2.
    w = torch.tensor([[1.0, -2.0], [0.5, 448.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.5, 2.0])
    x = np.array([[1.0, 1.0], [2.0, 0.0]], dtype=np.float32)
    (y,) = run_graph([onnx_ops.fp8_w8a16_gemm_node("x", "w", "s", "y")],
                     [vinfo("x", TensorProto.FLOAT, [2, 2])], [vinfo("y", TensorProto.FLOAT, [2, 2])],
                     {"x": x}, [init("w", w), init("s", scale)])
    assert y.tolist() == [[-0.5, 897.0], [1.0, 2.0]]


def test_nvfp4_gemm_node_bf16_matches_reference():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 32), generator=gen, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    bs = (torch.rand(8, 2, generator=gen) * 100 + 1).to(torch.float8_e4m3fn)
    gs = torch.tensor(0.01)
    x = torch.randn(3, 32, generator=gen).to(torch.bfloat16)
    (y,) = run_graph([onnx_ops.nvfp4_w4a16_gemm_node("x", "p", "bs", "gs", "y")],
                     [vinfo("x", TensorProto.BFLOAT16, [3, 32])],
                     [vinfo("y", TensorProto.BFLOAT16, [3, 8])],
                     {"x": to_numpy(x)}, [init("p", packed), init("bs", bs), init("gs", gs)])
    expected = nvfp4_gemm.nvfp4_w4a16_gemm(x, packed, bs, gs)
    assert y.dtype == ml_dtypes.bfloat16 and torch.equal(to_torch(y), expected)
    assert expected.abs().max() > 0


def test_moe_node_matches_reference():
    gen = torch.Generator().manual_seed(2)
    e, h, i, t, k = 3, 16, 16, 4, 2

    def quant(*shape, globals_per_expert=()):
        codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        bs = (torch.rand(*shape[:-1], shape[-1] // 16, generator=gen) * 50 + 1)
        return (packed, bs.to(torch.float8_e4m3fn),
                torch.rand(e, *globals_per_expert, generator=gen) * 0.01)

    gu, dn = quant(e, 2 * i, h, globals_per_expert=(2,)), quant(e, h, i)
    x = torch.randn(t, h, generator=gen)
    ids = torch.tensor([[0, 2], [1, 0], [2, 2], [1, 1]])
    w = torch.rand(t, k, generator=gen)
    names = ["gup", "gus", "gug", "dnp", "dns", "dng"]
    inits = [init(n, v) for n, v in zip(names, [*gu, *dn])]
    node = onnx_ops.nvfp4_moe_w4a16_node("x", "ids", "w", *names, "y")
    (y,) = run_graph([node], [vinfo("x", TensorProto.FLOAT, [t, h]),
                              vinfo("ids", TensorProto.INT64, [t, k]),
                              vinfo("w", TensorProto.FLOAT, [t, k])],
                     [vinfo("y", TensorProto.FLOAT, [t, h])],
                     {"x": x.numpy(), "ids": ids.numpy(), "w": w.numpy()}, inits)
    expected = nvfp4_moe.nvfp4_moe_w4a16(x, ids, w, *gu, *dn)
    assert torch.equal(torch.from_numpy(y), expected) and expected.abs().max() > 0


def test_dynamic_conv_node_hand_example():
    # One batch, 4 slots in blocks of 2, H=2, G=1: y[t] = k0[t] x[t] + k1[t] x[t-1] (not at t=0, 2).
    x = np.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]], dtype=np.float32)
    kern = np.array([[[[2.0, 10.0]], [[1.0, 1.0]], [[0.5, 10.0]], [[0.0, -1.0]]]],
                    dtype=np.float32)  # [1, 4, 1, 2]
    (y,) = run_graph([onnx_ops.dflash2_dynamic_conv_node("x", "k", "y", block=2)],
                     [vinfo("x", TensorProto.FLOAT, [1, 4, 2]),
                      vinfo("k", TensorProto.FLOAT, [1, 4, 1, 2])],
                     [vinfo("y", TensorProto.FLOAT, [1, 4, 2])], {"x": x, "k": kern})
    assert y.tolist() == [[[2.0, 4.0], [4.0, 6.0], [2.5, 3.0], [-5.0, -6.0]]]
    ref = dynamic_conv.dflash2_dynamic_conv(torch.from_numpy(x), torch.from_numpy(kern), 2)
    assert ref.tolist() == y.tolist()


def test_fp8_reference_node_rejects_bad_shapes():
    w = torch.ones(3, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="input features"):
        fp8_gemm.fp8_w8a16_gemm(torch.ones(2, 5), w, torch.ones(3))
