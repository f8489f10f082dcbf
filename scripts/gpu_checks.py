"""Every check that needs an NVIDIA GPU, in one run (scripts/gpu_checks.sh OUT_DIR wraps it):

    python scripts/gpu_checks.py run OUT_DIR           the whole run (below)
    python scripts/gpu_checks.py env OUT.json          the GPU, its SM, package versions, the
                                                       TensorRT flavour that builds for the SM
    python scripts/gpu_checks.py spec ENGINE_DIR OUT.json [BACKEND]
                                                       `metrale generate --device cuda` (--backend
                                                       auto: the target's steps as CUDA graphs) in
                                                       every speculative mode with --exact-verify:
                                                       token ids equal plain's, every run on
                                                       BACKEND (default cuda-graphs); plain eager
                                                       (--backend torch) recorded beside them

The run, in order (the issue's figures first, so a run cut short keeps them), each step a
subprocess under its own time cap and the whole under $METRALE_GPU_BUDGET_S (default 540 s; a
step that would start with under 20 s left is "not run", which fails the run):
  wheels        $METRALE_WHEELS=DIR: its wheels installed offline into a scratch folder (what
                this Python lacks, as scripts/offline_wheels.py downloads them elsewhere)
  env           env.json (whatever happens: torch missing, no CUDA, metrale not importing)
  install       only when metrale does not import: `pip install --no-deps -e .`, else (no pip,
                no setuptools) the package assembled from symlinks on PYTHONPATH
  build         the tiny engine directory (torch weights; no TensorRT), or the one built
                elsewhere that $METRALE_GPU_ENGINES names (this machine may lack ModelOpt)
  bench-torch-cuda  bench-torch-cuda.json: `metrale bench --device cuda` (CUDA graphs)
  targets       DFlash2 >= 2.0x, DFlash >= 1.5x, best MTP >= 1.6x plain, plain >= 1.3 x 1,690 tok/s,
                adaptive k >= its best fixed mode - 2%, exact modes == plain, and no graph that
                fell back to the decode loop (the engine's note says where one did)
  serve-cuda    serve-cuda.json: scripts/load.py, `metrale serve --device cuda` for plain, MTP and
                DFlash at 32 concurrent requests over HTTP (the requests in an iteration's lanes)
  serve-targets every speculative mode >= 1.0x plain's tokens/s at C = 32, no request lost
  torch-cuda    torch-cuda.json: every speculative mode on CUDA graphs, exact verify == plain,
                and the backend that ran (a fall-back to eager torch fails the step, with why)
  kernels       kernels.json: the Triton kernels JIT-compiled for this GPU vs their references
  lane-costs    lane-costs.json: scripts/lane_costs.py, ms per replayed iteration of serving's
                lanes per mode at 1 and 32 lanes, in slot buckets 256 and the context's
  bench-unfused bench-torch-cuda-unfused.json: its chain modes with METRALE_STEP_KERNELS=0 (the
                decode step's fused kernels off): their before/after on this GPU
  cubins        cubins.json: the AOT cubins for this SM launched through the driver API
  trt-build, pytest-trt, bench-tensorrt   only where a TensorRT flavour builds this SM
Each step's outcome (ok, failed, skipped, not run) goes to summary.json the moment it ends, with why a
step was skipped; result files are written as their cases finish. Without a GPU every GPU step
is recorded as skipped (naming why) within seconds and the run exits 0; otherwise the exit
status is 1 when any step failed. Scratch (engines, wheels) goes to $METRALE_GPU_WORK (default: a
fresh folder under the system temp dir).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its step bookkeeping, beside it
from gpu_steps import Recorder, gpu_skip_reason  # noqa: E402
HERE = Path(__file__).resolve()
KERNELS = HERE.parent / "gpu_kernels.py"
TARGETS = (("dflash2", 2.0), ("dflash", 1.5), ("mtp", 1.6))  # mode family -> least speedup
PLAIN_TOK_S = 1.3 * 1690  # plain decoding on the tiny default: 1.3x the decode loop's 1,690 tok/s
# (each step its own CUDA graph), the gain whole-iteration graphs are there for
ADAPTIVE_SLACK = 0.02  # adaptive k within 2% of its drafter's best fixed mode
CAPTURE_FAILED = "the decode loop runs"  # what an engine's note says where a capture failed


def _version(module: str) -> str | None:
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ModuleNotFoundError, ValueError):  # a dotted name whose parent is missing
        return None
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except Exception as exc:  # noqa: BLE001 - a report of what is there, whatever breaks
        return f"does not import: {type(exc).__name__}: {exc}"


def _imports(module: str) -> tuple[bool, str]:
    try:
        importlib.import_module(module)
        return True, ""
    except Exception as exc:  # noqa: BLE001 - the reason is the report
        return False, f"{type(exc).__name__}: {exc}"


def cmd_env(out: Path) -> int:
    """Write env.json; exit 0 whenever it is written (what is missing is data, not a failure)."""
    info: dict = {"python": sys.version.split()[0], "cuda": False, "sm": None}
    ok, err = _imports("torch")
    if not ok:
        info["cuda_reason"] = f"torch does not import ({err})"
    else:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            info.update(cuda=True, gpu=torch.cuda.get_device_name(0), sm=major * 10 + minor,
                        cuda_reason=f"{torch.cuda.get_device_name(0)}")
        elif torch.version.cuda is None:
            info["cuda_reason"] = f"no CUDA device: torch {torch.__version__} is a CPU-only build"
        else:
            info["cuda_reason"] = (f"no CUDA device: torch {torch.__version__} (CUDA "
                                   f"{torch.version.cuda}) sees no GPU")
    for m in ("triton", "cuda.bindings", "tensorrt", "tensorrt_rtx", "modelopt", "onnx",
              "safetensors", "tokenizers", "typer"):
        info[m] = _version(m)
    # the runtime, the CLI (typer, rich) and the builder (ModelOpt, onnx) may fail apart
    for key, module in (("metrale", "metrale.runtime.artifact.engine"), ("cli", "metrale.cli"),
                        ("builder", "metrale.builder.build")):
        info[f"{key}_ok"], info[f"{key}_error"] = _imports(module)
    info["build_flavor"], info["build_flavor_reason"] = None, "no CUDA device"
    if info["cuda"] and info["metrale_ok"]:
        info["build_flavor"], info["build_flavor_reason"] = _flavor(info["sm"])
    out.write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2), flush=True)
    return 0


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
        except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
            reasons.append(f"{flavor}: {type(exc).__name__}: {exc}")
            continue
        if sm in tm.supported_sms():
            return flavor, f"{flavor} {tm.version} builds SM{sm}"
        reasons.append(f"{flavor} {tm.version} builds SM {tm.supported_sms()}, not SM{sm}")
    return None, "no TensorRT flavour builds SM%d: %s" % (sm, "; ".join(reasons))


# -- the speculative modes on CUDA through the CLI ------------------------------------------


def spec_modes(engine_dir: Path) -> list[tuple[str, list[str]]]:
    """(name, generate flags) for every speculative mode the directory can run."""
    from metrale.runtime.artifact.engine_dir import load_manifest
    from metrale.runtime.components import Role, names_with_role

    comps = load_manifest(engine_dir, verify=False).components
    modes = []
    if "mtp" in comps:
        for k in (1, 2, 3):
            modes.append((f"mtp k={k}", ["--speculative", "--num-drafts", str(k)]))
        modes.append(("mtp k=3 stop=cum:0.5", ["--speculative", "--num-drafts", "3",
                                               "--draft-confidence-stop", "cum:0.5"]))
    for name in sorted(names_with_role(comps, Role.DRAFTER)):
        base = ["--dflash", "--dflash-drafter", name]
        modes += [(f"{name}", base), (f"{name} gamma=4", [*base, "--dflash-gamma", "4"]),
                  (f"{name} ladder 1,3,7", [*base, "--dflash-draft-ladder", "1,3,7"])]
    return modes


def cmd_spec(engine_dir: Path, out: Path, max_tokens: int = 32, prompts: int = 2,
             expect_backend: str = "cuda-graphs") -> int:
    from typer.testing import CliRunner

    from metrale.cli import app

    texts = json.loads((ROOT / "recipes" / "tiny" / "prompts.json").read_text())[:prompts]
    runner = CliRunner()

    def generate(prompt: str, flags: list[str]) -> dict:
        r = runner.invoke(app, ["generate", "--engine-dir", str(engine_dir), "--device", "cuda",
                                "--prompt", prompt, "--max-tokens", str(max_tokens), "--json",
                                *flags])
        if r.exit_code != 0:
            raise RuntimeError(f"metrale generate {' '.join(flags)} exited {r.exit_code}: "
                               f"{r.output[-2000:]}")
        return json.loads(r.output.strip().splitlines()[-1])

    def on_backend(rows: list[dict]) -> tuple[bool, str]:
        """Did every run go through `expect_backend`? If not, which ran and why."""
        ran = sorted({r.get("backend", "?") for r in rows})
        if ran == [expect_backend]:
            return True, ""
        notes = sorted({r.get("backend_note") for r in rows if r.get("backend_note")})
        return False, f"ran on {', '.join(ran)}, not {expect_backend}" + (
            f": {'; '.join(notes)}" if notes else "")

    report = {"engine_dir": str(engine_dir), "max_tokens": max_tokens,
              "expect_backend": expect_backend, "modes": []}

    def save():
        report["failed"] = sum(not m["ok"] for m in report["modes"])
        out.write_text(json.dumps(report, indent=2) + "\n")

    t0 = time.perf_counter()
    plain = [generate(t, []) for t in texts]
    ok, why = on_backend(plain)
    report["backend"] = plain[0].get("backend")
    report["modes"].append({"mode": "plain", "ok": ok, "backend": report["backend"],
                            **({"error": why} if why else {}),
                            "tokens_per_s": [p["tokens_per_s"] for p in plain],
                            "seconds": round(time.perf_counter() - t0, 2)})
    save()
    t0 = time.perf_counter()
    try:  # the eager backend beside the graphs: other arithmetic, so the texts may part after a
        # while, but each prompt's first token must agree: the graphs' own modes all agreeing
        # with plain proves nothing when plain itself decodes garbage
        eager = [generate(t, ["--backend", "torch"]) for t in texts]
        same = [e["token_ids"] == p["token_ids"] for e, p in zip(eager, plain)]
        prefix = [_common_prefix(e["token_ids"], p["token_ids"]) for e, p in zip(eager, plain)]
        entry = {"mode": "plain --backend torch", "ok": min(prefix) >= 1, "backend": eager[0].get("backend"),
                 "identical_to_plain_info": sum(same), "common_prefix": prefix, "prompts": len(texts),
                 "tokens": [len(p["token_ids"]) for p in plain],
                 "tokens_per_s": [e["tokens_per_s"] for e in eager]}
        if min(prefix) < 1:
            entry["error"] = "a prompt's first token under CUDA graphs differs from eager torch's"
    except Exception as exc:  # noqa: BLE001 - every run is reported
        entry = {"mode": "plain --backend torch", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    report["modes"].append(entry)
    save()
    for name, flags in spec_modes(engine_dir):
        t0 = time.perf_counter()
        try:
            rows = [generate(t, [*flags, "--exact-verify"]) for t in texts]
            same = [r["token_ids"] == p["token_ids"] for r, p in zip(rows, plain)]
            ok, why = on_backend(rows)
            entry = {"mode": name + " exact", "ok": all(same) and ok, "identical_to_plain": sum(same),
                     "prompts": len(texts), "backend": rows[0].get("backend"),
                     **({"error": why} if why else {}), "tau": [r["tau"] for r in rows],
                     "tokens_per_s": [r["tokens_per_s"] for r in rows]}
        except Exception as exc:  # noqa: BLE001 - every mode is reported
            entry = {"mode": name + " exact", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        report["modes"].append(entry)
        save()
        print(("ok  " if entry["ok"] else "FAIL") + f"  {entry['mode']}" +
              (f" ({entry['error']})" if "error" in entry else ""), flush=True)
    return 1 if report["failed"] else 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def speedup_targets(bench: dict, prompts: int) -> tuple[bool, str]:
    """The GPU's speculation targets over one bench run: the best speedup of each mode family
    against its least, plain decoding's speed, each adaptive mode within 2% of the better of
    plain and its drafter's best fixed mode, and every exact mode identical to plain on every
    prompt."""
    rows = bench.get("modes") or []
    if not rows or any("speedup" not in r for r in rows):
        return False, "the bench JSON has no per-mode speedup"
    note = bench.get("backend_note") or ""
    if CAPTURE_FAILED in note:  # modes that ran the decode loop instead of their graphs
        return False, f"some graphs were not captured: {note}"
    parts, ok = [f"backend {bench.get('backend', '?')}"], True
    for family, least in TARGETS:
        best = max((r["speedup"] for r in rows if r["mode"].split()[0] == family), default=None)
        if best is None:
            parts.append(f"{family}: no mode")
            ok = False
            continue
        ok &= best >= least
        parts.append(f"{family} {best:.2f}x (>= {least}x: {'yes' if best >= least else 'NO'})")
    plain = next((r for r in rows if r["mode"] == "plain"), {})
    if "tokens_per_s" in plain:
        fast = plain["tokens_per_s"] >= PLAIN_TOK_S
        ok &= fast
        parts.append(f"plain {plain['tokens_per_s']:.0f} tok/s (>= {PLAIN_TOK_S:.0f}: {'yes' if fast else 'NO'})")
    for row in rows:
        if "adaptive" not in row["mode"]:
            continue
        family = row["mode"].split()[0]
        fixed = max((r["speedup"] for r in rows if r["mode"].split()[0] == family
                     and "adaptive" not in r["mode"] and "exact" not in r["mode"]), default=1.0)
        near = row["speedup"] >= (1 - ADAPTIVE_SLACK) * max(1.0, fixed)
        ok &= near
        parts.append(f"{row['mode']} {row['speedup']:.2f}x (best fixed {fixed:.2f}x: {'yes' if near else 'NO'})")
    exact = [r for r in rows if "exact" in r["mode"]]
    unequal = [r["mode"] for r in exact if r.get("identical_to_plain") != prompts]
    ok &= not unequal and bool(exact)
    parts.append(f"exact modes == plain: {'yes' if exact and not unequal else 'NO ' + str(unequal)}")
    return ok, "; ".join(parts)


def serve_targets(load: dict, concurrency: int = 32) -> tuple[bool, str]:
    """The serving target over one load run (scripts/load.py's JSON): at `concurrency`, every
    mode but plain at least plain's tokens/s (the paired rounds' median) with no request
    lost."""
    modes = load.get("modes") or {}
    if "plain" not in modes or len(modes) < 2:
        return False, "the load JSON has no plain mode and no speculative one"
    parts, ok = [], True
    for mode, data in modes.items():
        level = next((r for r in data.get("levels", []) if r.get("concurrency") == concurrency), None)
        if level is None:
            parts.append(f"{mode}: no level C = {concurrency}")
            ok = False
            continue
        lost = level.get("lost", 0)
        ok &= lost == 0
        if mode == "plain":
            parts.append(f"plain {level['tokens_per_s']:.0f} tok/s, lost {lost}")
            continue
        ratio = level.get("vs_plain", 0.0)
        ok &= ratio >= 1.0
        parts.append(f"{mode} {ratio:.2f}x plain (>= 1.0: {'yes' if ratio >= 1.0 else 'NO'}), lost {lost}")
    return ok, f"C = {concurrency}: " + "; ".join(parts)


# -- the run ---------------------------------------------------------------------------------


def link_package(root: Path, dest: Path) -> Path:
    """The `metrale` package assembled from symlinks under `dest` as pyproject.toml maps the
    source folders (`metrale.builder` = builder/, ...), for a Python where pip cannot install
    it; put `dest` on PYTHONPATH."""
    try:
        import tomllib

        dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    except (ImportError, KeyError, OSError):
        dirs = {"metrale": "metrale", "metrale.builder": "builder", "metrale.runtime": "runtime",
                "metrale.plugins": "plugins"}
    pkg = dest / "metrale"
    pkg.mkdir(parents=True, exist_ok=True)
    for src in (root / dirs["metrale"]).iterdir():
        if src.suffix == ".py" and not (pkg / src.name).exists():
            (pkg / src.name).symlink_to(src)
    for name, folder in dirs.items():
        link = dest / name.replace(".", "/")
        if name != "metrale" and not link.exists():
            link.symlink_to(root / folder, target_is_directory=True)
    return dest


def cmd_run(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    given = os.environ.get("METRALE_GPU_WORK")
    work = Path(given) if given else Path(tempfile.gettempdir()) / f"metrale-gpu.{os.getpid()}"
    rec = Recorder(out, float(os.environ.get("METRALE_GPU_BUDGET_S", "540")))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="0", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "4"))
    py = sys.executable
    print(f"python: {py}; out: {out}; scratch: {work} (made when a step needs it)", flush=True)

    wheels = os.environ.get("METRALE_WHEELS")
    if wheels:
        found = sorted(Path(wheels).glob("*.whl"))
        work.mkdir(parents=True, exist_ok=True)
        if not found:
            rec.record("wheels", "failed", note=f"no *.whl in {wheels}")
        elif rec.run("wheels", 180, [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                     "--target", work / "site", *found], env):
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(work / "site"),
                                                            env.get("PYTHONPATH")) if p)

    def read_env() -> dict | None:
        try:
            return json.loads((out / "env.json").read_text())
        except (OSError, ValueError):
            return None

    rec.run("env", 120, [py, HERE, "env", out / "env.json"], env)
    info = read_env()
    if info is None:
        rec.record("all", "failed", note="the env step wrote no env.json (see the log)")
        return 1
    if not info["metrale_ok"]:
        if not rec.run("install", 240, [py, "-m", "pip", "install", "-q", "--no-deps",
                                        "--no-build-isolation", "-e", ROOT], env):
            work.mkdir(parents=True, exist_ok=True)
            linked = link_package(ROOT, work / "pkg")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(linked), env.get("PYTHONPATH")) if p)
            rec.record("install (symlinks)", "ok", note=f"{linked} on PYTHONPATH")
        rec.run("env (after install)", 120, [py, HERE, "env", out / "env.json"], env)
        info = read_env() or info
    else:
        rec.record("install", "skipped", note="metrale imports already")

    prebuilt = os.environ.get("METRALE_GPU_ENGINES")
    tiny = Path(prebuilt).resolve() if prebuilt else work / "tiny"
    bench_json, load_json = out / "bench-torch-cuda.json", out / "serve-cuda.json"
    bench = ["--num-prompts", "4", "--max-tokens", "48", "--repeats", "2"]
    trt_dir = work / f"tiny-trt-{info.get('sm')}"
    # most telling first (the figures: bench, then serving at 32 clients, then exactness),
    # so a run cut short by its budget still answers the questions that matter most
    steps = [
        ("build", 120, ("cuda", "builder"), (),
         [py, "-m", "metrale", "build", "--engine-dir", tiny, "--trt-flavor", "none"]),
        ("bench-torch-cuda", 150, ("cuda", "cli"), ("build",),
         [py, "-m", "metrale", "bench", "--engine-dir", tiny, "--device", "cuda", "--no-transformers",
          "--json", bench_json, *bench]),
        ("targets", 0, ("cuda", "cli"), ("bench-torch-cuda",), None),
        ("serve-cuda", 120, ("cuda", "cli"), ("build",),
         [py, ROOT / "scripts" / "load.py", "--engine-dir", tiny, "--serve-flags=--device cuda",
          "--concurrency", "32", "--requests", "2", "--rounds", "2", "--max-tokens", "32", "--no-tail",
          "--json", load_json]),
        ("serve-targets", 0, ("cuda", "cli"), ("serve-cuda",), None),
        ("torch-cuda", 150, ("cuda", "cli"), ("build",),
         [py, HERE, "spec", tiny, out / "torch-cuda.json"]),
        ("kernels", 120, ("cuda", "metrale", "triton"), (),
         [py, KERNELS, "kernels", out / "kernels.json"]),
        # one iteration of the lanes, per mode, 1 and 32 lanes, slot buckets 256 and the context's
        ("lane-costs", 90, ("cuda", "metrale"), ("build",),
         [py, ROOT / "scripts" / "lane_costs.py", tiny, out / "lane-costs.json", "--device", "cuda",
          "--replays", "20"]),
        # the same bench with the decode step's fused kernels off (`plugins.step_kernels`): their
        # before/after on this GPU, kernels per step and tok/s, in the chain modes
        ("bench-unfused", 120, ("cuda", "cli"), ("build",),
         ["env", "METRALE_STEP_KERNELS=0", py, "-m", "metrale", "bench", "--engine-dir", tiny,
          "--device", "cuda", "--modes", "γ=8,k=3", "--no-transformers", "--json",
          out / "bench-torch-cuda-unfused.json",
          *bench]),
        ("cubins", 120, ("cuda", "metrale", "triton", "cuda.bindings"), (),
         [py, KERNELS, "cubins", out / "cubins.json"]),
        ("trt-build", 150, ("cuda", "builder", "flavor"), (),
         [py, "-m", "metrale", "build", "--engine-dir", trt_dir, "--draft-weight-quantization",
          "nvfp4", "--mtp-experts-nvfp4", "--trt-flavor", info.get("build_flavor") or "-",
          "--target-sm", str(info.get("sm"))]),  # every plugin: GEMMs, grouped MoE, dynamic conv
        ("pytest-trt", 200, ("cuda", "builder", "flavor"), ("trt-build",),
         [py, "-m", "pytest", "tests/test_trt_backend.py", "-m", "gpu", "-q", "-rs"]),
        ("bench-tensorrt", 120, ("cuda", "cli", "flavor"), ("trt-build",),
         [py, "-m", "metrale", "bench", "--engine-dir", trt_dir, "--backend", "tensorrt",
          "--json", out / "bench-tensorrt.json", *bench]),
    ]
    for name, cap, needs, after, cmd in steps:
        reason = gpu_skip_reason(info, needs)
        if name == "build" and prebuilt and reason in (None, gpu_skip_reason(info, ("builder",))):
            ok = (tiny / "config.json").is_file()
            rec.record(name, "ok" if ok else "failed",
                       note=f"{'using' if ok else 'no config.json in'} $METRALE_GPU_ENGINES {tiny}")
            continue
        if reason is None:
            failed = [a for a in after if rec.status(a) != "ok"]
            if failed:
                said = {"failed": "failed", "skipped": "was skipped",
                        "not run": "ran out of time"}.get(rec.status(failed[0]), "did not run")
                reason = f"needs step {failed[0]}, which {said}"
        if reason is not None:
            rec.record(name, "skipped", note=reason)
        elif name in ("targets", "serve-targets"):
            source, check = ((bench_json, lambda d: speedup_targets(d, 4)) if name == "targets"
                             else (load_json, serve_targets))
            try:
                ok, note = check(json.loads(source.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                ok, note = False, f"cannot read {source.name}: {type(exc).__name__}: {exc}"
            rec.record(name, "ok" if ok else "failed", note=note)
        else:
            work.mkdir(parents=True, exist_ok=True)
            step_env = dict(env, METRALE_TRT_ENGINES=f"nvfp4={trt_dir}")
            rec.run(name, cap, cmd, step_env)
    rec.write()
    failed = [r["step"] for r in rec.steps if r["status"] in ("failed", "not run")]
    print(f"=== gpu checks done in {time.monotonic() - rec.t0:.0f}s: "
          f"{'all ok' if not failed else 'failed: ' + ', '.join(failed)}; "
          f"{len(rec.steps) - len(failed)} ok or skipped; summary: {out / 'summary.json'}",
          flush=True)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "run":
        return cmd_run(Path(argv[1]).resolve())
    if len(argv) == 2 and argv[0] == "env":
        return cmd_env(Path(argv[1]))
    if len(argv) in (3, 4) and argv[0] == "spec":
        return cmd_spec(Path(argv[1]), Path(argv[2]), expect_backend=(argv[3:] or ["cuda-graphs"])[0])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
