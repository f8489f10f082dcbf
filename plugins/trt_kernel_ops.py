"""The TensorRT face of metrale's two non-GEMM kernel ops: the grouped NVFP4 MoE experts
(`NvFp4MoeW4A16`, `plugins.nvfp4_moe`) and DFlash2's dynamic conv (`DFlash2DynamicConv`,
`plugins.dynamic_conv`), as IPluginV3 plugins like the GEMMs of `plugins.trt_plugin`, whose
kernel library, launch contract and lifetimes they share.

Nodes (inputs in node order; y has x's dtype):
- `NvFp4MoeW4A16(x [T, H], expert_ids int64 [T, k], weights [T, k] (x's dtype),
  gate_up_packed [E, 2I, H/2], gate_up_scale [E, 2I, H/16], gate_up_global f32 [E, 2],
  down_packed [E, H, I/2], down_scale [E, H, I/16], down_global f32 [E]) -> y [T, H]`;
  `lower_for_sm` retypes the packed codes and FP8 block scales int8 with the same bytes.
  Two launches on the stream: `nvfp4_moe_gate_up` writes silu(g)·u of every routed (token,
  expert) pair to a float32 workspace [T·k, I] (`get_workspace_size`: T·k·I·4 bytes at the
  profile's largest T), grid (T·k, ceil(I / BLOCK_I)); then `nvfp4_moe_down` sums each token's
  k pairs through their down projections, grid (T, ceil(H / BLOCK_H)).
- `DFlash2DynamicConv(x [B, T, H], kernel [B, T, G, 2]; INT attribute block) -> y [B, T, H]`:
  one launch of `dflash2_dynamic_conv`, grid (B·T, ceil(H / BLOCK_H)), arguments
  (x, kernel, y, T, H, G, block). The attribute is serialized into the engine.

An empty output launches nothing. The cubins are looked up per op, SM and x's dtype, as for
the GEMMs; `KERNEL_OPS` names each op's kernels (what `builder.build` compiles for an engine
that holds the op, and what the runtime checks its plugins folder for).

Invariant: this module imports no TensorRT flavour itself; `kernel_op_classes(trt)` builds
the classes for the module it is given, once per module.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

from metrale.plugins.trt_common import PluginDefaults, act_of, init_plugin

MOE_OP, CONV_OP = "NvFp4MoeW4A16", "DFlash2DynamicConv"


@dataclass(frozen=True)
class KernelOpSpec:
    """One non-GEMM op as TensorRT sees it."""

    op_type: str  # ONNX op type == plugin name
    kernels: tuple[str, ...]  # kernel base names (cubin key prefixes), in launch order
    inputs: tuple[str, ...]  # per input: "ACT" (x's type) or the TensorRT DataType name it must have
    attrs: tuple[str, ...] = ()  # the node's INT attributes, serialized as plugin fields


KERNEL_OPS = {
    MOE_OP: KernelOpSpec(MOE_OP, ("nvfp4_moe_gate_up", "nvfp4_moe_down"),
                         ("ACT", "INT64", "ACT", "INT8", "INT8", "FLOAT", "INT8", "INT8", "FLOAT")),
    CONV_OP: KernelOpSpec(CONV_OP, ("dflash2_dynamic_conv",), ("ACT", "ACT"), ("block",)),
}


def _dims(desc) -> list[int]:
    return [int(d) for d in desc.dims]


def moe_workspace_bytes(x_dims, ids_dims, gate_up_dims) -> int:
    """Bytes of the float32 [T·k, I] workspace between the MoE's two launches."""
    t, k, inter = int(x_dims[0]), int(ids_dims[1]), int(gate_up_dims[1]) // 2
    return t * k * inter * 4


def launch_moe(lib, sm: int, input_desc, inputs, outputs, workspace: int, stream: int) -> None:
    """The MoE node's two launches on `stream` (GPU only; see the module doc)."""
    t, h = _dims(input_desc[0])
    k = _dims(input_desc[1])[1]
    inter = _dims(input_desc[3])[1] // 2
    if t == 0 or h == 0:
        return
    act = act_of(input_desc[0].type)
    x, ids, weights, gu, gu_bs, gu_gs, dn, dn_bs, dn_gs = (int(p) for p in inputs)
    if t * k and inter:
        lib.launch("nvfp4_moe_gate_up", sm, act, stream,
                   pointers=(x, ids, gu, gu_bs, gu_gs, int(workspace)), ints=(h, inter, k),
                   grid=lambda im: (t * k, -(-inter // im.constexprs["BLOCK_I"]), 1))
    lib.launch("nvfp4_moe_down", sm, act, stream,
               pointers=(int(workspace), ids, weights, dn, dn_bs, dn_gs, int(outputs[0])),
               ints=(h, inter, k), grid=lambda im: (t, -(-h // im.constexprs["BLOCK_H"]), 1))


def launch_conv(lib, sm: int, block: int, input_desc, inputs, outputs, stream: int) -> None:
    """The dynamic conv node's launch on `stream` (GPU only; see the module doc)."""
    b, t, h = _dims(input_desc[0])
    g = _dims(input_desc[1])[2]
    if b * t == 0 or h == 0:
        return
    lib.launch("dflash2_dynamic_conv", sm, act_of(input_desc[0].type), stream,
               pointers=(int(inputs[0]), int(inputs[1]), int(outputs[0])), ints=(t, h, g, block),
               grid=lambda im: (b * t, -(-h // im.constexprs["BLOCK_H"]), 1))


def _fields(trt: ModuleType, values: dict[str, int]):
    import numpy as np

    return [trt.PluginField(name, np.array([v], dtype=np.int32), trt.PluginFieldType.INT32)
            for name, v in values.items()]


@functools.lru_cache(maxsize=None)
def kernel_op_classes(trt: ModuleType):
    """(plugin class, creator class) implemented against the TensorRT module `trt`."""

    class MetraleKernelOpPlugin(PluginDefaults, trt.IPluginV3, trt.IPluginV3OneCore,
                                trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        """One MoE or dynamic conv node. Serialized fields: `sm` and the op's attributes."""

        def __init__(self, spec: KernelOpSpec, sm: int, attrs: dict[str, int], library):
            init_plugin(self, trt, spec.op_type)
            self.spec, self.sm, self.attrs, self.library = spec, sm, dict(attrs), library

        def clone(self):
            return self.library.keep_alive.hold(
                MetraleKernelOpPlugin(self.spec, self.sm, self.attrs, self.library))

        # -- build --
        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            return [trt.DimsExprs(inputs[0])]  # both ops: y has x's shape

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            if pos == 0:
                return desc.type in (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16)
            want = "ACT" if pos == num_inputs else self.spec.inputs[pos]
            if want == "ACT":  # the output and the activation-typed inputs follow x
                return desc.type == in_out[0].desc.type
            return desc.type == getattr(trt.DataType, want)

        def get_workspace_size(self, inp, out):
            if self.spec.op_type != MOE_OP:
                return 0
            return moe_workspace_bytes(inp[0].max, inp[1].max, inp[3].max)

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection(_fields(trt, {"sm": self.sm, **self.attrs}))

        # -- runtime (GPU only) --
        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            if self.spec.op_type == MOE_OP:
                launch_moe(self.library, self.sm, input_desc, inputs, outputs, workspace, stream)
            else:
                launch_conv(self.library, self.sm, self.attrs["block"], input_desc, inputs,
                            outputs, stream)

    class MetraleKernelOpCreator(trt.IPluginCreatorV3One):
        """Creates the plugins of one op; `sm` from the build (or the engine's field)."""

        def __init__(self, spec: KernelOpSpec, sm: int, library):
            trt.IPluginCreatorV3One.__init__(self)
            self.spec, self.sm, self.library = spec, sm, library
            self.name = spec.op_type
            self.plugin_namespace = ""
            self.plugin_version = "1"
            self.field_names = trt.PluginFieldCollection(
                _fields(trt, {"sm": sm, **{a: 1 for a in spec.attrs}}))

        def create_plugin(self, name, fc, phase):
            got = {f.name: int(f.data[0]) for f in fc}
            missing = [a for a in self.spec.attrs if a not in got]
            if missing or any(got[a] < 1 for a in self.spec.attrs):
                raise ValueError(f"{self.spec.op_type} node {name}: expected INT attributes "
                                 f"{', '.join(self.spec.attrs)} >= 1, got {got}")
            return self.library.keep_alive.hold(MetraleKernelOpPlugin(
                self.spec, got.get("sm", self.sm), {a: got[a] for a in self.spec.attrs},
                self.library))

    return MetraleKernelOpPlugin, MetraleKernelOpCreator


def register_kernel_ops(trt: ModuleType, sm: int, library) -> dict[str, object]:
    """Register (replacing any earlier registration) a creator per op of `KERNEL_OPS`."""
    _, creator_cls = kernel_op_classes(trt)
    registry = trt.get_plugin_registry()
    creators = {}
    for op, spec in KERNEL_OPS.items():
        old = registry.get_creator(op, "1", "")
        if old is not None:
            registry.deregister_creator(old)
        creator = creator_cls(spec, sm, library)
        if not registry.register_creator(creator, ""):
            raise RuntimeError(f"TensorRT refused to register the {op} plugin creator")
        creators[op] = creator
    return creators
