"""Compiling the Triton kernels ahead of time to one cubin per target SM.

The compiler needs Triton's compiled mode (see `triton_mode`): `compile_kernels_in_subprocess` (or `python -m metrale.plugins.aot OUT_DIR`) runs it in a
process of its own, without `TRITON_INTERPRET`.

`compile_kernels(out_dir, sms, acts)` needs no GPU: `triton.compile(ASTSource(fn, signature,
constexprs), target=GPUTarget("cuda", cc, 32))` emits a cubin for each SM (SM90/100/120 compile
as their `a` variants: that exact architecture only). A cubin is specialised to the activation
dtype it was compiled for (`act`: fp32, fp16 or bf16; pointer types and the dot path differ), so
per kernel, SM and act it writes `<kernel>.sm<NN>.<act>.cubin` and `.json`, <kernel> being the
Triton function's name without its `_kernel` suffix (`nvfp4_w4a16_gemm.sm89.bf16.cubin`, symbol
`nvfp4_w4a16_gemm_kernel`); the JSON is what a launcher (the TensorRT plugin) needs: the symbol
name, the act, block size, shared memory, the argument list, the grid rule and the cubin's
sha256. `compile_jobs(out_dir, [(kernel, sm, act), ...])` compiles exactly the listed
combinations (what an engine directory's plugin layers use).

Launch contract of every cubin: the kernel's non-constexpr arguments in signature order, then
`scratch_args` u64 scratch pointers (global and profile scratch: two with the Triton releases
that have both, fewer with older ones; 0 when their sizes are 0), block
(32·num_warps, 1, 1), dynamic shared memory `shared` bytes, grid from `grid` (expressions over
the arguments and the constexprs, `cdiv(a, b)` = ceil(a/b)). Floating-point fusion is off in
every build (the option is passed explicitly, as its default changes between Triton releases).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from metrale.plugins.triton_mode import import_triton, load_kernels

log = logging.getLogger(__name__)

DEFAULT_SMS = (89, 90, 100, 120)
ACTS = ("fp32", "fp16", "bf16")


def _ptr(dtype: str) -> str:
    return "*" + dtype


def kernel_specs(act: str = "bf16") -> list[dict]:
    """One entry per kernel: signature (activation pointers of dtype `act`), constexprs,
    num_warps and the grid rule. The constexprs are the ones the op launchers use."""
    from metrale.plugins import dynamic_conv, fp8_gemm, nvfp4_gemm, nvfp4_moe

    gemm_ints = {"M": "i32", "N": "i32", "K": "i32"}
    dot = {"DOT_F32": act == "fp32"}  # tensor-core dot in bf16/fp16; float32 only for fp32
    moe_ints = {"H": "i32", "INTER": "i32", "TOPK": "i32"}
    return [
        dict(name="fp8_w8a16_gemm_kernel", blocks={**fp8_gemm.TRITON_BLOCKS, **dot}, num_warps=4,
             signature={"x_ptr": _ptr(act), "w_ptr": "*u8", "scale_ptr": "*fp32",
                        "y_ptr": _ptr(act), **gemm_ints},
             grid=["cdiv(M, BLOCK_M)", "cdiv(N, BLOCK_N)", "1"]),
        dict(name="nvfp4_w4a16_gemm_kernel", blocks={**nvfp4_gemm.TRITON_BLOCKS, **dot},
             num_warps=4,
             signature={"x_ptr": _ptr(act), "p_ptr": "*u8", "bs_ptr": "*u8", "gs_ptr": "*fp32",
                        "y_ptr": _ptr(act), **gemm_ints},
             grid=["cdiv(M, BLOCK_M)", "cdiv(N, BLOCK_N)", "1"]),
        dict(name="nvfp4_moe_gate_up_kernel", blocks=nvfp4_moe.GATE_UP_BLOCKS, num_warps=4,
             signature={"x_ptr": _ptr(act), "ids_ptr": "*i64", "gu_ptr": "*u8",
                        "gu_bs_ptr": "*u8", "gu_gs_ptr": "*fp32", "act_ptr": "*fp32",
                        **moe_ints},
             grid=["T * TOPK", "cdiv(INTER, BLOCK_I)", "1"],
             note="stage 1 of nvfp4_moe_w4a16; act is a float32 [T*TOPK, INTER] workspace"),
        dict(name="nvfp4_moe_down_kernel", blocks=nvfp4_moe.DOWN_BLOCKS, num_warps=4,
             signature={"act_ptr": "*fp32", "ids_ptr": "*i64", "wt_ptr": _ptr(act),
                        "dn_ptr": "*u8", "dn_bs_ptr": "*u8", "dn_gs_ptr": "*fp32",
                        "y_ptr": _ptr(act), **moe_ints},
             grid=["T", "cdiv(H, BLOCK_H)", "1"],
             note="stage 2 of nvfp4_moe_w4a16, launched after stage 1 on the same stream"),
        dict(name="dflash2_dynamic_conv_kernel", blocks=dynamic_conv.TRITON_BLOCKS, num_warps=4,
             signature={"x_ptr": _ptr(act), "k_ptr": _ptr(act), "y_ptr": _ptr(act),
                        "T": "i32", "H": "i32", "G": "i32", "BLOCK_SLOTS": "i32"},
             grid=["B * T", "cdiv(H, BLOCK_H)", "1"]),
    ]


def step_kernel_specs(act: str = "bf16") -> list[dict]:
    """`kernel_specs`' entries for the decode step's kernels (`step_kernels`), which no plugin
    launches: triton's JIT compiles them on the serving GPU. Compiled here (when named) to
    check that they build for every SM, with DFlash2's default K and selector dim and Qwen3's
    head size, and the MoE kernels' tiles at a router of up to 128 experts."""
    from metrale.plugins.step_kernels import LANE_BLOCK_S, MOE_BLOCK

    moe_ints = {"H": "i32", "INTER": "i32", "TOPK": "i32"}
    moe_blocks = {"BLOCK_I": MOE_BLOCK, "BLOCK_H": 2 * MOE_BLOCK}
    return [
        dict(name="dflash2_select_kernel", blocks={"BLOCK_K": 16, "BLOCK_D": 32}, num_warps=1,
             signature={"proj_ptr": _ptr(act), "logit_ptr": _ptr(act), "cand_ptr": "*i64",
                        "anchor_ptr": "*i64", "pred_ptr": _ptr(act), "succ_ptr": _ptr(act),
                        "out_ptr": "*i64", "N": "i32", "K": "i32", "D": "i32"},
             grid=["B", "1", "1"], note="step_kernels.dflash2_select: one program per sequence"),
        dict(name="qk_norm_rope_kernel", blocks={"HD": 128}, num_warps=1,
             signature={"q_in_ptr": _ptr(act), "k_in_ptr": _ptr(act), "w_ptr": _ptr(act),
                        "cos_ptr": _ptr(act), "sin_ptr": _ptr(act), "q_ptr": _ptr(act),
                        "k_ptr": _ptr(act), "T": "i32", "NH": "i32", "NKV": "i32",
                        "Q_STRIDE": "i32", "K_STRIDE": "i32", "eps": "fp32"},
             grid=["B * T", "NH + NKV", "1"], note="step_kernels.qk_norm_rope: one program per head and row"),
        dict(name="moe_route_kernel", blocks={"NORM": True, "BLOCK_E": 128, "BLOCK_H": 64}, num_warps=4,
             signature={"x_ptr": _ptr(act), "w_ptr": _ptr(act), "ids_ptr": "*i64", "wt_ptr": _ptr(act),
                        "H": "i32", "E": "i32", "TOPK": "i32"},
             grid=["T", "1", "1"], note="step_kernels.moe_experts' router: one program per row"),
        dict(name="moe_gate_up_kernel", blocks=moe_blocks, num_warps=4,
             signature={"x_ptr": _ptr(act), "ids_ptr": "*i64", "gu_ptr": _ptr(act), "act_ptr": "*fp32",
                        **moe_ints},
             grid=["T * TOPK", "cdiv(INTER, BLOCK_I)", "1"],
             note="step_kernels.moe_experts' stage 1; act is a float32 [T*TOPK, INTER] workspace"),
        dict(name="moe_down_kernel", blocks={"BLOCK_H": MOE_BLOCK, "BLOCK_I": 2 * MOE_BLOCK}, num_warps=4,
             signature={"act_ptr": "*fp32", "ids_ptr": "*i64", "wt_ptr": _ptr(act), "dn_ptr": _ptr(act),
                        "y_ptr": _ptr(act), **moe_ints},
             grid=["T", "cdiv(H, BLOCK_H)", "1"], note="step_kernels.moe_experts' stage 2"),
        dict(name="lane_attention_kernel", blocks={"HD": 128, "BLOCK_M": 16, "BLOCK_S": LANE_BLOCK_S,
                                                   "TREE": False, "DOT_F32": act == "fp32"}, num_warps=4,
             signature={"q_ptr": _ptr(act), "k_ptr": _ptr(act), "v_ptr": _ptr(act), "last_ptr": "*i64",
                        "hid_ptr": "*i64", "out_ptr": _ptr(act), "R": "i32", "S": "i32", "NKV": "i32",
                        "G": "i32", "scale": "fp32", "k_sb": "i32", "k_sh": "i32", "k_sd": "i32",
                        "v_sb": "i32", "v_sh": "i32", "v_ss": "i32"},
             grid=["B", "NKV", "1"], note="step_kernels.lane_attention: one program per lane and KV head"),
    ]


def kernel_jobs(sms: tuple[int, ...] = DEFAULT_SMS, acts: tuple[str, ...] = ("bf16",),
                kernels: tuple[str, ...] | None = None) -> list[tuple[str, int, str]]:
    """(kernel function name, sm, act) for every plugin kernel (or those named, the step
    kernels among them), SM and act: kernels outer, then SMs, then acts."""
    names = [s["name"] for s in kernel_specs()]
    known = names + [s["name"] for s in step_kernel_specs()]
    unknown = sorted(set(kernels or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; known: {', '.join(known)}")
    bad = sorted(set(acts) - set(ACTS))
    if bad:
        raise ValueError(f"activation dtypes {bad}: allowed {', '.join(ACTS)}")
    return [(n, sm, act) for n in (names if kernels is None else [k for k in known if k in kernels])
            for sm in sms for act in acts]


def compile_kernels(out_dir: str | Path, sms: tuple[int, ...] = DEFAULT_SMS,
                    acts: tuple[str, ...] = ("bf16",),
                    kernels: tuple[str, ...] | None = None) -> list[dict]:
    """Compile the kernels (all, or those named in `kernels`) for every SM in `sms` and every
    activation dtype in `acts`; see `compile_jobs`."""
    return compile_jobs(out_dir, kernel_jobs(sms, acts, kernels))


def compile_jobs(out_dir: str | Path, jobs: list[tuple[str, int, str]]) -> list[dict]:
    """Compile each (kernel function name, sm, act); write `<kernel>.sm<NN>.<act>.cubin` and
    `.json` to `out_dir` and return the metadata dicts in job order."""
    specs = {act: {s["name"]: s for s in kernel_specs(act) + step_kernel_specs(act)} for act in ACTS}
    bad = [j for j in jobs if j[2] not in specs or j[0] not in specs[j[2]]]
    if bad:
        raise ValueError(f"unknown kernel jobs {bad}; kernels: {', '.join(specs['bf16'])}; "
                         f"acts: {', '.join(ACTS)}")
    triton = import_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = load_kernels("cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, sm, act in jobs:
        spec = specs[act][name]
        fn = getattr(module, name)
        constexprs = dict(spec["blocks"])
        signature = {**spec["signature"], **{k: "constexpr" for k in constexprs}}
        missing = set(fn.arg_names) ^ set(signature)
        assert not missing, f"{name}: signature and kernel disagree on {sorted(missing)}"
        signature = {a: signature[a] for a in fn.arg_names}  # kernel argument order
        start = time.perf_counter()
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs),
            target=GPUTarget("cuda", sm, 32),
            options={"num_warps": spec["num_warps"], "enable_fp_fusion": False},
        )
        seconds = time.perf_counter() - start
        cubin = compiled.asm["cubin"]
        md = compiled.metadata
        stem = f"{name.removesuffix('_kernel')}.sm{sm}.{act}"
        (out / f"{stem}.cubin").write_bytes(cubin)
        meta = {
            "kernel": name.removesuffix("_kernel"),  # the file key's prefix
            "symbol": md.name,  # the function's name in the cubin
            "sm": sm,
            "act": act,
            "arch": f"sm_{sm}" + ("a" if sm >= 90 else ""),
            "cubin": f"{stem}.cubin",
            "sha256": hashlib.sha256(cubin).hexdigest(),
            "bytes": len(cubin),
            "num_warps": md.num_warps,
            "block": [32 * md.num_warps, 1, 1],
            "shared": md.shared,
            "global_scratch_size": getattr(md, "global_scratch_size", 0),
            "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
            # the trailing scratch pointers this Triton appends (2 since profile scratch came)
            "scratch_args": sum(hasattr(md, a) for a in ("global_scratch_size",
                                                         "profile_scratch_size")),
            "args": [a for a in fn.arg_names if signature[a] != "constexpr"],
            "signature": {a: t for a, t in signature.items() if t != "constexpr"},
            "constexprs": constexprs,
            "grid": spec["grid"],
            "enable_fp_fusion": False,
            "triton_version": triton.__version__,
            "compile_seconds": round(seconds, 3),
        }
        if "note" in spec:
            meta["note"] = spec["note"]
        (out / f"{stem}.json").write_text(json.dumps(meta, indent=2) + "\n")
        log.info("compiled %s for sm%d (%s) in %.2f s (%d bytes)", name, sm, act, seconds,
                 len(cubin))
        results.append(meta)
    return results


def compile_jobs_in_subprocess(out_dir: str | Path, jobs: list[tuple[str, int, str]],
                               timeout: float = 600.0) -> list[dict]:
    """`compile_jobs` in a fresh Python process without `TRITON_INTERPRET`, for callers whose
    process imported triton in interpreter mode (or must not import it at all)."""
    if not jobs:
        return []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "metrale.plugins.aot", str(out_dir),
           *[a for name, sm, act in jobs for a in ("--job", f"{name}:{sm}:{act}")]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling the Triton kernels failed ({' '.join(cmd)}):\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def compile_kernels_in_subprocess(out_dir: str | Path, sms: tuple[int, ...] = DEFAULT_SMS,
                                  acts: tuple[str, ...] = ("bf16",),
                                  kernels: tuple[str, ...] | None = None,
                                  timeout: float = 600.0) -> list[dict]:
    """`compile_kernels` in a fresh process (see `compile_jobs_in_subprocess`)."""
    return compile_jobs_in_subprocess(out_dir, kernel_jobs(sms, acts, kernels), timeout)


def _job(text: str) -> tuple[str, int, str]:
    try:
        name, sm, act = text.split(":")
        return name, int(sm), act
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--job {text!r}: expected KERNEL:SM:ACT, e.g. nvfp4_w4a16_gemm_kernel:89:bf16") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m metrale.plugins.aot",
        description="Compile metrale's Triton kernels to cubins (no GPU needed).")
    parser.add_argument("out_dir")
    parser.add_argument("--sm", type=int, action="append",
                        help=f"target SM, repeatable (default: {' '.join(map(str, DEFAULT_SMS))})")
    parser.add_argument("--act", action="append", choices=ACTS,
                        help="activation dtype the kernels are compiled for, repeatable "
                             "(default: bf16)")
    parser.add_argument("--kernel", action="append",
                        help="compile only this kernel, repeatable (default: all)")
    parser.add_argument("--job", action="append", type=_job, metavar="KERNEL:SM:ACT",
                        help="compile exactly these combinations, repeatable (instead of "
                             "--sm/--act/--kernel)")
    args = parser.parse_args(argv)
    if args.job:
        results = compile_jobs(args.out_dir, args.job)
    else:
        results = compile_kernels(args.out_dir, tuple(args.sm or DEFAULT_SMS),
                                  tuple(args.act or ("bf16",)),
                                  tuple(args.kernel) if args.kernel else None)
    sys.stdout.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
