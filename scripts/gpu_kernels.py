"""The kernel checks of scripts/gpu_checks.py (NVIDIA GPU only), one subcommand each:

    python scripts/gpu_kernels.py kernels OUT.json   every Triton kernel JIT-compiled for this
                                                     GPU against its PyTorch reference on CPU,
                                                     in float32 and bfloat16
    python scripts/gpu_kernels.py cubins OUT.json    every kernel compiled ahead of time for this
                                                     GPU's SM (`plugins.aot`, fp32 and bf16) and
                                                     launched through the CUDA driver API against
                                                     the same references: the ops' own launchers
                                                     run with a stand-in that launches the cubin
                                                     instead of the JIT kernel, and the GEMMs also
                                                     through `trt_plugin.launch_gemm`, the
                                                     TensorRT plugin's launch path

OUT.json is rewritten after every case ({"sm", "passed", "failed", "cases": [...]}), so a run cut
short keeps what it did. Each case is reported and the next one runs; the exit status is 1 when
any case failed. Run without TRITON_INTERPRET (Triton fixes its mode at import).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace


class Results:
    """Cases appended and written to `path` at once (a temporary file renamed into place)."""

    def __init__(self, path: Path, **head):
        self.path, self.head, self.cases = path, head, []
        self.write()

    def add(self, case: dict) -> None:
        self.cases.append(case)
        self.write()
        print(("ok  " if case["ok"] else "FAIL") + f"  {case['case']}", flush=True)

    @property
    def failed(self) -> int:
        return sum(not c["ok"] for c in self.cases)

    def write(self) -> None:
        data = {**self.head, "passed": len(self.cases) - self.failed, "failed": self.failed,
                "cases": self.cases}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.path)

    def run(self, name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            diff = fn()
            self.add({"case": name, "ok": True, "max_abs_diff": diff,
                      "seconds": round(time.perf_counter() - t0, 3)})
        except Exception:  # noqa: BLE001 - every case is reported
            self.add({"case": name, "ok": False, "error": traceback.format_exc(limit=4)})


def _close(actual, expected, dtype, k: int = 64) -> float:
    """`k`: the reduction length. Two float32 sums of k terms in other orders differ by rounding
    that grows like sqrt(k) (at k = 512, on outputs of a few units, more than a flat 1e-5), so the
    float32 atol scales with sqrt(k / 64); a wrong kernel misses by the outputs' own magnitude."""
    import torch

    rtol, atol = (1e-5, 1e-5 * max(1.0, (k / 64) ** 0.5)) if dtype == torch.float32 else (2 ** -7, 1e-3)
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), rtol=rtol, atol=atol)
    return float((actual.cpu().float() - expected.cpu().float()).abs().max())


def _nvfp4(shape, g, scale_hi=400.0):
    import torch

    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    bs = torch.rand(*shape[:-1], shape[-1] // 16, generator=g) * scale_hi + 0.01
    return packed, bs.to(torch.float8_e4m3fn)


def kernel_cases():
    """(name, run) pairs; run() checks an op's Triton face on CUDA against its CPU reference and
    returns the largest absolute difference."""
    import torch

    from metrale.plugins import dynamic_conv, fp8_gemm, nvfp4_gemm, nvfp4_moe

    cuda = lambda *ts: [t.cuda() for t in ts]  # noqa: E731
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        dn = str(dtype).removeprefix("torch.")
        for m, n, k in ((1, 70, 80), (17, 64, 64), (5, 130, 144), (64, 256, 512)):
            def fp8(m=m, n=n, k=k, dtype=dtype):
                g = torch.Generator().manual_seed(m * 1000 + n + k)
                w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
                scale = torch.rand(n, generator=g) * 0.01 + 1e-3
                x = torch.randn(m, k, generator=g).to(dtype)
                y = fp8_gemm.fp8_w8a16_gemm_triton(*cuda(x, w, scale))
                return _close(y, fp8_gemm.fp8_w8a16_gemm(x, w, scale), dtype, k)

            def fp4(m=m, n=n, k=k, dtype=dtype):
                g = torch.Generator().manual_seed(n + k)
                k16 = -(-k // 16) * 16
                packed, bs = _nvfp4((n, k16), g)
                gs = torch.tensor(3e-4)
                x = torch.randn(m, k16, generator=g).to(dtype)
                y = nvfp4_gemm.nvfp4_w4a16_gemm_triton(*cuda(x, packed, bs, gs))
                return _close(y, nvfp4_gemm.nvfp4_w4a16_gemm(x, packed, bs, gs), dtype, k)

            cases += [(f"fp8_w8a16_gemm {dn} {m}x{n}x{k}", fp8), (f"nvfp4_w4a16_gemm {dn} {m}x{n}x{k}", fp4)]
        for e, h, i, t, topk in ((4, 48, 32, 5, 2), (3, 80, 48, 2, 3)):
            def moe(e=e, h=h, i=i, t=t, topk=topk, dtype=dtype):
                g = torch.Generator().manual_seed(e * h + i)
                gu_p, gu_s = _nvfp4((e, 2 * i, h), g, 50.0)
                dn_p, dn_s = _nvfp4((e, h, i), g, 50.0)
                ws = (gu_p, gu_s, torch.rand(e, 2, generator=g) * 2e-3 + 1e-4,
                      dn_p, dn_s, torch.rand(e, generator=g) * 2e-3 + 1e-4)
                x = torch.randn(t, h, generator=g).to(dtype)
                ids = torch.randint(0, e, (t, topk), generator=g)
                w = torch.rand(t, topk, generator=g).to(dtype)
                y = nvfp4_moe.nvfp4_moe_w4a16_triton(*cuda(x, ids, w, *ws))
                return _close(y, nvfp4_moe.nvfp4_moe_w4a16(x, ids, w, *ws), dtype)

            cases.append((f"nvfp4_moe_w4a16 {dn} E{e} H{h} I{i} T{t} k{topk}", moe))
        for b, t, h, groups, block in ((2, 8, 40, 4, 4), (1, 6, 300, 3, 3), (1, 5, 16, 16, 5)):
            def conv(b=b, t=t, h=h, groups=groups, block=block, dtype=dtype):
                g = torch.Generator().manual_seed(h + t)
                x = torch.randn(b, t, h, generator=g).to(dtype)
                kern = torch.randn(b, t, groups, 2, generator=g).to(dtype)
                y = dynamic_conv.dflash2_dynamic_conv_triton(*cuda(x, kern), block)
                assert torch.equal(y.cpu(), dynamic_conv.dflash2_dynamic_conv(x, kern, block))
                return 0.0

            cases.append((f"dflash2_dynamic_conv {dn} {b}x{t}x{h} G{groups} block{block}", conv))
    return cases


# -- the AOT cubins through the driver API -----------------------------------------------------

TRITON_TYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "uint8": "u8",
               "int8": "i8", "int64": "i64", "int32": "i32"}


class CubinKernel:
    """Stands in for a `@triton.jit` kernel in `kernels.<name>[grid](*args, **constexprs)`:
    launches the AOT cubin whose pointer types match the tensors passed, through the driver."""

    def __init__(self, name: str, metas: list[dict], lib, sm: int):
        self.name, self.metas, self.lib, self.sm = name, metas, lib, sm
        self.launches: list[str] = []  # the keys launched (the check asserts each case used one)

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launch(tuple(grid), args, kw)

    def _meta_for(self, args) -> dict:
        for meta in self.metas:
            types = list(meta["signature"].values())
            if all(not t.startswith("*") or (hasattr(a, "dtype") and
                                             "*" + TRITON_TYPE[str(a.dtype).removeprefix("torch.")] == t)
                   for a, t in zip(args, types)):
                return meta
        got = [str(a.dtype) if hasattr(a, "dtype") else type(a).__name__ for a in args]
        raise RuntimeError(f"{self.name}: no cubin for argument types {got}; compiled: "
                           f"{[list(m['signature'].values()) for m in self.metas]}")

    def prepare(self, grid, args, kw) -> tuple[str, dict, tuple, tuple, tuple]:
        """(kernel key, its metadata, argument values, their ctypes, 3-d grid) for one call, the
        compiled constexprs checked against the call's (pure: no device needed)."""
        import ctypes

        from metrale.plugins.trt_plugin import KernelImage

        meta = self._meta_for(args)
        if len(args) != len(meta["signature"]):
            raise RuntimeError(f"{self.name}: {len(args)} arguments, the cubin takes "
                               f"{len(meta['signature'])} ({', '.join(meta['signature'])})")
        wrong = {k: v for k, v in kw.items() if k in meta["constexprs"] and meta["constexprs"][k] != v}
        if wrong:
            raise RuntimeError(f"{self.name}: launched with {wrong}, compiled with "
                               f"{meta['constexprs']}")
        ctype = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float}
        values, types = [], []
        for a, t in zip(args, meta["signature"].values()):
            values.append(a.data_ptr() if t.startswith("*") else a)
            types.append(ctypes.c_void_p if t.startswith("*") else ctype[t])
        scratch = meta.get("scratch_args", 2)  # global and profile scratch: none
        values += [0] * scratch
        types += [ctypes.c_uint64] * scratch
        key = KernelImage.key(meta["kernel"], self.sm, meta["act"])
        return key, meta, tuple(values), tuple(types), (*grid, 1, 1)[:3]

    def launch(self, grid, args, kw) -> None:
        import torch

        from metrale.plugins.trt_plugin import _check, _driver

        key, meta, values, types, grid = self.prepare(grid, args, kw)
        fn = self.lib.function(key)
        drv = _driver()
        stream = torch.cuda.current_stream().cuda_stream
        _check(drv, drv.cuLaunchKernel(fn, *grid, 32 * meta["num_warps"], 1, 1, meta["shared"],
                                       stream, (values, types), 0))
        self.launches.append(key)


def cubin_cases(sm: int, folder: Path):
    """Compile every kernel for `sm` in fp32 and bf16, then (name, run) pairs: the kernel cases
    with the cubins launched in place of the JIT kernels, and the GEMMs through the TensorRT
    plugin's own `launch_gemm`."""
    import torch

    from metrale.plugins import aot, fp8_gemm, nvfp4_gemm, triton_mode
    from metrale.plugins.trt_plugin import GEMM_OPS, KernelLibrary, launch_gemm

    metas = aot.compile_kernels(folder, sms=(sm,), acts=("fp32", "bf16"))
    lib = KernelLibrary.from_dir(folder)
    shims = {}
    for meta in metas:
        name = meta["kernel"] + "_kernel"
        shims.setdefault(name, CubinKernel(name, [], lib, sm)).metas.append(meta)
    stand_in = SimpleNamespace(**shims)

    def through_cubins(run):
        def wrapped():
            real = triton_mode.load_kernels  # what the op launchers call
            triton_mode.load_kernels = lambda device="cuda": stand_in
            before = sum(len(s.launches) for s in shims.values())
            try:
                diff = run()
            finally:
                triton_mode.load_kernels = real
            assert sum(len(s.launches) for s in shims.values()) > before, "no cubin was launched"
            return diff
        return wrapped

    cases = [(f"cubin sm{sm} {name}", through_cubins(run)) for name, run in kernel_cases()]

    def launch(op, x, weights, n):
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device="cuda")
        type_name = {torch.float32: "FLOAT", torch.bfloat16: "BF16"}[x.dtype]
        desc = [SimpleNamespace(dims=tuple(x.shape), type=SimpleNamespace(name=type_name)),
                SimpleNamespace(dims=tuple(weights[0].shape))]
        ptrs = [x.data_ptr()] + [w.data_ptr() for w in weights]
        launch_gemm(lib, GEMM_OPS[op], sm, desc, ptrs, [y.data_ptr()],
                    torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        return y

    for dtype in (torch.float32, torch.bfloat16):
        def fp8(m=9, n=130, k=144, dtype=dtype):
            g = torch.Generator().manual_seed(1)
            w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = torch.rand(n, generator=g) * 0.01 + 1e-3
            x = torch.randn(m, k, generator=g).to(dtype)
            y = launch("Fp8W8A16Gemm", x.cuda(), [w.view(torch.int8).cuda(), scale.cuda()], n)
            return _close(y, fp8_gemm.fp8_w8a16_gemm(x, w, scale), dtype, k)

        def fp4(m=9, n=130, k=144, dtype=dtype):
            g = torch.Generator().manual_seed(2)
            packed, bs = _nvfp4((n, k), g)
            gs = torch.tensor(3e-4)
            x = torch.randn(m, k, generator=g).to(dtype)
            y = launch("NvFp4W4A16Gemm", x.cuda(),
                       [packed.view(torch.int8).cuda(), bs.view(torch.int8).cuda(), gs.cuda()], n)
            return _close(y, nvfp4_gemm.nvfp4_w4a16_gemm(x, packed, bs, gs), dtype, k)

        dn = str(dtype).removeprefix("torch.")
        cases += [(f"plugin launch Fp8W8A16Gemm sm{sm} {dn}", fp8),
                  (f"plugin launch NvFp4W4A16Gemm sm{sm} {dn}", fp4)]
    return cases


def _sm() -> int:
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return major * 10 + minor


def step_kernel_cases():
    """(name, run) pairs: the decode step's kernels (`plugins.step_kernels`) against the PyTorch
    forms on this GPU, the check an engine's load runs (`step_check.agree`), per activation dtype."""
    import torch

    from metrale.runtime.backends.step_check import agree

    def check(dtype):
        def run():
            why = agree(torch.device("cuda"), dtype)
            assert why == "", why
            return 0.0
        return run

    return [(f"step kernels {str(d).removeprefix('torch.')}", check(d)) for d in (torch.float32, torch.bfloat16)]


def cmd_kernels(out: Path) -> int:
    results = Results(out, sm=_sm())
    for name, run in kernel_cases() + step_kernel_cases():
        results.run(name, run)
    return 1 if results.failed else 0


def cmd_cubins(out: Path) -> int:
    sm = _sm()
    results = Results(out, sm=sm)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cases = cubin_cases(sm, Path(tmp))
        except Exception:  # noqa: BLE001 - the compile failure is the finding
            results.add({"case": f"compile the kernels for sm{sm}", "ok": False,
                         "error": traceback.format_exc(limit=4)})
            return 1
        for name, run in cases:
            results.run(name, run)
    return 1 if results.failed else 0


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: these checks compile the kernels for the GPU", file=sys.stderr)
        return 2
    commands = {"kernels": cmd_kernels, "cubins": cmd_cubins}
    if len(argv) != 2 or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
