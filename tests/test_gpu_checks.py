"""scripts/gpu_checks.sh and its helper: on this machine (no GPU) the whole run takes seconds,
records every GPU step as skipped with the reason, keeps its log's tail and exits 0; the step
logic (why a step is skipped, time caps, results written as each step ends, the speedup
targets) is checked directly."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GPU_STEPS = ("kernels", "cubins", "build", "torch-cuda", "bench-torch-cuda", "bench-unfused", "targets",
             "lane-costs", "trt-build", "pytest-trt", "bench-tensorrt")


def _script():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "scripts" / "gpu_checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


gc = _script()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the run does the real checks")
def test_without_a_gpu_the_run_skips_every_gpu_step_in_seconds_and_exits_0(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("METRALE_WHEELS", "PYTHON")}
    env.update(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", METRALE_GPU_WORK=str(tmp_path / "work"))
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert seconds < 60 and "Traceback" not in proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    status = {r["step"]: r["status"] for r in summary["steps"]}
    assert summary["all_ok"] and status["env"] == "ok" and status["install"] == "skipped"
    for step in GPU_STEPS:  # every one recorded, the benches included, each with its reason
        assert status[step] == "skipped", summary
        assert summary["skipped"][step].startswith("no CUDA device: torch"), summary["skipped"]
    env_json = json.loads((out / "env.json").read_text())
    assert env_json["cuda"] is False and env_json["metrale_ok"] is True
    log = (out / "gpu_checks.log").read_text()
    assert log.rstrip().splitlines()[-1].startswith("=== gpu checks done")  # the tail is kept
    assert not (tmp_path / "work").exists()  # nothing ran that needed scratch


ENV = {"cuda": True, "sm": 90, "cuda_reason": "NVIDIA H200", "metrale_ok": True, "cli_ok": True,
       "builder_ok": True,
       "triton": "3.6.0", "cuda.bindings": "13.0.0", "build_flavor": None,
       "build_flavor_reason": "no TensorRT flavour builds SM90: tensorrt is not installed"}


def test_skip_reasons_name_what_is_missing():
    reason = gc.gpu_skip_reason
    assert reason(ENV, ("cuda", "metrale", "triton", "cuda.bindings")) is None
    # an import failure is named as such, never reported as "no CUDA device"
    broken = {**ENV, "metrale_ok": False, "metrale_error": "ImportError: libfoo.so: cannot open"}
    assert reason(broken, ("cuda", "metrale")) == "metrale does not import: ImportError: libfoo.so: cannot open"
    no_typer = {**ENV, "cli_ok": False, "cli_error": "ModuleNotFoundError: No module named 'typer'"}
    assert reason(no_typer, ("cuda", "cli")).startswith("metrale's CLI does not import: ModuleNotFound")
    assert reason(no_typer, ("cuda", "builder")) is None  # the builder imports: the build runs
    # a missing cuda-python skips the driver-API step, it does not fail it
    assert reason({**ENV, "cuda.bindings": None}, ("cuda", "cuda.bindings")) == \
        "cuda-python (cuda.bindings) is not installed"
    assert reason({**ENV, "triton": "does not import: ImportError: x"}, ("triton",)) == \
        "triton does not import: ImportError: x"
    assert reason(ENV, ("cuda", "flavor")).startswith("no TensorRT flavour builds SM90")
    assert reason({"cuda": False, "cuda_reason": "no CUDA device: torch 2.13.0+cpu is a CPU-only build"},
                  ("cuda",)).endswith("CPU-only build")


def test_each_step_is_in_the_summary_as_soon_as_it_ends(tmp_path):
    rec = gc.Recorder(tmp_path, budget_s=60, min_step_s=0)
    assert rec.run("first", 30, [sys.executable, "-c", "pass"], dict(os.environ))
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["step"], r["status"]) for r in on_disk["steps"]] == [("first", "ok")]
    assert not rec.run("second", 30, [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    t0 = time.monotonic()
    assert not rec.run("third", 1, [sys.executable, "-c", "import time; time.sleep(30)"],
                       dict(os.environ))
    assert time.monotonic() - t0 < 15  # killed at its cap
    rows = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert [(r["step"], r["status"], r["note"]) for r in rows[1:]] == [
        ("second", "failed", "exit status 3"), ("third", "failed", "timed out after 1 s")]
    late = gc.Recorder(tmp_path, budget_s=10)  # less time left than a step needs: not run,
    assert not late.run("fourth", 100, [sys.executable, "-c", "pass"], dict(os.environ))
    assert late.steps[-1]["status"] == "not run" and late.steps[-1]["note"].startswith("out of time")
    assert not json.loads((tmp_path / "summary.json").read_text())["all_ok"]  # which is no pass


def test_the_package_can_be_assembled_from_symlinks(tmp_path):
    # where pip cannot install it: the source folders linked as pyproject.toml maps them
    dest = gc.link_package(ROOT, tmp_path / "pkg")
    env = dict(os.environ, PYTHONPATH=str(dest))
    code = ("import metrale, metrale.runtime.backends.graph_cache, metrale.plugins.aot, metrale.builder.recipe; "
            "print(metrale.__file__, metrale.runtime.backends.graph_cache.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    pkg_file, cache_file = out.stdout.split()
    assert pkg_file.startswith(str(dest))  # this package, not the installed one
    assert Path(cache_file).resolve() == ROOT / "runtime" / "backends" / "graph_cache.py"


def _bench(speedups: dict, identical: int = 4) -> dict:
    rows = [{"mode": "plain", "speedup": 1.0}]
    for mode, s in speedups.items():
        row = {"mode": mode, "speedup": s}
        if "exact" in mode:
            row["identical_to_plain"] = identical
        rows.append(row)
    return {"modes": rows}


def test_speedup_targets():
    good = _bench({"mtp k=1": 1.3, "mtp k=3": 1.7, "mtp k=3 exact": 1.2, "dflash γ=8": 1.55,
                   "dflash γ=8 exact": 1.1, "dflash adaptive-k": 1.53, "dflash2 γ=8": 2.1})
    good["modes"][0]["tokens_per_s"] = 2300.0
    ok, note = gc.speedup_targets({**good, "backend": "cuda-graphs"}, 4)
    assert ok, note
    assert note.startswith("backend cuda-graphs; ")
    assert "dflash2 2.10x (>= 2.0x: yes)" in note and "mtp 1.70x" in note and "dflash 1.55x" in note
    assert "plain 2300 tok/s (>= 2197: yes)" in note and "dflash adaptive-k 1.53x (best fixed 1.55x: yes)" in note
    ok, note = gc.speedup_targets(_bench({"mtp k=3": 1.7, "mtp k=3 exact": 1.2, "dflash γ=8": 1.4,
                                          "dflash2 γ=8": 2.1}), 4)
    assert not ok and "dflash 1.40x (>= 1.5x: NO)" in note
    ok, note = gc.speedup_targets(_bench({"mtp k=3": 1.7, "mtp k=3 exact": 1.7, "dflash γ=8": 1.6,
                                          "dflash adaptive-k": 1.5, "dflash2 γ=8": 2.1}), 4)
    assert not ok and "dflash adaptive-k 1.50x (best fixed 1.60x: NO)" in note
    slow = _bench({"mtp k=3": 1.7, "mtp k=3 exact": 1.7, "dflash γ=8": 1.6, "dflash2 γ=8": 2.1})
    slow["modes"][0]["tokens_per_s"] = 1690.0
    ok, note = gc.speedup_targets(slow, 4)
    assert not ok and "plain 1690 tok/s (>= 2197: NO)" in note
    ok, note = gc.speedup_targets(_bench({"mtp k=3": 1.7, "mtp k=3 exact": 1.7, "dflash γ=8": 1.6,
                                          "dflash2 γ=8": 2.1}, identical=3), 4)
    assert not ok and "exact modes == plain: NO ['mtp k=3 exact']" in note
    assert gc.speedup_targets({"modes": [{"mode": "plain"}]}, 4) == (
        False, "the bench JSON has no per-mode speedup")
    # a mode whose graphs could not be captured ran the decode loop: its figures are not the graphs'
    note = "whole-iteration graphs failed, the decode loop runs: RuntimeError: capture"
    ok, why = gc.speedup_targets({**good, "backend_note": note}, 4)
    assert not ok and why == f"some graphs were not captured: {note}"


def test_serve_targets():
    def load(ratios: dict, lost: int = 0) -> dict:
        modes = {"plain": {"levels": [{"concurrency": 32, "tokens_per_s": 900.0, "lost": 0}]}}
        for mode, r in ratios.items():
            modes[mode] = {"levels": [{"concurrency": 32, "tokens_per_s": 900.0 * r, "lost": lost, "vs_plain": r}]}
        return {"modes": modes}

    ok, note = gc.serve_targets(load({"mtp": 1.2, "dflash": 1.05}))
    assert ok, note
    assert note == "C = 32: plain 900 tok/s, lost 0; mtp 1.20x plain (>= 1.0: yes), lost 0; dflash 1.05x plain (>= 1.0: yes), lost 0"
    ok, note = gc.serve_targets(load({"mtp": 1.2, "dflash": 0.9}))
    assert not ok and "dflash 0.90x plain (>= 1.0: NO)" in note
    assert not gc.serve_targets(load({"mtp": 1.2}, lost=1))[0]
    assert gc.serve_targets({"modes": {"plain": {}}}) == (False, "the load JSON has no plain mode and no speculative one")
    assert not gc.serve_targets({"modes": {"plain": {"levels": []}, "mtp": {"levels": []}}})[0]


def test_spec_modes_cover_every_mode_the_directory_runs(tiny_engine_dir):
    modes = dict(gc.spec_modes(tiny_engine_dir))
    assert list(modes) == ["mtp k=1", "mtp k=2", "mtp k=3", "mtp k=3 stop=cum:0.5",
                           "dflash", "dflash gamma=4", "dflash ladder 1,3,7",
                           "dflash2", "dflash2 gamma=4", "dflash2 ladder 1,3,7"]
    assert modes["dflash2 gamma=4"] == ["--dflash", "--dflash-drafter", "dflash2",
                                        "--dflash-gamma", "4"]


def test_the_spec_check_compares_exact_verify_with_plain_through_the_cli(tiny_engine_dir, tmp_path,
                                                                         monkeypatch):
    # the same code path as on a GPU, with --device cuda swapped for cpu and two modes
    from typer.testing import CliRunner

    real = CliRunner.invoke
    monkeypatch.setattr(CliRunner, "invoke", lambda self, app, args: real(
        self, app, ["cpu" if a == "cuda" else a for a in args]))
    monkeypatch.setattr(gc, "spec_modes", lambda d: [("mtp k=3", ["--speculative"]),
                                                     ("dflash2", ["--dflash", "--dflash-drafter", "dflash2"])])
    # on a CPU without packages auto runs eager torch; on the GPU the check expects cuda-graphs
    assert gc.cmd_spec(tiny_engine_dir, tmp_path / "spec.json", max_tokens=12, prompts=2,
                       expect_backend="torch") == 0
    report = json.loads((tmp_path / "spec.json").read_text())
    assert [m["mode"] for m in report["modes"]] == ["plain", "plain --backend torch",
                                                    "mtp k=3 exact", "dflash2 exact"]
    assert report["failed"] == 0 and all(m["identical_to_plain"] == 2 for m in report["modes"][2:])
    assert report["backend"] == "torch" and all(m["backend"] == "torch" for m in report["modes"])
    assert report["modes"][1]["identical_to_plain_info"] == 2
    # a run that did not go through the expected backend fails, saying which ran
    monkeypatch.setattr(gc, "spec_modes", lambda d: [("mtp k=1", ["--speculative", "--num-drafts", "1"])])
    assert gc.cmd_spec(tiny_engine_dir, tmp_path / "graphs.json", max_tokens=4, prompts=1) == 1
    report = json.loads((tmp_path / "graphs.json").read_text())
    assert report["expect_backend"] == "cuda-graphs" and report["failed"] == 2
    assert report["modes"][0]["error"] == "ran on torch, not cuda-graphs"
    assert report["modes"][2]["identical_to_plain"] == 1 and not report["modes"][2]["ok"]


def _kernels_script():
    spec = importlib.util.spec_from_file_location("gpu_kernels", ROOT / "scripts" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_op_launcher_call_maps_onto_its_compiled_cubin(monkeypatch):
    # what the cubin check does on a GPU up to the driver call: the ops' own launchers, with a
    # stand-in that picks the AOT cubin by the tensors' dtypes and checks arguments and
    # constexprs against what `plugins.aot` compiles (metadata as `kernel_specs` declares it)
    from types import SimpleNamespace

    from metrale.plugins import aot, dynamic_conv, fp8_gemm, nvfp4_gemm, nvfp4_moe, triton_mode

    gk = _kernels_script()
    shims = {}
    for act in ("fp32", "bf16"):
        for spec in aot.kernel_specs(act):
            meta = {"kernel": spec["name"].removesuffix("_kernel"), "act": act,
                    "signature": spec["signature"], "constexprs": spec["blocks"]}
            shims.setdefault(spec["name"], gk.CubinKernel(spec["name"], [], None, 90)).metas.append(meta)
    prepared = []
    for shim in shims.values():
        shim.launch = lambda grid, args, kw, shim=shim: prepared.append(shim.prepare(grid, args, kw))
    monkeypatch.setattr(triton_mode, "load_kernels", lambda device="cuda": SimpleNamespace(**shims))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=g)
    w8 = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn)
    fp8_gemm.fp8_w8a16_gemm_triton(x, w8, torch.rand(16))
    packed = torch.randint(0, 255, (16, 16), dtype=torch.uint8)
    nvfp4_gemm.nvfp4_w4a16_gemm_triton(x, packed, torch.rand(16, 2).to(torch.float8_e4m3fn),
                                       torch.tensor(1e-3))
    for dtype in (torch.float32, torch.bfloat16):  # (the GEMMs pick the fp32 dot on CPU)
        h, inter, e = 32, 16, 2
        nvfp4_moe.nvfp4_moe_w4a16_triton(
            torch.randn(2, h).to(dtype), torch.tensor([[0, 1], [1, 0]]), torch.rand(2, 2).to(dtype),
            torch.randint(0, 255, (e, 2 * inter, h // 2), dtype=torch.uint8),
            torch.rand(e, 2 * inter, h // 16).to(torch.float8_e4m3fn), torch.rand(e, 2),
            torch.randint(0, 255, (e, h, inter // 2), dtype=torch.uint8),
            torch.rand(e, h, inter // 16).to(torch.float8_e4m3fn), torch.rand(e))
        dynamic_conv.dflash2_dynamic_conv_triton(torch.randn(1, 4, 8).to(dtype),
                                                 torch.randn(1, 4, 2, 2).to(dtype), 2)
    keys = [p[0] for p in prepared]
    assert keys == ["fp8_w8a16_gemm.sm90.fp32", "nvfp4_w4a16_gemm.sm90.fp32",
                    "nvfp4_moe_gate_up.sm90.fp32", "nvfp4_moe_down.sm90.fp32",
                    "dflash2_dynamic_conv.sm90.fp32",
                    "nvfp4_moe_gate_up.sm90.bf16", "nvfp4_moe_down.sm90.bf16",
                    "dflash2_dynamic_conv.sm90.bf16"]
    key, meta, values, types, grid = prepared[0]
    assert len(values) == len(types) == len(meta["signature"]) + 2 and values[-2:] == (0, 0)
    assert values[4:7] == (3, 16, 32) and grid == (1, 1, 1)  # M, N, K; one 16x64 tile
    with pytest.raises(RuntimeError, match="launched with {'DOT_F32': True}, compiled with"):
        xb = x.to(torch.bfloat16)
        shims["fp8_w8a16_gemm_kernel"].prepare(
            (1, 1), (xb, w8.view(torch.uint8), torch.rand(16), torch.empty(3, 16).to(xb), 3, 16, 32),
            {"DOT_F32": True})  # a bf16 cubin is compiled with the tensor-core dot
    with pytest.raises(RuntimeError, match=r"no cubin for argument types \['torch.float16'"):
        fp8_gemm.fp8_w8a16_gemm_triton(x.half(), w8, torch.rand(16))  # no fp16 cubin compiled


def test_kernel_results_are_written_after_every_case(tmp_path):
    gk = _kernels_script()
    path = tmp_path / "kernels.json"
    results = gk.Results(path, sm=90)
    assert json.loads(path.read_text()) == {"sm": 90, "passed": 0, "failed": 0, "cases": []}
    results.run("good", lambda: 0.5)
    assert json.loads(path.read_text())["passed"] == 1  # on disk before the next case starts
    results.run("bad", lambda: 1 / 0)
    data = json.loads(path.read_text())
    assert (data["passed"], data["failed"]) == (1, 1) and "ZeroDivisionError" in data["cases"][1]["error"]
