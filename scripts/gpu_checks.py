"""Helper of scripts/gpu_checks.sh: the checks that need an NVIDIA GPU, as subcommands.

    python scripts/gpu_checks.py env OUT.json       the GPU, its SM, package versions and the
                                                    TensorRT flavour that can build for the SM
    python scripts/gpu_checks.py kernels OUT.json   every Triton kernel compiled for this GPU (not
                                                    the interpreter) against its PyTorch
                                                    reference on CPU, and the GEMM cubins launched
                                                    exactly as the TensorRT plugin launches them
    python scripts/gpu_checks.py summary OUT_DIR STEPS.tsv   one summary.json of every step

Run without TRITON_INTERPRET (Triton fixes its mode at import). Each check records its result
and goes on, so one failure does not hide the others; the exit status says whether all passed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace


def _version(module: str) -> str | None:
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return None
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except Exception as exc:  # noqa: BLE001 - a report of what is there, whatever breaks
        return f"does not import: {exc}"


def cmd_env(out: Path) -> int:
    import torch

    info: dict = {"python": sys.version.split()[0], "torch": torch.__version__,
                  "cuda_available": torch.cuda.is_available()}
    for m in ("triton", "tensorrt", "tensorrt_rtx", "cuda.bindings", "modelopt", "onnx",
              "safetensors", "tokenizers", "fastapi", "typer"):
        info[m] = _version(m)
    info["build_flavor"], info["build_flavor_reason"] = None, "no CUDA device"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        info.update(gpu=torch.cuda.get_device_name(0), sm=major * 10 + minor)
        info["build_flavor"], info["build_flavor_reason"] = _flavor(info["sm"])
    out.write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))
    return 0 if info["cuda_available"] else 1


def _flavor(sm: int) -> tuple[str | None, str]:
    """Full TensorRT where it imports (it builds for this GPU), else TensorRT-RTX where its
    compute capabilities list the SM."""
    from metrale.builder.trt_env import TrtUnavailable, load_trt

    reasons = []
    for flavor in ("tensorrt", "rtx"):
        try:
            tm = load_trt(flavor)
        except TrtUnavailable as exc:
            reasons.append(str(exc))
            continue
        if sm in tm.supported_sms():
            return flavor, f"{flavor} {tm.version} builds SM{sm}"
        reasons.append(f"{flavor} {tm.version} builds SM {tm.supported_sms()}, not SM{sm}")
    return None, "; ".join(reasons)


# -- kernels ---------------------------------------------------------------------------------


def _close(actual, expected, dtype) -> float:
    import torch

    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2 ** -7, 1e-3)
    torch.testing.assert_close(actual.cpu().float(), expected.cpu().float(), rtol=rtol, atol=atol)
    return float((actual.cpu().float() - expected.cpu().float()).abs().max())


def _nvfp4(shape, g, scale_hi=400.0):
    import torch

    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    bs = torch.rand(*shape[:-1], shape[-1] // 16, generator=g) * scale_hi + 0.01
    return packed, bs.to(torch.float8_e4m3fn)


def kernel_cases():
    """(name, run) pairs; run() checks the CUDA kernel against the CPU reference and returns the
    largest absolute difference."""
    import torch

    from metrale.plugins import draft_stop, dynamic_conv, fp8_gemm, nvfp4_gemm, nvfp4_moe

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
                return _close(y, fp8_gemm.fp8_w8a16_gemm(x, w, scale), dtype)

            def fp4(m=m, n=n, k=k, dtype=dtype):
                g = torch.Generator().manual_seed(n + k)
                k16 = -(-k // 16) * 16
                packed, bs = _nvfp4((n, k16), g)
                gs = torch.tensor(3e-4)
                x = torch.randn(m, k16, generator=g).to(dtype)
                y = nvfp4_gemm.nvfp4_w4a16_gemm_triton(*cuda(x, packed, bs, gs))
                return _close(y, nvfp4_gemm.nvfp4_w4a16_gemm(x, packed, bs, gs), dtype)

            cases += [(f"fp8_w8a16_gemm {dn} {m}x{n}x{k}", fp8), (f"nvfp4_w4a16_gemm {dn} {m}x{n}x{k}", fp4)]
        for e, h, i, t, topk in ((4, 48, 32, 5, 2), (3, 80, 48, 2, 3)):
            def moe(e=e, h=h, i=i, t=t, topk=topk, dtype=dtype):
                g = torch.Generator().manual_seed(e * h + i)
                gu_p, gu_s = _nvfp4((e, 2 * i, h), g, 50.0)
                dn_p, dn_s = _nvfp4((e, h, i), g, 50.0)
                ws = (gu_p, gu_s, torch.rand(e, generator=g) * 2e-3 + 1e-4,
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
        for cumulative in (False, True):
            def stop(cumulative=cumulative, dtype=dtype):
                g = torch.Generator().manual_seed(5)
                v = 2100
                logits = torch.randint(-3, 4, (3, v), generator=g).to(dtype)
                logits[1] = torch.randn(v, generator=g).to(dtype) * 3
                logits[2, 2050] = 9.0
                args = (torch.tensor(0.01), torch.tensor(cumulative), torch.tensor([1.0, 0.5, 0.25]))
                got = [t.cpu() for t in draft_stop.draft_stop_triton(*cuda(logits, *args))]
                ref = draft_stop.draft_stop(logits, *args)
                torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=0)
                torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=0)
                assert torch.equal(got[1], ref[1]) and torch.equal(got[3], ref[3])
                assert torch.equal(got[4], ref[4])
                return float((got[0] - ref[0]).abs().max())

            cases.append((f"draft_stop {dn} cumulative={cumulative}", stop))
    return cases


def plugin_launch_cases(sm: int, folder: Path):
    """The GEMM cubins compiled ahead of time (fp32 activations, as `metrale build` compiles
    them) and launched through `trt_plugin.launch_gemm`: the TensorRT plugin's own launch path."""
    import torch

    from metrale.plugins import fp8_gemm, nvfp4_gemm
    from metrale.plugins.aot import compile_kernels
    from metrale.plugins.trt_plugin import GEMM_OPS, KernelLibrary, launch_gemm

    compile_kernels(folder, sms=(sm,), act="fp32",
                    kernels=("fp8_w8a16_gemm_kernel", "nvfp4_w4a16_gemm_kernel"))
    lib = KernelLibrary.from_dir(folder)

    def launch(op, x, weights, n):
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device="cuda")
        desc = [SimpleNamespace(dims=tuple(x.shape)), SimpleNamespace(dims=tuple(weights[0].shape))]
        ptrs = [x.data_ptr()] + [w.data_ptr() for w in weights]
        launch_gemm(lib, GEMM_OPS[op], sm, desc, ptrs, [y.data_ptr()],
                    torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        return y

    def fp8(m=9, n=130, k=144):
        g = torch.Generator().manual_seed(1)
        w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(n, generator=g) * 0.01 + 1e-3
        x = torch.randn(m, k, generator=g)
        y = launch("Fp8W8A16Gemm", x.cuda(), [w.view(torch.int8).cuda(), scale.cuda()], n)
        return _close(y, fp8_gemm.fp8_w8a16_gemm(x, w, scale), torch.float32)

    def fp4(m=9, n=130, k=144):
        g = torch.Generator().manual_seed(2)
        packed, bs = _nvfp4((n, k), g)
        gs = torch.tensor(3e-4)
        x = torch.randn(m, k, generator=g)
        y = launch("NvFp4W4A16Gemm", x.cuda(),
                   [packed.view(torch.int8).cuda(), bs.view(torch.int8).cuda(), gs.cuda()], n)
        return _close(y, nvfp4_gemm.nvfp4_w4a16_gemm(x, packed, bs, gs), torch.float32)

    return [(f"plugin launch Fp8W8A16Gemm sm{sm}", fp8), (f"plugin launch NvFp4W4A16Gemm sm{sm}", fp4)]


def cmd_kernels(out: Path) -> int:
    import os

    import torch

    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: these checks compile the kernels for the GPU")
    results, failed = [], 0
    major, minor = torch.cuda.get_device_capability(0)
    sm = major * 10 + minor
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cases = kernel_cases() + plugin_launch_cases(sm, Path(tmp))
        except Exception:  # noqa: BLE001 - reported, then the JIT cases still run
            results.append({"case": "plugin launch setup", "ok": False,
                            "error": traceback.format_exc(limit=3)})
            failed += 1
            cases = kernel_cases()
        for name, run in cases:
            t0 = time.perf_counter()
            try:
                diff = run()
                results.append({"case": name, "ok": True, "max_abs_diff": diff,
                                "seconds": round(time.perf_counter() - t0, 3)})
            except Exception:  # noqa: BLE001 - every case is reported
                failed += 1
                results.append({"case": name, "ok": False, "error": traceback.format_exc(limit=3)})
            print(("ok  " if results[-1]["ok"] else "FAIL") + f"  {name}", flush=True)
    out.write_text(json.dumps({"sm": sm, "passed": len(results) - failed, "failed": failed,
                               "cases": results}, indent=2) + "\n")
    return 1 if failed else 0


def cmd_summary(out_dir: Path, steps: Path) -> int:
    rows = []
    for line in steps.read_text().splitlines() if steps.is_file() else []:
        name, status, seconds, note = (line.split("\t") + ["", "", ""])[:4]
        rows.append({"step": name, "status": status, "seconds": int(seconds or 0), "note": note})
    ok = bool(rows) and all(r["status"] in ("ok", "skipped") for r in rows)
    summary: dict = {"steps": rows, "all_ok": ok}
    for name in ("env.json", "kernels.json", "bench-torch-cuda.json", "bench-tensorrt.json"):
        path = out_dir / name
        if path.is_file():
            data = json.loads(path.read_text())
            if name == "kernels.json":
                data = {k: data[k] for k in ("sm", "passed", "failed")}
            elif name.startswith("bench"):
                data = {"modes": {m["mode"]: {k: m[k] for k in ("tokens_per_s", "tau", "speedup")}
                                  for m in data["modes"]},
                        **({"trt_runners": data["trt_runners"]} if "trt_runners" in data else {})}
            summary[name.removesuffix(".json")] = data
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"all_ok": summary["all_ok"], "steps": rows}, indent=2))
    return 0 if summary["all_ok"] else 1


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "env":
        return cmd_env(Path(argv[1]))
    if len(argv) >= 2 and argv[0] == "kernels":
        return cmd_kernels(Path(argv[1]))
    if len(argv) >= 3 and argv[0] == "summary":
        return cmd_summary(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
