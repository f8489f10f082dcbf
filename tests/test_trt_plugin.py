"""The TensorRT plugins' launch and lifetime bookkeeping, on CPU with stand-in CUDA driver and
NCCL libraries (the real calls need a GPU): kernels keyed by op, SM and activation dtype;
CUfunctions loaded per CUDA context; an empty output launches nothing; plugin objects released
when TensorRT destroys them; the NCCL communicator destroyed exactly once."""

from __future__ import annotations

import ctypes
import enum
import gc
import types

import pytest

from metrale.plugins import trt_collectives as tc
from metrale.plugins import trt_plugin as tp


class FakeDriver:
    """The `cuda.bindings.driver` calls the plugins make, recorded."""

    CUresult = enum.Enum("CUresult", "CUDA_SUCCESS CUDA_ERROR_INVALID_VALUE")
    CUfunction_attribute = enum.Enum("CUfunction_attribute",
                                     "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES")

    def __init__(self):
        self.ctx = 0x1000
        self.calls: list[tuple] = []

    def _ok(self, *rest):
        return (self.CUresult.CUDA_SUCCESS, *rest)

    def cuCtxGetCurrent(self):
        return self._ok(self.ctx)

    def cuModuleLoadData(self, image):
        self.calls.append(("load", self.ctx, image))
        return self._ok(f"module{len(self.calls)}")

    def cuModuleGetFunction(self, module, name):
        return self._ok((module, name))

    def cuFuncSetAttribute(self, fn, attr, value):
        self.calls.append(("attr", value))
        return self._ok()

    def cuModuleUnload(self, module):
        self.calls.append(("unload", module))
        return self._ok()

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shared, stream, args, extra):
        self.calls.append(("launch", fn, (gx, gy, gz), bx, shared, stream, args[0]))
        return self._ok()


@pytest.fixture
def drv(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(tp, "_driver", lambda: d)
    return d


def library() -> tp.KernelLibrary:
    img = lambda act: tp.KernelImage(f"cubin-{act}".encode(), "nvfp4_w4a16_gemm_kernel",  # noqa: E731
                                     4, 64 * 1024, 16, 64)
    return tp.KernelLibrary({tp.KernelImage.key("nvfp4_w4a16_gemm", 89, act): img(act)
                             for act in ("fp32", "bf16")})


def desc(dims, type_name="FLOAT"):
    return types.SimpleNamespace(dims=dims, type=types.SimpleNamespace(name=type_name))


NVFP4 = tp.GEMM_OPS["NvFp4W4A16Gemm"]


def launch(lib, x_dims, type_name="FLOAT", n=130):
    inputs = [0xA0, 0xB0, 0xC0, 0xD0]  # x, packed, block scales, global scale
    tp.launch_gemm(lib, NVFP4, 89, [desc(x_dims, type_name), desc((n, 72))], inputs, [0xE0], 5)


def test_the_kernel_is_the_one_of_the_activation_dtype(drv):
    lib = library()
    launch(lib, (2, 9, 144), "BF16")
    launch(lib, (9, 144), "FLOAT")
    loads = [c for c in drv.calls if c[0] == "load"]
    assert [c[2] for c in loads] == [b"cubin-bf16", b"cubin-fp32"]  # bf16 data: the bf16 cubin
    grid = [c[2] for c in drv.calls if c[0] == "launch"]
    assert grid == [(2, 3, 1), (1, 3, 1)]  # M = 18 then 9 rows of 16, N = 130 in blocks of 64
    launch_args = [c[6] for c in drv.calls if c[0] == "launch"][0]
    assert launch_args == (0xA0, 0xB0, 0xC0, 0xD0, 0xE0, 18, 130, 144, 0, 0)
    with pytest.raises(RuntimeError, match=r"no kernel 'nvfp4_w4a16_gemm\.sm89\.fp16'"):
        launch(lib, (9, 144), "HALF")  # never another dtype's cubin
    with pytest.raises(RuntimeError, match="activation type INT8 has no kernel; allowed: FLOAT"):
        launch(lib, (9, 144), "INT8")


def test_functions_are_loaded_once_per_cuda_context_and_unloaded_on_close(drv):
    lib = library()
    launch(lib, (4, 144))
    launch(lib, (5, 144))  # same context: the cached function
    drv.ctx = 0x2000  # another context (another device, or a new one): its own module
    launch(lib, (4, 144))
    loads = [c[1] for c in drv.calls if c[0] == "load"]
    assert loads == [0x1000, 0x2000]
    assert [c for c in drv.calls if c[0] == "attr"] == [("attr", 64 * 1024)] * 2  # > 48 KiB opt-in
    lib.close()
    assert len([c for c in drv.calls if c[0] == "unload"]) == 2 and not lib._loaded
    drv.ctx = 0
    with pytest.raises(RuntimeError, match="no CUDA context is current"):
        launch(lib, (4, 144))


@pytest.mark.parametrize("x_dims, n", [((0, 144), 130), ((3, 0, 144), 130), ((4, 144), 0)])
def test_an_empty_output_launches_nothing(drv, x_dims, n):
    launch(library(), x_dims, n=n)
    assert drv.calls == []  # no module load, no zero-grid launch


def test_plugin_kernel_keys_from_manifest_entries():
    entries = [({"NvFp4W4A16Gemm": 3, "AllReduce": 2}, {"NvFp4W4A16Gemm": ["bf16", "fp32"]}),
               ({"Fp8W8A16Gemm": 1}, {"Fp8W8A16Gemm": ["fp32"]}), ({}, {})]
    assert tp.plugin_kernel_keys(entries, 89) == {
        "nvfp4_w4a16_gemm.sm89.bf16", "nvfp4_w4a16_gemm.sm89.fp32", "fp8_w8a16_gemm.sm89.fp32"}
    with pytest.raises(ValueError, match="NvFp4W4A16Gemm plugin layers but no recorded activation"):
        tp.plugin_kernel_keys([({"NvFp4W4A16Gemm": 1}, None)], 89)


def test_plugin_objects_are_held_until_tensorrt_destroys_them():
    keeper = tp.Keeper()

    class Plugin(tp.PluginDefaults):
        def clone(self):
            return keeper.hold(Plugin())

    first = keeper.hold(Plugin())
    clones = [first.clone() for _ in range(5)]  # one per execution context
    assert len(keeper) == 6
    for c in clones:
        c.destroy()  # TensorRT released the context's clone
    assert len(keeper) == 1
    first.destroy()
    first.destroy()  # idempotent
    assert len(keeper) == 0


class FakeNccl:
    def __init__(self):
        self.destroyed: list[int] = []

    def ncclCommInitRank(self, comm_ref, size, uid, rank):
        ctypes.cast(comm_ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0xC0 + rank
        return 0

    def ncclCommDestroy(self, handle):
        self.destroyed.append(handle)
        return 0

    def ncclAllReduce(self, *args):
        self.reduced = args
        return 0


@pytest.fixture
def nccl(monkeypatch):
    lib = FakeNccl()
    monkeypatch.setattr(tc, "load_nccl", lambda: lib)
    return lib


def test_the_nccl_communicator_is_destroyed_once(nccl):
    comm = tc.NcclCommunicator(1, 2, bytes(tc.NCCL_UNIQUE_ID_BYTES))
    shared = tc.Collectives(comm)
    assert shared.communicator("AllReduce", 2, 1) is comm
    shared.close()
    shared.close()
    assert nccl.destroyed == [0xC1] and comm.closed
    with pytest.raises(RuntimeError, match=r"no NCCL communicator is open \(none was given to register_plugins, or it was closed\)"):
        shared.communicator("AllReduce", 2, 1)
    with tc.NcclCommunicator(0, 2, bytes(tc.NCCL_UNIQUE_ID_BYTES)):
        pass
    assert nccl.destroyed == [0xC1, 0xC0]
    tc.NcclCommunicator(1, 2, bytes(tc.NCCL_UNIQUE_ID_BYTES))  # dropped unclosed: collected
    gc.collect()
    assert nccl.destroyed == [0xC1, 0xC0, 0xC1]
    with pytest.raises(ValueError, match="NCCL rank 2 of 2: expected 0 <= rank < size"):
        tc.NcclCommunicator(2, 2, bytes(tc.NCCL_UNIQUE_ID_BYTES))


def test_registered_plugins_close_unloads_kernels_and_destroys_the_communicator(drv, nccl):
    lib = library()
    launch(lib, (4, 144))
    reg = tp.RegisteredPlugins({}, lib, tc.Collectives(tc.NcclCommunicator(0, 1, bytes(128))))
    reg.close()
    assert [c[0] for c in drv.calls].count("unload") == 1 and nccl.destroyed == [0xC0]


def test_collective_enqueue_skips_an_empty_input_and_sends_the_rest():
    from metrale.builder.trt_env import load_trt

    pytest.importorskip("tensorrt_rtx")
    plugin_cls, _ = tc.collective_classes(load_trt("rtx").trt)
    sent = []
    comm = types.SimpleNamespace(size=2, rank=0, closed=False,
                                 all_reduce=lambda *a: sent.append(("reduce", *a)),
                                 all_gather=lambda *a: sent.append(("gather", *a)))
    shared = tc.Collectives(comm)
    reduce_, gather = plugin_cls("AllReduce", 2, 0, shared), plugin_cls("AllGather", 2, 0, shared)
    reduce_.enqueue([desc((0, 4), "BF16")], None, [0x10], [0x20], None, 5)  # nothing to reduce
    gather.enqueue([desc((1, 0, 8), "FLOAT")], None, [0x10], [0x20], None, 5)
    assert sent == []  # every rank has the same shapes: all skip together
    reduce_.enqueue([desc((3, 4), "BF16")], None, [0x10], [0x20], None, 5)
    gather.enqueue([desc((1, 2, 8), "HALF")], None, [0x10], [0x20], None, 5)
    assert sent == [("reduce", 0x10, 0x20, 12, 9, 5), ("gather", 0x10, 0x20, 16, 6, 5)]


# -- the grouped MoE and the dynamic conv (plugins.trt_kernel_ops) --------------------------------

from metrale.plugins import trt_kernel_ops as tko  # noqa: E402


def kernel_library(blocks: dict[str, dict]) -> tp.KernelLibrary:
    return tp.KernelLibrary({tp.KernelImage.key(k, 89, "bf16"): tp.KernelImage(
        f"cubin-{k}".encode(), f"{k}_kernel", 4, 0, 1, 1, constexprs=c) for k, c in blocks.items()})


def test_moe_launches_both_stages_over_one_workspace(drv):
    from metrale.plugins import nvfp4_moe

    lib = kernel_library({"nvfp4_moe_gate_up": nvfp4_moe.GATE_UP_BLOCKS,
                          "nvfp4_moe_down": nvfp4_moe.DOWN_BLOCKS})
    t, h, k, e, inter = 5, 96, 2, 4, 48
    descs = [desc((t, h), "BF16"), desc((t, k), "INT64"), desc((t, k), "BF16"),
             desc((e, 2 * inter, h // 2)), desc((e, 2 * inter, h // 16)), desc((e, 2)),
             desc((e, h, inter // 2)), desc((e, h, inter // 16)), desc((e,))]
    inputs = [0x10 * (i + 1) for i in range(9)]
    tko.launch_moe(lib, 89, descs, inputs, [0xF00], workspace=0xAAA, stream=7)
    launches = [c for c in drv.calls if c[0] == "launch"]
    assert [c[1][1] for c in launches] == [b"nvfp4_moe_gate_up_kernel", b"nvfp4_moe_down_kernel"]
    # stage 1: one program per routed (token, expert) pair and block of I; stage 2: per token
    assert [c[2] for c in launches] == [(t * k, -(-inter // 32), 1), (t, -(-h // 32), 1)]
    assert all(c[5] == 7 for c in launches)  # both on TensorRT's stream, in order
    gate_up, down = (c[6] for c in launches)
    assert gate_up == (0x10, 0x20, 0x40, 0x50, 0x60, 0xAAA, h, inter, k, 0, 0)  # x, ids, gate/up -> ws
    assert down == (0xAAA, 0x20, 0x30, 0x70, 0x80, 0x90, 0xF00, h, inter, k, 0, 0)  # ws, ids, w, down -> y
    assert tko.moe_workspace_bytes((t, h), (t, k), (e, 2 * inter, h // 2)) == t * k * inter * 4
    drv.calls.clear()
    tko.launch_moe(lib, 89, [desc((0, h), "BF16"), *descs[1:]], inputs, [0xF00], 0xAAA, 7)
    assert drv.calls == []  # no token: nothing launched


def test_conv_launch_carries_the_block_attribute(drv):
    from metrale.plugins import dynamic_conv

    lib = kernel_library({"dflash2_dynamic_conv": dynamic_conv.TRITON_BLOCKS})
    tko.launch_conv(lib, 89, 8, [desc((2, 16, 300), "BF16"), desc((2, 16, 4, 2), "BF16")],
                    [0xA, 0xB], [0xC], stream=3)
    (launch,) = [c for c in drv.calls if c[0] == "launch"]
    assert launch[2] == (2 * 16, 2, 1)  # a program per slot and 256 channels
    assert launch[6] == (0xA, 0xB, 0xC, 16, 300, 4, 8, 0, 0)  # x, kernel, y, T, H, G, block
    with pytest.raises(RuntimeError, match=r"no kernel 'dflash2_dynamic_conv\.sm89\.fp32'"):
        tko.launch_conv(lib, 89, 8, [desc((1, 4, 8)), desc((1, 4, 2, 2))], [1, 2], [3], 3)


def test_every_kernel_op_names_kernels_that_aot_compiles():
    from metrale.plugins.aot import kernel_specs

    compiled = {s["name"].removesuffix("_kernel") for s in kernel_specs()}
    assert {k for ks in tp.KERNELS_OF_OP.values() for k in ks} == compiled
    entries = [({"NvFp4MoeW4A16": 1, "DFlash2DynamicConv": 4},
                {"NvFp4MoeW4A16": ["fp32"], "DFlash2DynamicConv": ["bf16"]})]
    assert tp.plugin_kernel_keys(entries, 120) == {
        "nvfp4_moe_gate_up.sm120.fp32", "nvfp4_moe_down.sm120.fp32", "dflash2_dynamic_conv.sm120.bf16"}
