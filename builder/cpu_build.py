"""CPU engines: the target's steps compiled ahead of time into AOTInductor packages.

For every slot bucket S and row count T of `PACKAGE_ROWS`, `cpu_steps.TargetStep` over the
staged target (loaded back exactly as serve loads it, then packed) is exported with
`torch.export` at static shapes and compiled with `torch._inductor.aoti_compile_and_package`
(inductor `freezing`: weights are constants, so its CPU GEMM and reduction code is specialised
to them). Packages compile in parallel worker processes, one thread each. After compiling, the
build checks what the runtime relies on: for random prompts, each row of the widest package is
bit-identical to the one-row package at the same position, and the logits match the eager
model within 1e-4; a failure refuses the build, naming the package.

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


def _compile_one(root: str, rows: int, slots: int, taps: tuple[int, ...], out: str,
                 dtype_name: str) -> float:
    """Worker: export and compile one package to `out`; returns the seconds it took."""
    import torch._inductor

    from metrale.runtime.cpu_steps import TargetStep

    torch.set_num_threads(THREADS)
    t0 = time.time()
    target = _load_target(Path(root), getattr(torch, dtype_name))
    step = TargetStep(target, taps).eval()
    ids, pos, kv = _example(target, rows, slots)
    with torch.inference_mode():
        ep = torch.export.export(step, (ids, pos, *kv))
    torch._inductor.aoti_compile_and_package(
        ep, package_path=out, inductor_configs={"freezing": True})
    return time.time() - t0


def build_cpu_packages(w, taps: tuple[int, ...], target_digest: str, progress,
                       dtype: torch.dtype = torch.float32, workers: int = 2) -> dict:
    """Compile (or take from the cache) every package into `target/cpu/` of the staging
    directory `w.path`; returns the manifest's `cpu` entry for the target component."""
    from metrale.runtime.cpu_engine import build_fingerprint

    fingerprint = build_fingerprint(dtype, THREADS)
    key_base = hashlib.sha256(repr((target_digest, taps, sorted(fingerprint.items()),
                                    _sources_digest())).encode()).hexdigest()[:24]
    jobs, entries = [], []
    for slots in SLOT_BUCKETS:
        for rows in PACKAGE_ROWS:
            rel = f"target/cpu/t{rows}.s{slots}.pt2"
            cached = cache_dir() / f"{key_base}-t{rows}.s{slots}.pt2"
            entries.append({"file": rel, "rows": rows, "slots": slots})
            dest = w.path / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if cached.is_file():
                shutil.copyfile(cached, dest)
                entries[-1]["compile_s"] = 0.0
            else:
                jobs.append((len(entries) - 1, rows, slots, dest, cached))
    t0 = time.time()
    if jobs:
        progress(f"compiling {len(jobs)} CPU packages (AOTInductor, {min(workers, len(jobs))} at a time)")
        dtype_name = str(dtype).removeprefix("torch.")
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
            futures = [(i, dest, cached, pool.submit(_compile_one, str(w.path), rows, slots, taps,
                                                    str(dest), dtype_name))
                       for i, rows, slots, dest, cached in jobs]
            for i, dest, cached, fut in futures:
                entries[i]["compile_s"] = round(fut.result(), 1)
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_suffix(f".tmp{os.getpid()}")
                shutil.copyfile(dest, tmp)
                os.replace(tmp, cached)
    progress("checking the CPU packages against the eager model")
    check = check_packages(w.path, entries, taps, dtype)
    return {"packages": entries, "taps": list(taps), **fingerprint, "build_s": round(time.time() - t0, 1),
            "check": check}


def check_packages(root: Path, entries: list[dict], taps: tuple[int, ...], dtype) -> dict:
    """Every row of the widest package bit-identical to the one-row package at its position,
    and logits within 1e-4 of the eager model, for each slot bucket; refuses otherwise."""
    import torch._inductor

    from metrale.runtime.cpu_engine import CompiledTarget, Package
    from metrale.runtime.errors import EngineDirError

    target = _load_target(root, dtype)
    packages = [Package(e["rows"], e["slots"], torch._inductor.aoti_load_package(str(root / e["file"])))
                for e in entries]
    worst = 0.0
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
            rows_wide = wide(ids[:, 11:], a).logits
            rows_one = torch.cat([narrow(ids[:, i:i + 1], b).logits for i in range(11, 19)], dim=1)
            if not torch.equal(rows_wide, rows_one):
                raise EngineDirError(f"CPU package target/cpu/t{wide.max_rows}.s{slots}.pt2: its rows "
                                     "differ from one-row steps; chunkwise verify would move greedy text")
            eager = target(ids, target.new_cache(1, 24)).logits
            seq = torch.cat([b_ for b_ in (wide(ids, wide.new_cache(1, 24)).logits,)], dim=1)
            worst = max(worst, (seq - eager).abs().max().item())
    if worst > 1e-4:
        raise EngineDirError(f"CPU packages: logits differ from the eager target by {worst:.2e} (> 1e-4)")
    return {"rows_bit_identical": True, "max_abs_diff_vs_eager": worst}
