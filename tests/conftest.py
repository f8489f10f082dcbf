"""Shared fixtures: engine directories built once per session from the embedded tiny recipe.

Tests run on CPU with one thread each (the models are tiny; the machines are shared). GPU tests
carry the `gpu` marker and are skipped where CUDA is unavailable.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent

# Speculative modes (flags of SpeculativeConfig.from_flags) that every backend claiming
# row-invariant verify must decode to plain greedy text.
CHUNKWISE_MODES = [
    {"speculative": True, "num_drafts": 3},
    {"speculative": True, "num_drafts": 3, "draft_confidence_stop": "cum:0.5"},
    {"dflash": True},
    {"dflash": True, "dflash_gamma": 4},
    {"dflash": True, "dflash_draft_ladder": "1,3,7"},
    {"dflash": True, "dflash_drafter": "dflash2"},
]
RECIPE = Path(os.environ.get("METRALE_TEST_RECIPE", ROOT / "recipes" / "tiny.toml"))
# the count policies of a DFlash mode run as a graph per count (`spec.count_policy`)
COUNT_POLICIES = {
    "ladder": dict(dflash_draft_ladder="1,3,7"),
    "adaptive k": dict(dflash_adaptive_k="0:1,1:1.1,2:1.2,3:1.3,4:1.4,5:1.5,6:1.6,7:1.7"),
    "adaptive k over trees": dict(dflash_tree_budget=16,
                                  dflash_adaptive_k=",".join(f"{k}:{1 + 0.1 * k:.1f}" for k in range(17))),
}


def replay_reading_nothing(it, prompt: list[int], name: str) -> None:
    """Every variant of iteration `it` (each count, greedy and sampled), twice, after a sampled
    prompt, under the guard that fails on a read from the host."""
    from metrale.runtime.backends.host_reads import forbid_host_reads
    from metrale.runtime.spec.sampling import SamplingParams

    with torch.inference_mode():
        params = SamplingParams(temperature=0.9, top_p=0.9, seed=1)
        it.seed(params)
        it.prefill(0, prompt, params)
        with forbid_host_reads(name):
            for fn in it.variants().values():
                fn()
                fn()


def assert_verify_rows_are_one_row_steps(target, k: int, seed: int, trials: int = 2) -> None:
    """For k drafts: each row of the k+1-row forward equals the one-row step at that position,
    bit for bit (logits, last hidden, taps), for random prompts of random lengths."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        n = int(torch.randint(3, 60, (1,), generator=gen))
        ids = torch.randint(0, target.config.vocab_size, (1, n + k + 1), generator=gen)
        a, b = target.new_cache(1, 80), target.new_cache(1, 80)
        with torch.inference_mode():
            target(ids[:, :n], a)
            target(ids[:, :n], b)
            many = target(ids[:, n:], a, taps=(0, 1, 3))
            ones = [target(ids[:, i:i + 1], b, taps=(0, 1, 3)) for i in range(n, n + k + 1)]
        for field in ("logits", "last_hidden", "taps"):
            assert torch.equal(getattr(many, field), torch.cat([getattr(o, field) for o in ones], dim=1)), field


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA unavailable)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _cpu_kernels_build() -> bool:
    from metrale.plugins import cpu_kernels

    return cpu_kernels.available(torch.float32)


# a test module of metrale's CPU kernels: `pytestmark = NEEDS_CPU_KERNELS`
NEEDS_CPU_KERNELS = pytest.mark.skipif(not _cpu_kernels_build(),
                                       reason="the kernels need an x86 CPU with AVX-512 or AVX2 and FMA")


@pytest.fixture(scope="session")
def cpu_kernels_lib(tmp_path_factory):
    """metrale's CPU kernels as a shared library, for calling them over ctypes (its tests carry
    `NEEDS_CPU_KERNELS`: where the kernels do not build, they are skipped)."""
    import ctypes

    from metrale.plugins import cpu_kernels

    return ctypes.CDLL(str(cpu_kernels.shared_library(tmp_path_factory.mktemp("kernels"))))


@pytest.fixture(scope="session")
def tiny_recipe():
    from metrale.builder.recipe import load_recipe

    return load_recipe(RECIPE)


@pytest.fixture(scope="session")
def engine_factory(tiny_recipe, tmp_path_factory):
    """build(tier="fp8", **overrides) -> engine directory, cached per argument set. CPU packages
    are compiled only where a test asks for them (`cpu_engines="aoti"`): they take minutes; ONNX
    graphs likewise (`onnx=True`)."""
    from metrale.builder.build import build_engine

    cache: dict = {}

    def build(tier: str = "fp8", **overrides) -> Path:
        key = (tier, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("engine") / f"tiny-{tier}"
            # ONNX graphs where a test asks for them (or for TensorRT engines, built from them)
            onnx = overrides.get("trt_flavor", "none") != "none"
            recipe = tiny_recipe.with_build(draft_weight_quantization=tier,
                                            **{"cpu_engines": "none", "onnx": onnx, **overrides})
            cache[key] = build_engine(recipe, out).engine_dir
        return cache[key]

    return build


@pytest.fixture(scope="session")
def tiny_engine_dir(engine_factory) -> Path:
    return engine_factory("fp8")


@pytest.fixture(scope="session")
def aoti_engine_dir(engine_factory) -> Path:
    """The default engine with its CPU packages (AOTInductor), as `metrale build` writes it."""
    return engine_factory("fp8", cpu_engines="aoti")


@pytest.fixture(scope="module")
def aoti_engine(aoti_engine_dir):
    """The default engine loaded on its CPU packages, one per test module (a module may change
    its faces' settings, as the lanes of its steps)."""
    from metrale.runtime.backends import load_engine

    engine = load_engine(aoti_engine_dir, backend="aoti")
    assert engine.backend.name == "aoti"
    return engine


@pytest.fixture(params=[1, 2], ids=["one-lane", "two-lanes"])
def lanes(request, aoti_engine):
    """The target face with its calls on one thread, or split over two (`aoti_native.Lanes`)."""
    from metrale.runtime.backends.aoti_native import Lanes

    target = aoti_engine.target
    before, target.lanes = target.lanes, Lanes(request.param)
    yield request.param
    target.lanes = before


@pytest.fixture(scope="session")
def tiny_engine(tiny_engine_dir):
    from metrale.runtime.backends import load_engine

    return load_engine(tiny_engine_dir)


@pytest.fixture(scope="session")
def tiny_prompts(tiny_recipe, tiny_engine) -> list[list[int]]:
    texts = json.loads((tiny_recipe.target.checkpoint.parent / "prompts.json").read_text())
    return [tiny_engine.tokenizer.encode(t) for t in texts[:4]]


PLAIN_TOKENS = 40  # the tokens of plain decoding `plain_tokens` holds per prompt


@pytest.fixture(scope="session")
def plain_tokens(tiny_engine, tiny_prompts) -> list[list[int]]:
    """Greedy plain decoding's first PLAIN_TOKENS tokens of each tiny prompt (what the iteration
    tests compare every mode with)."""
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=PLAIN_TOKENS)
    return [EngineGenerator(tiny_engine).generate(p, params).token_ids for p in tiny_prompts]


def solo_answers(gen, texts: list[str], max_tokens: int) -> list[str]:
    """Each text's greedy completion from `gen`'s decode loop alone (no server), EOS dropped."""
    from metrale.runtime.spec.sampling import SamplingParams

    tok, out = gen.tokenizer, []
    for text in texts:
        res = gen.generate(tok.encode(text), SamplingParams(temperature=0.0, max_tokens=max_tokens))
        out.append(tok.decode([t for t in res.token_ids if t not in tok.eos_token_ids]))
    return out


@contextlib.contextmanager
def serve_in_thread(app, limits=None):
    """Run an ASGI app with uvicorn on a free 127.0.0.1 port in a thread; yields its base URL.
    With `limits` (a ServerLimits), uvicorn runs as `metrale serve` configures it."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if limits is None:
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
    else:
        from metrale.runtime.serving.server import uvicorn_config

        config = uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


def cli_run(*args: str, env: dict | None = None):
    """`metrale ARGS` through typer's runner: it ends with SystemExit (0 or the error's code) and
    prints no traceback and no internal error, whatever the input."""
    from typer.testing import CliRunner

    from metrale.cli import app

    r = CliRunner().invoke(app, list(args), env=env)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    return r


def cli_refused(r, *needles: str) -> str:
    """A refusal: exit 2 and one line, `error: ...`, holding every needle."""
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def char_grammar_state(schema: dict, extra: list[str]):
    """A grammar state over a vocabulary of printable ASCII characters and `extra` tokens (as a
    BPE vocabulary holds `}, "` or `": 1, "`), its keys tracked -> (state, the id of each token)."""
    import xgrammar

    from metrale.runtime.spec.grammar import GrammarState, compile_schema
    from metrale.runtime.spec.json_keys import KeyTracker, KeyVocab

    toks = [chr(i) for i in range(32, 127)] + extra
    info = xgrammar.TokenizerInfo(["<end>", *toks], xgrammar.VocabType.RAW, vocab_size=len(toks) + 1,
                                  stop_token_ids=[0])
    compiled = compile_schema(xgrammar.GrammarCompiler(info, max_threads=1), json.dumps(schema))
    state = GrammarState(compiled, len(toks) + 1, KeyTracker(KeyVocab([b""] + [t.encode() for t in toks])))
    return state, {t: i + 1 for i, t in enumerate(toks)}
