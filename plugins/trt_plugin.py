"""The TensorRT face of metrale's weight-only GEMM ops: IPluginV3 plugins written in Python.

An exported graph holds a `metrale`-domain node (`Fp8W8A16Gemm`, `NvFp4W4A16Gemm`; see
`builder.onnx_export`) wherever the target SM has no native TensorRT path. TensorRT's ONNX parser
turns such a node into a plugin layer by looking up a creator whose name is the node's op type
(version "1", namespace ""), so registering the creators below before parsing is all a build
needs. TensorRT-RTX 1.7 has no `add_plugin_v3` and no quick-plugin module in its bindings, so the
plugin is a class implementing `IPluginV3` + `IPluginV3OneCore/OneBuild/OneRuntime`, created by an
`IPluginCreatorV3One` registered with `trt.get_plugin_registry()`.

Ops (inputs in node order; output y has x's dtype and shape [..., N]):
- `Fp8W8A16Gemm(x [..., K] f32|f16|bf16, w [N, K], scale f32 [N])`
- `NvFp4W4A16Gemm(x [..., K], packed [N, K/2], block_scale [N, K/16], global_scale f32 [])`
The ONNX node carries w/block_scale as FLOAT8E4M3FN and packed as uint8; `onnx_export.lower_for_sm`
retypes them int8 with the same bytes before TensorRT sees them (its parser widens uint8 to int32,
refuses int8 and fp8 in one network, and SM75-SM86 have no fp8), so the plugin's inputs are int8
bytes: E4M3 bit patterns and packed E2M1 codes that the kernel decodes.
Math: exactly the PyTorch references `plugins.fp8_gemm` / `plugins.nvfp4_gemm`.

Build time (CPU-only works): the plugin answers shapes, types and formats; it never runs.
Run time (GPU only): `enqueue` launches the op's kernel, compiled ahead of time to a cubin for the
engine's SM, through the CUDA driver API (`cuda.bindings.driver`, imported on first launch). The
kernel is looked up by name (`KernelImage.key(op, sm)`, e.g. `nvfp4_w4a16_gemm.sm89`) in the
`KernelLibrary` given to `register_plugins`; the runtime fills it from the engine directory's
`plugins/` folder (`KernelLibrary.from_dir`, the `<kernel>.sm<NN>.cubin/.json` pairs of
`plugins.aot`) before deserializing. Launch contract for every GEMM kernel (Triton's
calling convention: the non-constexpr arguments in order, then two u64 scratch pointers):
    kernel(x, <weight inputs in node order>, y, M, N, K, scratch0, scratch1)
with grid (ceil(M / block_m), ceil(N / block_n), 1) and 32·num_warps threads per block, where M
is the product of x's leading dims. A missing kernel is an error at the first launch, never a
silent no-op.

`register_plugins` also registers the tensor-parallel collectives (`AllReduce`, `AllGather` over
NCCL; `plugins.trt_collectives`), so one call covers every metrale node an engine may hold.

Invariant: this module imports no TensorRT flavour itself; `plugin_classes(trt)` builds the
classes for the module it is given (tensorrt_rtx or tensorrt), once per module.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""


@dataclass(frozen=True)
class GemmOpSpec:
    """One weight-only GEMM op as TensorRT sees it."""

    op_type: str  # ONNX op type == plugin name
    kernel: str  # kernel base name (the cubin's key prefix)
    weights: tuple[str, ...]  # per weight input: the TensorRT DataType member name it must have


GEMM_OPS = {
    "Fp8W8A16Gemm": GemmOpSpec("Fp8W8A16Gemm", "fp8_w8a16_gemm", ("INT8", "FLOAT")),
    "NvFp4W4A16Gemm": GemmOpSpec("NvFp4W4A16Gemm", "nvfp4_w4a16_gemm", ("INT8", "INT8", "FLOAT")),
}
ACTIVATION_TYPES = ("FLOAT", "HALF", "BF16")


@dataclass(frozen=True)
class KernelImage:
    """A kernel compiled ahead of time for one SM (what `plugins/` stores per op and SM)."""

    cubin: bytes
    name: str  # the kernel's symbol in the cubin
    num_warps: int
    shared: int  # dynamic shared memory in bytes
    block_m: int
    block_n: int

    @staticmethod
    def key(kernel: str, sm: int) -> str:
        return f"{kernel}.sm{sm}"


@dataclass
class KernelLibrary:
    """Kernel images by `KernelImage.key`, plus the driver handles loaded from them (lazily)."""

    images: dict[str, KernelImage] = field(default_factory=dict)
    _functions: dict[str, object] = field(default_factory=dict, repr=False)
    # Python plugin objects handed to TensorRT: its C++ side does not own them, so they must
    # outlive every network/engine that uses them (a collected one is a use-after-free).
    keep_alive: list = field(default_factory=list, repr=False)

    @classmethod
    def from_dir(cls, folder: Path) -> "KernelLibrary":
        """Read every `<kernel>.sm<NN>.json` + `.cubin` pair that `plugins.aot` wrote."""
        images = {}
        for meta_path in sorted(Path(folder).glob("*.sm*.json")):
            meta = json.loads(meta_path.read_text())
            if meta.get("global_scratch_size", 0) or meta.get("profile_scratch_size", 0):
                raise ValueError(f"{meta_path}: kernels needing scratch memory are not launched "
                                 "by the TensorRT plugin (it passes null scratch pointers)")
            blocks = meta.get("constexprs", {})
            images[KernelImage.key(meta["kernel"], meta["sm"])] = KernelImage(
                cubin=(meta_path.parent / meta["cubin"]).read_bytes(), name=meta["symbol"],
                num_warps=meta["num_warps"], shared=meta["shared"],
                block_m=blocks.get("BLOCK_M", 1), block_n=blocks.get("BLOCK_N", 1))
        return cls(images)

    def function(self, key: str):
        """The CUfunction for `key`, loading its module on first use (GPU only)."""
        if key not in self._functions:
            image = self.images.get(key)
            if image is None:
                raise RuntimeError(
                    f"TensorRT plugin: no kernel {key!r} in the engine's plugins folder "
                    f"(have: {', '.join(sorted(self.images)) or 'none'}); rebuild the engine "
                    "directory with the plugins' kernels compiled for this SM")
            drv = _driver()
            module = _check(drv, drv.cuModuleLoadData(image.cubin))
            fn = _check(drv, drv.cuModuleGetFunction(module, image.name.encode()))
            if image.shared > 48 * 1024:  # above the default carve-out needs an opt-in
                attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(drv, drv.cuFuncSetAttribute(fn, attr, image.shared))
            self._functions[key] = fn
        return self._functions[key]


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise RuntimeError("running a metrale TensorRT plugin needs the CUDA driver bindings: "
                           "pip install cuda-python") from None
    return driver


def _check(drv, result):
    err, *rest = result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def _volume(dims, upto: int) -> int:
    n = 1
    for d in list(dims)[:upto]:
        n *= int(d)
    return n


def launch_gemm(lib: KernelLibrary, spec: GemmOpSpec, sm: int, input_desc, inputs, outputs,
                stream: int) -> None:
    """Launch the op's kernel on `stream` (GPU only): the launch contract of the module doc."""
    key = KernelImage.key(spec.kernel, sm)
    fn = lib.function(key)
    image = lib.images[key]
    x_dims = input_desc[0].dims  # [..., K]
    k = int(x_dims[len(x_dims) - 1])
    m = _volume(x_dims, len(x_dims) - 1)
    n = int(input_desc[1].dims[0])
    ptrs = [int(p) for p in inputs] + [int(outputs[0])]
    args = (*ptrs, m, n, k, 0, 0)
    types = (*([ctypes.c_void_p] * len(ptrs)), ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
             ctypes.c_uint64, ctypes.c_uint64)
    grid = (-(-m // image.block_m), -(-n // image.block_n), 1)
    drv = _driver()
    _check(drv, drv.cuLaunchKernel(fn, *grid, 32 * image.num_warps, 1, 1, image.shared, stream,
                                   (args, types), 0))


class PluginDefaults:
    """The IPluginV3 methods every metrale plugin answers the same way (a plain mixin, listed
    before TensorRT's interfaces so its methods win): no extra capability objects, nothing to
    free, outputs typed like the first input, no workspace, no tactics, and one clone per
    execution context."""

    def get_capability_interface(self, _type):
        return self

    def destroy(self):
        pass

    def get_output_data_types(self, input_types):
        return [input_types[0]]

    def configure_plugin(self, inp, out):
        pass

    def get_workspace_size(self, inp, out):
        return 0

    def get_valid_tactics(self):
        return []

    def on_shape_change(self, inp, out):
        pass

    def set_tactic(self, tactic):
        pass

    def attach_to_context(self, context):
        return self.clone()


@functools.lru_cache(maxsize=None)
def plugin_classes(trt: ModuleType):
    """(plugin class, creator class) implemented against the TensorRT module `trt`."""

    class MetraleGemmPlugin(PluginDefaults, trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild,
                            trt.IPluginV3OneRuntime):
        """One weight-only GEMM node. Fields (serialized into the engine): `sm` (int32)."""

        def __init__(self, spec: GemmOpSpec, sm: int, library: KernelLibrary):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.spec, self.sm, self.library = spec, sm, library
            self.plugin_name = spec.op_type
            self.plugin_namespace = PLUGIN_NAMESPACE
            self.plugin_version = PLUGIN_VERSION
            self.num_outputs = 1
            self.timing_cache_id = ""

        # -- core / lifetime --
        def clone(self):
            twin = MetraleGemmPlugin(self.spec, self.sm, self.library)
            self.library.keep_alive.append(twin)  # TensorRT holds it by a borrowed pointer
            return twin

        # -- build --
        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            out = trt.DimsExprs(inputs[0])  # x [..., K] -> y [..., N]
            out[len(out) - 1] = inputs[1][0]
            return [out]

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            if pos == 0:
                return desc.type in tuple(getattr(trt.DataType, t) for t in ACTIVATION_TYPES)
            if pos == num_inputs:  # the output follows x's dtype
                return desc.type == in_out[0].desc.type
            return desc.type == getattr(trt.DataType, self.spec.weights[pos - 1])

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection(_sm_field(trt, self.sm))

        # -- runtime (GPU only) --
        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            launch_gemm(self.library, self.spec, self.sm, input_desc, inputs, outputs, stream)

    class MetraleGemmCreator(trt.IPluginCreatorV3One):
        """Creates `MetraleGemmPlugin`s for one op; `sm` comes from the build (or the engine)."""

        def __init__(self, spec: GemmOpSpec, sm: int, library: KernelLibrary):
            trt.IPluginCreatorV3One.__init__(self)
            self.spec, self.sm, self.library = spec, sm, library
            self.name = spec.op_type
            self.plugin_namespace = PLUGIN_NAMESPACE
            self.plugin_version = PLUGIN_VERSION
            self.field_names = trt.PluginFieldCollection(_sm_field(trt, sm))

        def create_plugin(self, name, fc, phase):
            sm = self.sm
            for f in fc:  # a deserialized engine carries the SM it was built for
                if f.name == "sm":
                    sm = int(f.data[0])
            plugin = MetraleGemmPlugin(self.spec, sm, self.library)
            self.library.keep_alive.append(plugin)  # TensorRT holds it by a borrowed pointer
            return plugin

    return MetraleGemmPlugin, MetraleGemmCreator


def _sm_field(trt: ModuleType, sm: int):
    import numpy as np

    return [trt.PluginField("sm", np.array([sm], dtype=np.int32), trt.PluginFieldType.INT32)]


@dataclass
class RegisteredPlugins:
    """The creators registered by `register_plugins`; keep it alive while TensorRT may call them."""

    creators: dict[str, object]
    library: KernelLibrary
    collectives: object = None  # plugins.trt_collectives.Collectives


def register_plugins(trt: ModuleType, sm: int, library: KernelLibrary | None = None,
                     comm=None) -> RegisteredPlugins:
    """Register a creator per GEMM op for building (or running) for `sm`, and one per collective
    op of a tensor-parallel drafter (`plugins.trt_collectives`; `comm`, an `NcclCommunicator`,
    is needed only to run them).

    The registry is process-wide and keyed by name/version/namespace, so an earlier registration
    of the same op (another SM) is replaced first. Returns the creators; the caller holds them
    (the registry keeps only a borrowed reference to a Python creator).
    """
    _, creator_cls = plugin_classes(trt)
    registry = trt.get_plugin_registry()
    library = library if library is not None else KernelLibrary()
    creators = {}
    for op, spec in GEMM_OPS.items():
        old = registry.get_creator(op, PLUGIN_VERSION, PLUGIN_NAMESPACE)
        if old is not None:
            registry.deregister_creator(old)
        creator = creator_cls(spec, sm, library)
        if not registry.register_creator(creator, PLUGIN_NAMESPACE):
            raise RuntimeError(f"TensorRT refused to register the {op} plugin creator")
        creators[op] = creator
    from metrale.plugins.trt_collectives import Collectives, register_collectives

    collectives = Collectives(comm)
    creators.update(register_collectives(trt, collectives))
    return RegisteredPlugins(creators, library, collectives)
