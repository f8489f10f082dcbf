"""CPU engines: the target's steps compiled ahead of time into AOTInductor packages.

For every slot bucket S and row count T of `PACKAGE_ROWS`, `cpu_steps.TargetStep` over the
staged target (loaded back exactly as serve loads it, then packed) is exported with
`torch.export` at static shapes and compiled with `torch._inductor.aoti_compile_and_package`:
inductor `freezing` (weights are constants, so its CPU code is specialised to them) and
max-autotune with its C++ micro-GEMM templates for the projections. Packages compile in parallel
worker processes, one thread each. After compiling, the build checks what the runtime relies
on: for random prompts, each row of the widest package is bit-identical to the one-row package
at the same position, and the logits match the eager model within 1e-4. Where the GEMM
templates' rows differ between row counts, the packages are compiled again with every
projection written as a reduction (`linear="rowwise"`, row-invariant by construction); a
failure then refuses the build, naming the package.

Compiled packages are cached by content (the target's weights digest, the package shape, the
fingerprint of torch/ISA/dtype and this module's and `cpu_steps`' source), so rebuilding an
unchanged engine copies them instead of compiling again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PACKAGE_ROWS = (1, 8)  # one-row decode steps; verify steps and prompt chunks (padded)
SLOT_BUCKETS = (256, 1088)  # a request runs in the smallest bucket its length fits (cpu_engine)
THREADS = 1


def cache_dir() -> Path:
    base = os.environ.get("METRALE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "metrale")
    return Path(base) / "aoti"


def _sources_digest() -> str:
    import metrale.runtime.cpu_steps as steps
    import metrale.runtime.layers as layers

    h = hashlib.sha256()
    for mod in (steps, layers):
        h.update(Path(mod.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def _load_target(root: Path, dtype: torch.dtype):
    from metrale.builder.trt_build import load_staged
    from metrale.runtime.layers import pack_for_inference

    target = load_staged(root, {"target": "target"}, dtype=dtype).target
    return pack_for_inference(target).eval()


def _example(target, rows: int, slots: int):
    c = target.config
    ids = torch.zeros(1, rows, dtype=torch.long)
    kv = [torch.zeros(slots, c.num_key_value_heads, c.head_dim, dtype=target.dtype)
          for _ in range(2 * c.num_hidden_layers)]
    return ids, torch.tensor([0]), kv


INDUCTOR = {"gemm": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"},
            "rowwise": {"freezing": True}}


def _compile_one(root: str, rows: int, slots: int, taps: tuple[int, ...], out: str,
                 dtype_name: str, linear: str) -> float:
    """Worker: export and compile one package to `out`; returns the seconds it took."""
    import torch._inductor

    from metrale.runtime.cpu_steps import TargetStep

    torch.set_num_threads(THREADS)
    t0 = time.time()
    target = _load_target(Path(root), getattr(torch, dtype_name))
    step = TargetStep(target, taps, linear).eval()
    ids, pos, kv = _example(target, rows, slots)
    with torch.inference_mode():
        ep = torch.export.export(step, (ids, pos, *kv))
    torch._inductor.aoti_compile_and_package(ep, package_path=out, inductor_configs=INDUCTOR[linear])
    return time.time() - t0


def build_cpu_packages(w, taps: tuple[int, ...], target_digest: str, progress,
                       dtype: torch.dtype = torch.float32, workers: int = 2) -> dict:
    """Compile (or take from the cache) every package into `target/cpu/` of the staging
    directory `w.path`; returns the manifest's `cpu` entry for the target component."""
    from metrale.runtime.cpu_engine import build_fingerprint
    from metrale.runtime.errors import EngineDirError

    fingerprint = build_fingerprint(dtype, THREADS)
    t0 = time.time()
    for linear in ("gemm", "rowwise"):
        entries = _compile_all(w.path, taps, target_digest, fingerprint, dtype, workers, linear, progress)
        progress("checking the CPU packages against one-row steps and the eager model")
        check = check_packages(w.path, entries, taps, dtype)
        if check["rows_bit_identical"]:
            break
        log.info("CPU packages (%s projections): rows differ from one-row steps; compiling "
                 "row-wise projections", linear)
    else:
        raise EngineDirError("CPU packages: the rows of a multi-row step differ from one-row steps "
                             "even with row-wise projections; build with --cpu-engines none")
    if check["max_abs_diff_vs_eager"] > 1e-4:
        raise EngineDirError(f"CPU packages: logits differ from the eager target by "
                             f"{check['max_abs_diff_vs_eager']:.2e} (> 1e-4)")
    return {"packages": entries, "taps": list(taps), **fingerprint, "linear": linear,
            "build_s": round(time.time() - t0, 1), "check": check}


def _compile_all(root: Path, taps, target_digest: str, fingerprint: dict, dtype, workers: int,
                 linear: str, progress) -> list[dict]:
    key_base = hashlib.sha256(repr((target_digest, taps, sorted(fingerprint.items()), linear,
                                    _sources_digest())).encode()).hexdigest()[:24]
    jobs, entries = [], []
    for slots in SLOT_BUCKETS:
        for rows in PACKAGE_ROWS:
            rel = f"target/cpu/t{rows}.s{slots}.pt2"
            cached = cache_dir() / f"{key_base}-t{rows}.s{slots}.pt2"
            entries.append({"file": rel, "rows": rows, "slots": slots})
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if cached.is_file():
                shutil.copyfile(cached, dest)
                entries[-1]["compile_s"] = 0.0
            else:
                jobs.append((len(entries) - 1, rows, slots, dest, cached))
    if not jobs:
        return entries
    progress(f"compiling {len(jobs)} CPU packages (AOTInductor, {min(workers, len(jobs))} at a time)")
    dtype_name = str(dtype).removeprefix("torch.")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
        futures = [(i, dest, cached, pool.submit(_compile_one, str(root), rows, slots, taps,
                                                str(dest), dtype_name, linear))
                   for i, rows, slots, dest, cached in jobs]
        for i, dest, cached, fut in futures:
            entries[i]["compile_s"] = round(fut.result(), 1)
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            shutil.copyfile(dest, tmp)
            os.replace(tmp, cached)  # a concurrent build may cache the same bytes: last wins
    return entries


def check_packages(root: Path, entries: list[dict], taps: tuple[int, ...], dtype) -> dict:
    """Per slot bucket, on a random prompt: are the widest package's rows bit-identical to
    one-row steps at the same positions, and how far are the logits from the eager model."""
    import torch._inductor

    from metrale.runtime.cpu_engine import CompiledTarget, Package

    target = _load_target(root, dtype)
    packages = [Package(e["rows"], e["slots"], torch._inductor.aoti_load_package(str(root / e["file"])))
                for e in entries]
    worst, same = 0.0, True
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for slots in sorted({p.slots for p in packages}):
            mine = [p for p in packages if p.slots == slots]
            wide = CompiledTarget(target, mine, taps)
            narrow = CompiledTarget(target, [p for p in mine if p.rows == 1], taps)
            ids = torch.randint(0, target.config.vocab_size, (1, 19), generator=gen)
            a, b = wide.new_cache(1, 24), narrow.new_cache(1, 24)
            wide(ids[:, :11], a)
            narrow(ids[:, :11], b)
            rows_wide = wide(ids[:, 11:], a, taps=taps)
            rows_one = [narrow(ids[:, i:i + 1], b, taps=taps) for i in range(11, 19)]
            for field in ("logits", "last_hidden", "taps"):
                if getattr(rows_wide, field) is not None:
                    one = torch.cat([getattr(r, field) for r in rows_one], dim=1)
                    same = same and torch.equal(getattr(rows_wide, field), one)
            eager = target(ids, target.new_cache(1, 24)).logits
            worst = max(worst, (wide(ids, wide.new_cache(1, 24)).logits - eager).abs().max().item())
    return {"rows_bit_identical": same, "max_abs_diff_vs_eager": worst}
