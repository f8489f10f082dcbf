"""Which backend and which SM's engines run: `--backend` against `--device`, `--dtype` and
`--nproc` before anything loads, and the engine SM picked for the GPU (or refused by name)."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from metrale.runtime.errors import ConfigError, EngineDirError
from metrale.runtime.backends import Backend, resolve_backend
from metrale.runtime.backends.trt_runner import pick_engine_sm


def plain_text(s: str) -> str:
    return re.sub(r"[\s│╭╮╰╯─]+", " ", re.sub(r"\x1b\[[0-9;]*m", "", s))


def _app():
    from metrale.cli import app

    return app


# -- flags -----------------------------------------------------------------------------------


def test_tensorrt_refused_without_cuda_names_the_flag():
    with pytest.raises(ConfigError, match=r"--backend tensorrt .*CUDA is not available"):
        resolve_backend("tensorrt", None, cuda_available=False)
    if not torch.cuda.is_available():  # this machine: the real check, and through the CLI
        with pytest.raises(ConfigError, match="--backend tensorrt"):
            resolve_backend("tensorrt", "cuda")
        # the engine directory does not exist: the refusal comes before anything is read
        for cmd in (["generate", "--prompt", "x"], ["serve"], ["bench"]):
            r = CliRunner().invoke(_app(), [*cmd, "--engine-dir", "/nonexistent", "--backend", "tensorrt"])
            assert r.exit_code == 2 and "Traceback" not in r.output
            assert "--backend tensorrt" in plain_text(r.output) and "nonexistent" not in r.output




@pytest.mark.parametrize("args, expected", [
    (("torch", None), (Backend.TORCH, "cpu")),
    (("torch", "cuda:1"), (Backend.TORCH, "cuda:1")),  # the torch backend checks its own device
    (("tensorrt", None), (Backend.TENSORRT, "cuda")),
    (("tensorrt", "cuda:0"), (Backend.TENSORRT, "cuda:0")),
    (("auto", None), (Backend.AUTO, "cpu")),
    (("aoti", None), (Backend.AOTI, "cpu")),
])
def test_backend_and_device_defaults(args, expected):
    assert resolve_backend(*args, cuda_available=True) == expected


def test_tensorrt_runs_a_world_of_ranks():
    # --nproc N: one process per rank of a --draft-tp-size N build (checked when it loads)
    assert resolve_backend("tensorrt", None, nproc=2, cuda_available=True) == (Backend.TENSORRT, "cuda")


def test_tensorrt_world_plan_pairs_ranks_with_rank_engines():
    from types import SimpleNamespace as NS

    from metrale.runtime.backends.tensorrt import plan_file, world_plan
    from metrale.runtime.models.tp import TensorParallel

    one = {"target": NS(tp_size=1), "dflash": NS(tp_size=1)}
    two = {"target": NS(tp_size=1), "dflash": NS(tp_size=2), "dflash2": NS(tp_size=2)}
    assert world_plan(one, None, "d") == (0, 1)
    assert world_plan(two, TensorParallel(1, 2), "d") == (1, 2)
    with pytest.raises(ConfigError, match=r"tensor-parallel drafter engines \(dflash: 2 ranks, "
                                          r"dflash2: 2 ranks\); run them with --nproc 2"):
        world_plan(two, None, "d")
    with pytest.raises(ConfigError, match="on 2 ranks: engine directory d has no tensor-parallel"):
        world_plan(one, TensorParallel(0, 2), "d")
    with pytest.raises(ConfigError, match="on 4 ranks: .* drafter engines of dflash: 2 ranks"):
        world_plan(two, TensorParallel(3, 4), "d")
    from metrale.runtime.artifact.entries import Plan, PlanFile

    ranks = Plan(ranks=[PlanFile(file=f"dflash/rank{r}.sm89.engine", seconds=1.0, bytes=1) for r in range(2)])
    assert plan_file(ranks, 1) == "dflash/rank1.sm89.engine"
    assert plan_file(Plan(file="target/rank0.sm89.engine"), 1) == "target/rank0.sm89.engine"


@pytest.mark.parametrize("kwargs, needle", [
    (dict(backend="tpu", device=None), "--backend 'tpu': allowed values are auto, torch, aoti, onnxruntime, tensorrt"),
    (dict(backend="aoti", device="cuda"), "--backend aoti runs the engine's CPU packages; --device cuda"),
    (dict(backend="tensorrt", device="cpu"), "needs --device cuda or cuda:N, got --device cpu"),
    (dict(backend="onnxruntime", device=None, nproc=2), "--nproc 2"),
])
def test_backend_refusals_name_the_flag(kwargs, needle):
    with pytest.raises(ConfigError) as exc:
        resolve_backend(**kwargs, cuda_available=True)
    assert needle in str(exc.value)


# -- which SM's engines ----------------------------------------------------------------------


def test_sm_choice_takes_the_gpus_own_sm():
    engines = {"target": {"89": {}, "120": {}}, "mtp": {"120": {}, "89": {}}}
    assert pick_engine_sm(engines, 89, "e") == 89
    assert pick_engine_sm(engines, 120, "e") == 120
    assert pick_engine_sm({"target": [90]}, 90, "e") == 90


def test_sm_choice_refuses_an_sm_not_built_naming_dir_and_sms():
    engines = {"target": {"89": {}, "120": {}}, "dflash": {"89": {}, "120": {}}}
    with pytest.raises(EngineDirError) as exc:
        pick_engine_sm(engines, 90, "engines/tiny")  # an H100/H200 against RTX-built engines
    msg = str(exc.value)
    assert "engines/tiny" in msg and "SM90" in msg and "89, 120" in msg and "--target-sm 90" in msg
    with pytest.raises(EngineDirError, match="SM86"):  # no nearest-SM fallback: exact or nothing
        pick_engine_sm(engines, 86, "e")


def test_sm_choice_refuses_a_component_missing_the_sm_and_a_dir_without_engines():
    with pytest.raises(EngineDirError, match="component mtp has engines for SM 120"):
        pick_engine_sm({"target": {"89": {}, "120": {}}, "mtp": {"120": {}}}, 89, "e")
    with pytest.raises(EngineDirError, match="holds no TensorRT engines.*--trt-flavor none"):
        pick_engine_sm({"target": {}, "mtp": {}}, 89, "e")


# -- the stand-ins, on CPU, over the graphs the engines are built from ----------------------

# small on purpose: prompts span several target calls, the drafter's queue outgrows `context`


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_on_a_cpu():
    from metrale import options as o
    from metrale.runtime.errors import ConfigError

    assert o.torch_dtype("auto", "cuda") is torch.bfloat16
    assert o.torch_dtype("auto", "cuda:1") is torch.bfloat16
    assert o.torch_dtype("auto", "cpu") is torch.float32
    assert o.torch_dtype("bf16", "cpu") is torch.bfloat16 and o.torch_dtype("float32", "cuda") is torch.float32
    with pytest.raises(ConfigError, match="--dtype 'half': expected one of auto, float32, bfloat16"):
        o.torch_dtype("half")
