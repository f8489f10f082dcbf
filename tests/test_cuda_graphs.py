"""The cuda-graphs backend (`runtime/backends/cuda_graphs.py`): on a CPU its capture and replay run through
the `EagerGraphs` stand-in, which checks the runner's bookkeeping (static inputs, static KV views
handed out per request, clones of the outputs, foreign and retired caches refused), that it
decodes like the eager backend, and that a failed capture leaves eager torch with the reason.
The `gpu` tests capture real CUDA graphs and are skipped without a GPU."""

import pytest
import torch
from conftest import CHUNKWISE_MODES

from metrale.runtime.backends.aoti import CompiledTarget, StaticKVCache
from metrale.runtime.backends.aoti_steps import TargetStep
from metrale.runtime.backends.cuda_graphs import (EagerGraphs, ForeignCache, GraphPackage, GraphTarget, load_graph_target,
                                         slot_buckets)
from metrale.runtime.models.layers import pack_for_inference

TAPS = (0, 1, 3)


@pytest.fixture(scope="module")
def packed(tiny_recipe):
    from metrale.runtime.models.loader import load_target

    return pack_for_inference(load_target(tiny_recipe.target.checkpoint)).eval()


@pytest.fixture(scope="module")
def graph_target(packed) -> GraphTarget:
    return load_graph_target(packed, TAPS, graphs=EagerGraphs(), slots=(64, 128))


def _ids(n, seed=0, vocab=2048):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def test_slot_buckets_cover_the_context():
    assert slot_buckets(1024) == (256, 1088)  # the tiny target
    assert slot_buckets(100) == (164,)
    assert slot_buckets(32768) == (256, 1088, 4352, 32832)
    for n in (100, 1024, 4096, 32768):  # the decode loop's largest cache plus a padded prompt chunk
        assert slot_buckets(n)[-1] >= n + 17 + 16


def test_every_row_count_and_bucket_is_captured_over_shared_static_kv(graph_target):
    runner = graph_target.runner
    assert set(runner.captured) == {(r, s) for s in (64, 128) for r in (1, 8, 16)}
    assert runner.graphs.captured == 6
    assert graph_target.slot_buckets == [64, 128] and graph_target.max_rows == 16
    assert all(t.shape[0] == 128 and not t.any() for t in runner.kv)  # zeroed after capture
    small = runner.views[64]
    assert all(v.data_ptr() == t.data_ptr() and v.is_contiguous() for v, t in zip(small, runner.kv))


def test_new_cache_hands_out_the_bucket_views_zeroed(graph_target):
    runner = graph_target.runner
    cache = graph_target.new_cache(1, 20)  # 20 + 16 rows of a padded chunk fit 64 slots
    assert cache.max_len == 64 and cache.length == 0
    assert all(a is b for a, b in zip(cache.kv, runner.views[64]))
    with torch.inference_mode():
        graph_target(_ids(5), cache)
    assert runner.kv[0][:5].abs().sum() > 0
    assert graph_target.new_cache(1, 50).max_len == 128  # 50 + 16 > 64
    assert not runner.kv[0].any()  # the new cache starts zeroed
    with pytest.raises(ValueError, match="needs 144 slots"):
        graph_target.new_cache(1, 128)
    with pytest.raises(ValueError, match="one sequence per cache"):
        graph_target.new_cache(2, 8)


def test_outputs_match_the_eager_steps_bit_for_bit_and_are_clones(graph_target, packed):
    """The same steps run as plain packages (no runner): identical bits, whichever rows."""
    step = TargetStep(packed, TAPS, "gemm").eval()
    # plain packages sized like a request's cache (60 positions + 16 padded rows -> 128 slots,
    # the graphs' bucket too)
    eager = CompiledTarget(packed, [GraphPackage(r, 0, step) for r in (1, 8, 16)], TAPS, max_slots=128)
    ids = _ids(40, seed=1)
    replays = graph_target.runner.replays
    a, b = graph_target.new_cache(1, 60), eager.new_cache(1, 60)
    with torch.inference_mode():
        for lo, hi in ((0, 35), (35, 36), (36, 40)):  # padded prompt chunks, a decode step, a verify
            got = graph_target(ids[:, lo:hi], a, taps=TAPS)
            want = eager(ids[:, lo:hi], b, taps=TAPS)
            for field in ("logits", "last_hidden", "taps"):
                assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert graph_target.runner.replays == replays + 5  # 35 rows: 16 + 16 + 3
        # outputs are the caller's: the next replay leaves them as they were
        kept = got.logits.clone()
        graph_target(ids[:, 40 - 1:40], a, start=39)
        assert torch.equal(got.logits, kept)
        ref = packed(ids, packed.new_cache(1, 64), taps=TAPS)
    assert (got.logits - ref.logits[:, 36:]).abs().max().item() <= 1e-4


def test_foreign_and_retired_caches_are_refused(graph_target, packed):
    c = packed.config
    foreign = StaticKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 64, packed.dtype)
    with pytest.raises(ForeignCache, match="not made by this target's new_cache"), torch.inference_mode():
        graph_target(_ids(3), foreign)
    first = graph_target.new_cache(1, 10)
    second = graph_target.new_cache(1, 10)
    assert first.retired and not second.retired
    with pytest.raises(ForeignCache, match="retired cache"), torch.inference_mode():
        graph_target(_ids(3), first)
    with torch.inference_mode():
        graph_target(_ids(3), second)  # the live one runs
    with pytest.raises(ValueError, match=r"takes \[1, 8\]"):
        graph_target.runner.run(8, 64, _ids(3), torch.tensor([0]), *second.kv)


# -- through the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stand_in_engine(tiny_engine_dir):
    """The default engine with its target on the stand-in graphs, as auto loads it on CUDA."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    return engine


def _addresses(model: torch.nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def test_nothing_moves_the_captured_weights_after_capture(tiny_engine_dir, tiny_prompts):
    """A CUDA graph replays the addresses its kernels read at capture: the generator's own
    `engine.pack()` (and any later pack) must leave every target weight where it was. A second
    fusing pack would allocate new q/k/v and gate/up copies, and the real graphs on a GPU would
    then decode garbage from freed memory (the stand-in, re-running Python, cannot tell)."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.sampling import SamplingParams

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    model = engine.target.model_ref
    before = _addresses(model)
    assert any(n.endswith("qkv_weight") for n in before) and any(n.endswith("experts_gate_up") for n in before)
    gen = EngineGenerator(engine)
    gen.generate(tiny_prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
    engine.pack()
    pack_for_inference(model)  # packing directly again is a no-op too
    assert _addresses(model) == before


def test_engine_records_what_runs_the_target(stand_in_engine):
    assert stand_in_engine.backend.name == "eager-graphs" and stand_in_engine.backend_note == ""
    target = stand_in_engine.target
    assert isinstance(target, GraphTarget)
    assert set(target.taps) == {i for d in stand_in_engine.drafters.values()
                                for i in d.config.target_layer_ids}
    assert target.slot_buckets == [256, 1088]  # the tiny target's context, as the CPU packages
    assert "target" in stand_in_engine.pack().resident_bytes()


def test_stand_in_decodes_like_the_eager_target(stand_in_engine, tiny_engine_dir, tiny_prompts):
    """Greedy plain decoding through the runner gives the eager backend's tokens."""
    from metrale.runtime.spec.decode import Decoder
    from metrale.runtime.backends import load_engine
    from metrale.runtime.spec.sampling import SamplingParams

    eager = load_engine(tiny_engine_dir, backend="torch")  # not the shared fixture's engine
    params = SamplingParams(temperature=0.0, max_tokens=24)
    eos = eager.tokenizer.eos_token_ids
    for ids in tiny_prompts[:3]:
        want = Decoder(eager.target, eos).generate(ids, params).token_ids
        got = Decoder(stand_in_engine.target, eos).generate(ids, params).token_ids
        assert got == want


SPEC_MODES = CHUNKWISE_MODES


@pytest.mark.parametrize("flags", SPEC_MODES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_stand_in_exact_verify_emits_plain_greedy_tokens(stand_in_engine, tiny_prompts, flags):
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = EngineGenerator(stand_in_engine)
    spec = EngineGenerator(stand_in_engine, SpeculativeConfig.from_flags(**flags, exact_verify=True))
    for ids in tiny_prompts[:2]:
        res = spec.generate(ids, params)
        assert res.token_ids == plain.generate(ids, params).token_ids
        assert res.metrics.drafts_verified > 0


class _FailingCapture(EagerGraphs):
    def __init__(self, exc: Exception):
        super().__init__()
        self.exc = exc

    def capture(self, fn, generators=()):
        raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("operation not permitted when stream is capturing"),
                                 TypeError("an unexpected failure")], ids=["runtime", "other"])
def test_a_capture_failure_falls_back_to_eager_with_the_reason(tiny_engine_dir, tiny_prompts, exc, caplog):
    from metrale.runtime.spec.decode import Decoder
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs
    from metrale.runtime.models.qwen3 import Qwen3ForCausalLM
    from metrale.runtime.spec.sampling import SamplingParams

    engine = load_engine(tiny_engine_dir, backend="torch")
    with caplog.at_level("WARNING"):
        use_cuda_graphs(engine, graphs=_FailingCapture(exc))
    assert engine.backend.name == "torch" and isinstance(engine.target, Qwen3ForCausalLM)
    assert engine.backend_note.startswith("CUDA graphs failed, running eager torch")
    assert str(exc) in engine.backend_note and str(exc) in caplog.text
    out = Decoder(engine.target, engine.tokenizer.eos_token_ids).generate(
        tiny_prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out.token_ids) == 4


def test_real_capture_on_a_cpu_device_falls_back(tiny_engine_dir):
    """Without the stand-in, a CPU engine cannot capture: eager torch, and the note says why."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import use_cuda_graphs

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine)
    assert engine.backend.name == "torch" and "need a CUDA device" in engine.backend_note


def test_auto_on_a_cpu_does_not_try_cuda_graphs(tiny_engine_dir):
    from metrale.runtime.backends.aoti import build_fingerprint
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.aoti import use_cpu_packages
    from metrale.runtime.artifact.entries import ComponentEntry, CpuPackages

    engine = load_engine(tiny_engine_dir, backend="auto")
    assert engine.backend.name == "torch" and engine.backend_note == ""  # no CPU packages: nothing to note
    # packages built for another machine: eager torch, and the note says why
    info = ComponentEntry(kind="target", files=[], cpu=CpuPackages(
        **{**build_fingerprint(torch.float32, 1), "isa": "AVX512_NOT_HERE"}, packages=[],
        max_slots=64, linear="gemm"))
    use_cpu_packages(engine, info, False)
    assert engine.backend.name == "torch" and "built for isa 'AVX512_NOT_HERE'" in engine.backend_note


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graphs_on_gpu_decode_like_plain_greedy_in_every_mode(tiny_engine_dir, tiny_prompts):
    """auto on CUDA captures real graphs; every mode's exact verify emits plain greedy's tokens;
    --backend torch on CUDA stays eager."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    engine = load_engine(tiny_engine_dir, device="cuda", backend="auto")
    assert engine.backend.name == "cuda-graphs", engine.backend_note
    assert load_engine(tiny_engine_dir, device="cuda", backend="torch").backend.name == "torch"
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = EngineGenerator(engine)
    want = [plain.generate(ids, params).token_ids for ids in tiny_prompts]
    replays = engine.target.runner.replays
    for flags in SPEC_MODES:
        spec = EngineGenerator(engine, SpeculativeConfig.from_flags(**flags, exact_verify=True))
        assert [spec.generate(ids, params).token_ids for ids in tiny_prompts] == want, flags
    assert engine.target.runner.replays > replays


def test_cuda_capture_follows_the_documented_sequence(monkeypatch):
    """`CudaGraphs` against a recording stand-in of `torch.cuda`: warm-up on a side stream that
    waits for the current one (and is waited for), capture inside `torch.cuda.graph` with the
    shared pool, replay through the graph; the real `torch.cuda.graph` takes `pool`."""
    import contextlib
    import inspect

    from metrale.runtime.backends.cuda_graphs import WARMUP, CudaGraphs

    assert "pool" in inspect.signature(torch.cuda.graph.__init__).parameters
    calls = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            calls.append(f"{self.name} waits {other.name}")

    class Graph:
        def replay(self):
            calls.append("replay")

    @contextlib.contextmanager
    def ctx(what):
        calls.append(f"enter {what}")
        yield
        calls.append(f"exit {what}")

    main = Stream("main")
    for name, value in {"is_available": lambda: True, "graph_pool_handle": lambda: "pool-0",
                        "Stream": Stream, "current_stream": lambda: main, "CUDAGraph": Graph,
                        "stream": lambda s: ctx(f"stream {s.name}"), "device": lambda d: ctx("device"),
                        "graph": lambda g, pool=None: ctx(f"capture pool={pool}"),
                        "synchronize": lambda *a: calls.append("sync")}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    graphs = CudaGraphs(torch.device("cuda"))
    graphs.warmup(lambda: calls.append("step"))
    assert calls == ["enter device", "side waits main", "enter stream side", *["step"] * WARMUP,
                     "exit stream side", "main waits side", "sync", "exit device"]
    calls.clear()
    graph, outs = graphs.capture(lambda: calls.append("step") or ("logits",))
    assert calls == ["enter device", "enter capture pool=pool-0", "step", "exit capture pool=pool-0",
                     "exit device", "sync"] and outs == ("logits",)
    graphs.replay(graph)
    assert calls[-1] == "replay"
