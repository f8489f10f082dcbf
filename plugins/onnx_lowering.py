"""Rewrites of a portable ONNX graph (metrale-domain nodes for the quantized linears) for the
runtime that executes it.

- `lower_for_sm`: for a TensorRT engine of one SM. Where TensorRT has a native path (FP8 from
  SM89, FP4 from SM100) a node becomes standard ops — per-row DequantizeLinear + MatMul, or the
  FP4 E2M1 block-16 double DequantizeLinear (opset 23) — and otherwise stays a node for the
  TensorRT plugin (`plugins.trt_plugin`), its uint8 and FP8 weight tensors retyped int8 holding
  the same bytes (see `_bytes_as_int8` for why).
- `lower_for_onnxruntime`: for onnxruntime's CPU kernels, which have no FP4 and no bfloat16 math
  and would dequantize an FP8 weight at every call. Each quantized weight is dequantized once
  here, through its format's `dequantize` (the bytes' one definition, which the torch backend
  uses too), into a float32 initializer feeding a MatMul; a bfloat16 graph is widened to float32 (`widen_to_float32`: its weights are bfloat16 values,
  exact in float32, so it computes what the torch backend computes at `--dtype float32`).

The portable graph's nodes: `Fp8W8A16Gemm(x, w FLOAT8E4M3FN [N, K], scale f32 [N])` and
`NvFp4W4A16Gemm(x, packed uint8 [N, K/2], block_scale FLOAT8E4M3FN [N, K/16], global_scale f32 [])`.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from metrale.plugins.formats import FORMATS
from metrale.plugins.nvfp4_moe import dense_experts

DOMAIN = "metrale"
FP4_OPSET = 23  # FLOAT4E2M1 DequantizeLinear
FP8_OP, NVFP4_OP = FORMATS["fp8"].onnx_op, FORMATS["nvfp4"].onnx_op
CONV_OP = "DFlash2DynamicConv"  # `plugins.dynamic_conv`: x [B, T, H], kernel [B, T, G, 2]; block
MOE_OP = "NvFp4MoeW4A16"  # `plugins.nvfp4_moe`: the grouped NVFP4 experts of a MoE
_FLOATS = (TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT16)


def native_fp8(sm: int) -> bool:  # TensorRT's FP8 DequantizeLinear path: Ada and newer
    return FORMATS["fp8"].native(sm)


def native_fp4(sm: int) -> bool:  # E2M1 tensors: Blackwell (SM100/SM120) and newer
    return FORMATS["nvfp4"].native(sm)


def metrale_ops(model: onnx.ModelProto) -> dict[str, int]:
    """Count of metrale-domain nodes by op type (what the TensorRT plugins must cover)."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain == DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _fold_weight_identities(out.graph)
    return out


def _finish(out: onnx.ModelProto, fp4: bool = False) -> onnx.ModelProto:
    """Drop initializers no node reads, the custom domain when no node of it is left, and raise
    the opset for FP4 DequantizeLinear."""
    used = {name for n in out.graph.node for name in n.input}
    keep = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    if not metrale_ops(out):  # nothing left for a plugin: no custom domain to declare
        keep_ops = [op for op in out.opset_import if op.domain != DOMAIN]
        del out.opset_import[:]
        out.opset_import.extend(keep_ops)
    for op in out.opset_import if fp4 else ():
        if op.domain in ("", "ai.onnx"):
            op.version = max(op.version, FP4_OPSET)
    return out


def lower_for_sm(model: onnx.ModelProto, sm: int) -> onnx.ModelProto:
    """A copy of the portable graph with native standard-op paths wherever `sm` has them."""
    out = _copy(model)
    inits = {t.name: t for t in out.graph.initializer}
    elem = _value_types(out)
    nodes, fp4 = [], False
    for node in out.graph.node:
        if node.domain == DOMAIN and node.op_type == FP8_OP and native_fp8(sm):
            nodes += _fp8_native(node, elem)
        elif node.domain == DOMAIN and node.op_type == NVFP4_OP and native_fp4(sm):
            nodes += _fp4_native(node, elem, inits, out.graph)
            fp4 = True
        else:
            if node.domain == DOMAIN:
                for name in node.input[1:]:
                    if name in inits:  # a scalar scale may be a Constant node: float, kept
                        _bytes_as_int8(inits[name])
            nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return _finish(out, fp4)


def lower_for_onnxruntime(model: onnx.ModelProto, what: str = "graph") -> onnx.ModelProto:
    """A copy of the portable graph of standard ops only, computing in float32 (see the module
    docstring). A metrale node of another op (a tensor-parallel collective) is refused."""
    out = _copy(model)
    consts = _constants(out.graph)
    nodes = []
    for node in out.graph.node:
        if node.domain == DOMAIN and node.op_type in (FP8_OP, NVFP4_OP):
            nodes += _dequantized(node, consts, out.graph, what)
        elif node.domain == DOMAIN and node.op_type == CONV_OP:
            nodes += _dynamic_conv_standard(node, out.graph)
        elif node.domain == DOMAIN and node.op_type == MOE_OP:
            nodes += _grouped_moe_standard(node, consts, out.graph, what)
        elif node.domain == DOMAIN:
            raise ValueError(f"{what}: its {node.op_type} node has no onnxruntime lowering (the "
                             "onnxruntime backend runs one-rank graphs)")
        else:
            nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return widen_to_float32(_finish(out))


def widen_to_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """Retype every bfloat16 and float16 tensor of the graph as float32, in place: initializers
    and constants converted value for value (exact), casts to them retargeted, I/O retyped."""
    narrow = (TensorProto.BFLOAT16, TensorProto.FLOAT16)
    g = model.graph

    def widen(t: TensorProto) -> None:
        if t.data_type in narrow:
            t.CopyFrom(numpy_helper.from_array(_as_float32(t), t.name))

    for t in g.initializer:
        widen(t)
    for node in g.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                widen(attr.t)
            elif attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT and attr.i in narrow:
                attr.i = TensorProto.FLOAT
    for v in (*g.input, *g.output, *g.value_info):
        if v.type.tensor_type.elem_type in narrow:
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    return model


def _as_float32(t: TensorProto) -> np.ndarray:
    if t.data_type == TensorProto.FLOAT16:
        return numpy_helper.to_array(t).astype(np.float32)
    if t.HasField("raw_data"):
        bits = np.frombuffer(t.raw_data, dtype=np.uint16)
    else:  # bfloat16 values in int32_data, one per entry
        bits = np.asarray(t.int32_data, dtype=np.uint32).astype(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(tuple(t.dims))


def _constants(graph: onnx.GraphProto) -> dict[str, TensorProto]:
    """Initializers and Constant nodes' values by name."""
    out = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value":
                    out[node.output[0]] = attr.t
    return out


def _raw_bytes(t: TensorProto) -> np.ndarray:
    raw = t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
    return np.frombuffer(raw, dtype=np.uint8)


def _stored(node, consts: dict, names, what: str) -> list[torch.Tensor]:
    """A metrale node's constant inputs as torch tensors: uint8 / FP8 bytes as stored, the rest
    as float32."""
    missing = [n for n in names if n not in consts]
    if missing:
        raise ValueError(f"{what}: {node.op_type} node {node.name!r} reads {missing[0]!r}, which is "
                         "not a constant")
    tensors = []
    for name in names:
        t = consts[name]
        if t.data_type in (TensorProto.UINT8, TensorProto.FLOAT8E4M3FN):  # stored bytes
            raw = torch.from_numpy(_raw_bytes(t).copy()).view(tuple(t.dims))
            tensors.append(raw.view(torch.float8_e4m3fn) if t.data_type == TensorProto.FLOAT8E4M3FN else raw)
        else:
            tensors.append(torch.from_numpy(numpy_helper.to_array(t).astype(np.float32).copy()))
    return tensors


def _grouped_moe_standard(node, consts: dict, graph: onnx.GraphProto, what: str) -> list[onnx.NodeProto]:
    """`NvFp4MoeW4A16` as standard ops over its experts dequantized once, here (as the op itself
    dequantizes them, `nvfp4_moe.dense_experts`), into float32 initializers GU [E, 2I, H]
    and D [E, H, I]: each (token, slot) gathers its expert's GU and D, y = Σ_slots w·D(silu(g)·u)."""
    x, ids, weights = node.input[:3]
    gu, dn = dense_experts(*_stored(node, consts, node.input[3:], what))[:2]  # [E, 2I, H], [E, H, I]
    y, base = node.output[0], node.name or node.output[0]
    n = lambda s: f"{base}/{s}"  # noqa: E731
    graph.initializer.extend([numpy_helper.from_array(gu.numpy(), n("gate_up")),
                              numpy_helper.from_array(dn.numpy(), n("down"))])
    const = lambda s, v: _int64s(graph, n(s), v)  # noqa: E731
    return [
        helper.make_node("Gather", [n("gate_up"), ids], [n("gu_rows")], axis=0),  # [T, k, 2I, H]
        helper.make_node("Unsqueeze", [x, const("x_axes", [1, 3])], [n("x_col")]),  # [T, 1, H, 1]
        helper.make_node("MatMul", [n("gu_rows"), n("x_col")], [n("gu_col")]),  # [T, k, 2I, 1]
        helper.make_node("Squeeze", [n("gu_col"), const("col", [3])], [n("gu_out")]),
        helper.make_node("Split", [n("gu_out")], [n("gate"), n("up")], axis=2, num_outputs=2),
        helper.make_node("Sigmoid", [n("gate")], [n("gate_sig")]),
        helper.make_node("Mul", [n("gate"), n("gate_sig")], [n("silu")]),
        helper.make_node("Mul", [n("silu"), n("up")], [n("act")]),  # [T, k, I]
        helper.make_node("Gather", [n("down"), ids], [n("dn_rows")], axis=0),  # [T, k, H, I]
        helper.make_node("Unsqueeze", [n("act"), const("act_axes", [3])], [n("act_col")]),
        helper.make_node("MatMul", [n("dn_rows"), n("act_col")], [n("dn_col")]),  # [T, k, H, 1]
        helper.make_node("Unsqueeze", [weights, const("w_axes", [2, 3])], [n("w_col")]),
        helper.make_node("Mul", [n("dn_col"), n("w_col")], [n("weighted")]),
        helper.make_node("ReduceSum", [n("weighted"), const("sum_axes", [1, 3])], [y], keepdims=0),
    ]


def _dequantized(node, consts: dict, graph: onnx.GraphProto, what: str) -> list[onnx.NodeProto]:
    """A quantized linear's weight dequantized once, here, through its format's `dequantize`
    (the bytes' one definition, which the torch backend's linears use), into a float32
    initializer feeding a MatMul: onnxruntime would otherwise dequantize it at every call."""
    fmt = next(f for f in FORMATS.values() if f.onnx_op == node.op_type)
    w = fmt.dequantize(*_stored(node, consts, node.input[1:1 + len(fmt.leaves)], what))  # f32 [N, K]
    name = f"{node.name or node.output[0]}/w"
    graph.initializer.append(numpy_helper.from_array(w.numpy(), name))
    return _matmul_tail(node, name, {})


def _int64s(graph: onnx.GraphProto, name: str, values) -> str:
    graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
    return name


def _zero(graph: onnx.GraphProto, name: str) -> str:
    graph.initializer.append(numpy_helper.from_array(np.zeros((), dtype=np.float32), name))
    return name


def _dynamic_conv_standard(node, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """`DFlash2DynamicConv(x [B, T, H], kernel [B, T, G, 2]; block)` as standard ops: x viewed as
    [B, T, G, H/G], its slot-shifted copy x[t−1] (zero at each block's first slot, t % block == 0)
    and y = k0·x + k1·x[t−1], the op's two products and one sum in the graph's float type."""
    x, kernel = node.input
    y, base = node.output[0], node.name or node.output[0]
    block = next(a.i for a in node.attribute if a.name == "block")
    n = lambda s: f"{base}/{s}"  # noqa: E731
    const = lambda s, v: _int64s(graph, n(s), v)  # noqa: E731
    return [
        helper.make_node("Shape", [x], [n("x_shape")]),
        helper.make_node("Shape", [kernel], [n("k_shape")], start=2, end=3),  # [G]
        helper.make_node("Concat", [const("lead", [0, 0]), n("k_shape"), const("rest", [-1])],
                         [n("groups_shape")], axis=0),
        helper.make_node("Reshape", [x, n("groups_shape")], [n("xg")]),  # [B, T, G, H/G]
        helper.make_node("Pad", [n("xg"), const("pads", [0, 1, 0, 0, 0, 0, 0, 0])], [n("xg_pad")]),
        helper.make_node("Slice", [n("xg_pad"), const("start0", [0]), const("minus1", [-1]),
                                   const("slots", [1])], [n("prev_all")]),  # x[t−1], 0 at t = 0
        helper.make_node("Shape", [x], [n("t")], start=1, end=2),
        helper.make_node("Squeeze", [n("t")], [n("t_scalar")]),
        helper.make_node("Range", [const("r0", 0), n("t_scalar"), const("r1", 1)], [n("slot")]),
        helper.make_node("Mod", [n("slot"), const("block", block)], [n("in_block")]),
        helper.make_node("Greater", [n("in_block"), const("r0b", 0)], [n("has_prev")]),
        helper.make_node("Unsqueeze", [n("has_prev"), const("mask_axes", [0, 2, 3])],
                         [n("has_prev4")]),  # [1, T, 1, 1]
        helper.make_node("CastLike", [_zero(graph, n("zero_f32")), x], [n("zero")]),
        helper.make_node("Where", [n("has_prev4"), n("prev_all"), n("zero")], [n("prev")]),
        helper.make_node("Slice", [kernel, const("k0a", [0]), const("k0b", [1]), const("taps", [3])],
                         [n("k0")]),
        helper.make_node("Slice", [kernel, const("k1a", [1]), const("k1b", [2]), const("taps1", [3])],
                         [n("k1")]),
        helper.make_node("Mul", [n("k0"), n("xg")], [n("own")]),
        helper.make_node("Mul", [n("k1"), n("prev")], [n("shifted")]),
        helper.make_node("Add", [n("own"), n("shifted")], [n("yg")]),
        helper.make_node("Reshape", [n("yg"), n("x_shape")], [y]),
    ]


def _fold_weight_identities(graph: onnx.GraphProto) -> None:
    """The exporter shares equal initializers through `Identity` nodes; point their consumers at
    the initializer itself so every weight a metrale node reads is an initializer it can see."""
    inits = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    alias = {n.output[0]: n.input[0] for n in graph.node
             if n.op_type == "Identity" and n.input[0] in inits and n.output[0] not in outputs}
    if not alias:
        return
    keep = [n for n in graph.node if not (n.op_type == "Identity" and n.output[0] in alias)]
    for n in keep:
        for i, name in enumerate(n.input):
            if name in alias:
                n.input[i] = alias[name]
    del graph.node[:]
    graph.node.extend(keep)


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type by recorded value name; None: the activation type (first float output's)."""
    vis = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    out = {v.name: v.type.tensor_type.elem_type for v in vis}
    acts = [out[o.name] for o in model.graph.output if out[o.name] in _FLOATS] + [TensorProto.FLOAT]
    return {**out, None: acts[0]}


def _matmul_tail(node, w_name: str, elem: dict[str, int]) -> list[onnx.NodeProto]:
    """W f32 [N, K] -> y = x @ W.T, W cast like x first when x is not (or may not be) float32
    (an empty `elem`: x is float32)."""
    x, y, base = node.input[0], node.output[0], node.name or node.output[0]
    x_type, cast, nodes = elem.get(x, TensorProto.UNDEFINED), f"{base}/w_cast", []
    if x_type == TensorProto.UNDEFINED and elem.get(None, TensorProto.FLOAT) != TensorProto.FLOAT:
        nodes, w_name = [helper.make_node("CastLike", [w_name, x], [cast])], cast
    elif x_type not in (TensorProto.FLOAT, TensorProto.UNDEFINED):
        nodes, w_name = [helper.make_node("Cast", [w_name], [cast], to=x_type)], cast
    return nodes + [helper.make_node("Transpose", [w_name], [f"{base}/w_t"], perm=[1, 0]),
                    helper.make_node("MatMul", [x, f"{base}/w_t"], [y])]


def _fp8_native(node, elem) -> list[onnx.NodeProto]:
    _, w, scale = node.input
    base = node.name or node.output[0]
    dq = helper.make_node("DequantizeLinear", [w, scale], [f"{base}/w"], axis=0)  # f32 [N, K]
    return [dq, *_matmul_tail(node, f"{base}/w", elem)]


def _fp4_native(node, elem, inits, graph) -> list[onnx.NodeProto]:
    """packed u8 [N, K/2] -> FLOAT4E2M1 [N, K] (same bytes: element 2i is the low nibble, as
    ONNX packs 4-bit types), block scales dequantized by the global scale first, then the
    block-16 dequantize: the scale product precedes the E2M1 value, as `plugins.formats` does."""
    _, packed, block_scale, global_scale = node.input
    base = node.name or node.output[0]
    src = inits[packed]
    n, half = src.dims
    fp4 = TensorProto(name=f"{packed}/fp4", data_type=TensorProto.FLOAT4E2M1, dims=[n, 2 * half],
                      raw_data=numpy_helper.to_array(src).tobytes())
    if fp4.name not in inits:  # one packed tensor may feed several nodes
        graph.initializer.append(fp4)
        inits[fp4.name] = fp4
    scales = helper.make_node("DequantizeLinear", [block_scale, global_scale], [f"{base}/scale"])
    dq = helper.make_node("DequantizeLinear", [fp4.name, f"{base}/scale"], [f"{base}/w"],
                          axis=1, block_size=16)
    return [scales, dq, *_matmul_tail(node, f"{base}/w", elem)]


def _bytes_as_int8(t: TensorProto) -> None:
    """Retype a uint8 or FLOAT8E4M3FN initializer as int8 holding the same bytes.

    Why: TensorRT's ONNX parser widens uint8 weights to int32 (four times the memory, a layout no
    kernel expects); a network that needs both int8 and fp8 is refused ("int8SupportRequired &&
    fp8SupportRequired"); SM75-SM86 have no fp8 type at all. Int8 bytes pass through unchanged,
    and the plugin's kernel decodes E2M1 codes and E4M3 bits itself."""
    if t.data_type in (TensorProto.UINT8, TensorProto.FLOAT8E4M3FN):
        raw = t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
        t.ClearField("int32_data")
        t.data_type = TensorProto.INT8
        t.raw_data = raw
