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
The ONNX node carries w/block_scale as FLOAT8E4M3FN and packed as uint8;
`onnx_lowering.lower_for_sm` retypes them int8 with the same bytes before TensorRT sees them (its
parser widens uint8 to int32, refuses int8 and fp8 in one network, and SM75-SM86 have no fp8), so
the plugin's inputs are int8 bytes: E4M3 bit patterns and packed E2M1 codes that the kernel
decodes.
Math: exactly the PyTorch references `plugins.fp8_gemm` / `plugins.nvfp4_gemm`.

Build time (CPU-only works): the plugin answers shapes, types and formats; it never runs.
Run time (GPU only): `enqueue` launches the op's kernel, compiled ahead of time to a cubin for the
engine's SM and the node's activation dtype, through the CUDA driver API (`cuda.bindings.driver`,
imported on first launch). The kernel is looked up by op, SM and dtype
(`KernelImage.key(kernel, sm, act)`, e.g. `nvfp4_w4a16_gemm.sm89.bf16`; act is fp32, fp16 or bf16
from x's TensorRT type) in the `KernelLibrary` given to `register_plugins`; the runtime fills it
from the engine directory's `plugins/` folder (`KernelLibrary.from_dir`, the
`<kernel>.sm<NN>.<act>.cubin/.json` pairs of `plugins.aot`) before deserializing. A cubin of one
dtype is never launched on another's data. Launch contract for every GEMM kernel (Triton's
calling convention: the non-constexpr arguments in order, then the u64 scratch pointers the
compiling Triton appended, `scratch_args`, two for current releases, all null):
    kernel(x, <weight inputs in node order>, y, M, N, K, scratch0, scratch1)
with grid (ceil(M / block_m), ceil(N / block_n), 1) and 32·num_warps threads per block, where M
is the product of x's leading dims. An empty output (M = 0 or N = 0) launches nothing (a zero
grid is an invalid launch). A missing kernel is an error at the first launch, never a silent
no-op. Modules are loaded, and CUfunction handles cached, per CUDA context (a handle is valid
only in the context that loaded it); `KernelLibrary.close` unloads them.

Lifetimes: TensorRT holds the Python plugin objects by borrowed pointers, so each is held in a
`Keeper` from its creation (or clone) until TensorRT calls its `destroy()`, which drops it: the
set holds exactly the plugins TensorRT still owns, however many contexts come and go.

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

from metrale.plugins.formats import FORMATS
from metrale.plugins.trt_common import (  # noqa: F401  (the plugins' base, re-exported)
    ACT_OF_TYPE, Keeper, PluginDefaults, act_of, init_plugin,
)
from metrale.plugins.trt_kernel_ops import KERNEL_OPS, register_kernel_ops

log = logging.getLogger(__name__)

PLUGIN_VERSION = "1"  # every metrale plugin's (`trt_common.init_plugin`)
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
assert {f.onnx_op for f in FORMATS.values()} == set(GEMM_OPS)  # one plugin per format of the table
ACTIVATION_TYPES = ("FLOAT", "HALF", "BF16")
# every op whose plugin launches Triton kernels -> those kernels' base names (cubin key prefixes)
KERNELS_OF_OP = {**{op: (spec.kernel,) for op, spec in GEMM_OPS.items()},
                 **{op: spec.kernels for op, spec in KERNEL_OPS.items()}}


@dataclass(frozen=True)
class KernelImage:
    """A kernel compiled ahead of time for one SM and activation dtype (what `plugins/` stores)."""

    cubin: bytes
    name: str  # the kernel's symbol in the cubin
    num_warps: int
    shared: int  # dynamic shared memory in bytes
    block_m: int
    block_n: int
    scratch_args: int = 2  # trailing u64 scratch pointers the compiling Triton appended
    constexprs: dict = field(default_factory=dict)  # the tile sizes it was compiled with

    @staticmethod
    def key(kernel: str, sm: int, act: str) -> str:
        return f"{kernel}.sm{sm}.{act}"


@dataclass
class KernelLibrary:
    """Kernel images by `KernelImage.key`, plus the driver modules and functions loaded from them
    (lazily, per CUDA context)."""

    images: dict[str, KernelImage] = field(default_factory=dict)
    keep_alive: Keeper = field(default_factory=Keeper, repr=False)
    # (CUcontext handle, key) -> (CUmodule, CUfunction)
    _loaded: dict[tuple[int, str], tuple] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dir(cls, folder: Path) -> "KernelLibrary":
        """Read every `<kernel>.sm<NN>.<act>.json` + `.cubin` pair that `plugins.aot` wrote."""
        images = {}
        for meta_path in sorted(Path(folder).glob("*.sm*.json")):
            meta = json.loads(meta_path.read_text())
            if "act" not in meta:
                raise ValueError(f"{meta_path}: no activation dtype ('act'); the kernels were "
                                 "compiled before cubins were keyed by dtype: rebuild the engine "
                                 "directory")
            if meta.get("global_scratch_size", 0) or meta.get("profile_scratch_size", 0):
                raise ValueError(f"{meta_path}: kernels needing scratch memory are not launched "
                                 "by the TensorRT plugin (it passes null scratch pointers)")
            blocks = meta.get("constexprs", {})
            images[KernelImage.key(meta["kernel"], meta["sm"], meta["act"])] = KernelImage(
                cubin=(meta_path.parent / meta["cubin"]).read_bytes(), name=meta["symbol"],
                num_warps=meta["num_warps"], shared=meta["shared"],
                block_m=blocks.get("BLOCK_M", 1), block_n=blocks.get("BLOCK_N", 1),
                scratch_args=meta.get("scratch_args", 2), constexprs=dict(blocks))
        return cls(images)

    def missing(self, keys) -> list[str]:
        """The keys (of `KernelImage.key`) this library has no image for, sorted."""
        return sorted(set(keys) - set(self.images))

    def function(self, key: str):
        """The CUfunction for `key` in the current CUDA context, loading its module on first use
        there (GPU only)."""
        image = self.images.get(key)
        if image is None:
            raise RuntimeError(
                f"TensorRT plugin: no kernel {key!r} in the engine's plugins folder "
                f"(have: {', '.join(sorted(self.images)) or 'none'}); rebuild the engine "
                "directory with the plugins' kernels compiled for this SM and dtype")
        drv = _driver()
        ctx = _handle(_check(drv, drv.cuCtxGetCurrent()))
        if not ctx:
            raise RuntimeError("TensorRT plugin: no CUDA context is current on this thread")
        loaded = self._loaded.get((ctx, key))
        if loaded is None:
            module = _check(drv, drv.cuModuleLoadData(image.cubin))
            fn = _check(drv, drv.cuModuleGetFunction(module, image.name.encode()))
            if image.shared > 48 * 1024:  # above the default carve-out needs an opt-in
                attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(drv, drv.cuFuncSetAttribute(fn, attr, image.shared))
            loaded = self._loaded[(ctx, key)] = (module, fn)
        return loaded[1]

    def launch(self, kernel: str, sm: int, act: str, stream: int, *, pointers, ints, grid) -> None:
        """Launch `kernel`'s image for (sm, act) on `stream` (GPU only): `pointers` (device
        addresses) then `ints` (int32) in the kernel's argument order, then the null scratch
        pointers; `grid(image)` gives the grid from the image's tile sizes."""
        key = KernelImage.key(kernel, sm, act)
        fn = self.function(key)
        image = self.images[key]
        args = (*pointers, *ints, *([0] * image.scratch_args))
        types = (*([ctypes.c_void_p] * len(pointers)), *([ctypes.c_int32] * len(ints)),
                 *([ctypes.c_uint64] * image.scratch_args))
        drv = _driver()
        _check(drv, drv.cuLaunchKernel(fn, *grid(image), 32 * image.num_warps, 1, 1,
                                       image.shared, int(stream), (args, types), 0))

    def close(self) -> None:
        """Unload every module loaded so far (after the engines using them are gone)."""
        if not self._loaded:
            return
        drv = _driver()
        for (ctx, key), (module, _) in list(self._loaded.items()):
            err = drv.cuModuleUnload(module)[0]
            if err != drv.CUresult.CUDA_SUCCESS:
                log.warning("unloading the %s kernel module failed: %s", key, err)
        self._loaded.clear()


def plugin_kernel_keys(engines, sm: int) -> set[str]:
    """The `KernelImage.key`s the kernel plugin layers (GEMMs, MoE, conv) of engines built for
    `sm` launch; `engines`
    holds per engine its plugin layers (op -> count) and their activation dtypes (op -> dtypes),
    as its manifest entry records them."""
    keys = set()
    for plugins, acts in engines:
        acts = acts or {}
        for op in plugins or {}:
            if op not in KERNELS_OF_OP:
                continue
            if not acts.get(op):
                raise ValueError(f"an SM{sm} engine has {op} plugin layers but no recorded "
                                 "activation dtype (built before plugin_acts): rebuild it")
            keys.update(KernelImage.key(kernel, sm, act) for kernel in KERNELS_OF_OP[op]
                        for act in acts[op])
    return keys


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


def _handle(obj) -> int:
    """The address behind a cuda-python handle object (CUcontext, ...), 0 for a null one."""
    if obj is None:
        return 0
    get = getattr(obj, "getPtr", None)
    return int(get()) if get is not None else int(obj)


def _volume(dims, upto: int) -> int:
    n = 1
    for d in list(dims)[:upto]:
        n *= int(d)
    return n


def launch_gemm(lib: KernelLibrary, spec: GemmOpSpec, sm: int, input_desc, inputs, outputs,
                stream: int) -> None:
    """Launch the op's kernel on `stream` (GPU only): the launch contract of the module doc."""
    act = act_of(input_desc[0].type)
    x_dims = input_desc[0].dims  # [..., K]
    k = int(x_dims[len(x_dims) - 1])
    m = _volume(x_dims, len(x_dims) - 1)
    n = int(input_desc[1].dims[0])
    if m == 0 or n == 0:  # an empty output: nothing to compute, and a zero grid is invalid
        return
    lib.launch(spec.kernel, sm, act, stream, pointers=[int(p) for p in inputs] + [int(outputs[0])],
               ints=(m, n, k), grid=lambda im: (-(-m // im.block_m), -(-n // im.block_n), 1))


@functools.lru_cache(maxsize=None)
def plugin_classes(trt: ModuleType):
    """(plugin class, creator class) implemented against the TensorRT module `trt`."""

    class MetraleGemmPlugin(PluginDefaults, trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild,
                            trt.IPluginV3OneRuntime):
        """One weight-only GEMM node. Fields (serialized into the engine): `sm` (int32)."""

        def __init__(self, spec: GemmOpSpec, sm: int, library: KernelLibrary):
            init_plugin(self, trt, spec.op_type)
            self.spec, self.sm, self.library = spec, sm, library

        # -- core / lifetime --
        def clone(self):
            return self.library.keep_alive.hold(MetraleGemmPlugin(self.spec, self.sm, self.library))

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
            return self.library.keep_alive.hold(MetraleGemmPlugin(self.spec, sm, self.library))

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

    def close(self) -> None:
        """Unload the kernels' modules and destroy the NCCL communicator (after the engines that
        use them are gone)."""
        self.library.close()
        if self.collectives is not None:
            self.collectives.close()


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
    creators.update(register_kernel_ops(trt, sm, library))
    from metrale.plugins.trt_collectives import Collectives, register_collectives

    collectives = Collectives(comm)
    creators.update(register_collectives(trt, collectives))
    return RegisteredPlugins(creators, library, collectives)
