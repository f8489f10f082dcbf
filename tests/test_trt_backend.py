"""The tensorrt backend.

On CPU: the flag checks (`--backend tensorrt` refused without CUDA, naming the flag), the rule
that picks which SM's engines a GPU runs, and the backend's stand-ins for the target, the MTP
head and the drafters driven by `AdapterRunner` — a runner that executes the very step graphs
the engines are built from (`builder.onnx_export`'s adapters) with a deliberately small
optimization profile, so prompt chunking, the drafter's context queue, tap selection, cache
positions and the CUDA-graph keys are all exercised and checked against the torch backend.

On a GPU (`gpu` marker): real engines built for the local SM — logits, taps and drafts against
the torch backend on CUDA, greedy output under --exact-verify, CUDA graph capture and reuse.
`METRALE_TRT_ENGINES=fp8=DIR,nvfp4=DIR` points the GPU tests at engine directories built
already (what scripts/gpu_checks.sh does); otherwise they build them here.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from typer.testing import CliRunner

from metrale.runtime.artifact.engine import LoadedEngine
from metrale.runtime.errors import EngineDirError
from metrale.runtime.spec.sampling import SamplingParams
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.backends.graph_steps import (
    GraphDrafter, GraphMTP, GraphTarget, propose_graph_key,
)
from metrale.runtime.backends.graph_cache import EngineCache, SlotPool, position_limit

GREEDY = SamplingParams(temperature=0.0, max_tokens=14)
MODES = {
    "plain": {},
    "mtp k=3": dict(speculative=True, num_drafts=3),
    "dflash": dict(dflash=True),
    "dflash2": dict(dflash=True, dflash_drafter="dflash2"),
}


def plain_text(s: str) -> str:
    return re.sub(r"[\s│╭╮╰╯─]+", " ", re.sub(r"\x1b\[[0-9;]*m", "", s))


def _app():
    from metrale.cli import app

    return app


TOKENS_PROFILE = {"tokens": (1, 2, 5), "past": (1, 64, 160)}
DRAFT_PROFILE = {"context": (1, 2, 3), "block": (1, 8, 8), "past": (1, 64, 160)}
ENGINE_TAPS = (3, 0, 1)  # another order than the drafters' (0, 1, 3): selection must reorder


class AdapterRunner:
    """`EngineRunner`'s interface over a step adapter in torch; every call checked against the
    profile and recorded with its graph key."""

    def __init__(self, kind, module, profile, taps=()):
        from metrale.builder import onnx_export as ox

        self.step = ox.adapter(kind, module, taps).eval()
        self.gio = ox.graph_io(kind, module, taps)
        self.profile, self.device = profile, torch.device("cpu")
        self.dtypes = {n: torch.float32 for n in self.gio.inputs + self.gio.outputs}
        self.calls: list[tuple] = []  # (graph key, {input: shape})
        self.persistent: dict[tuple, int] = {}  # (graph key, input) -> its buffer

    def run(self, feeds, graph_key=None, persistent=()):
        for name in self.gio.inputs:
            for axis, label in self.gio.dynamic.get(name, {}).items():
                lo, _, hi = self.profile[label]
                assert lo <= feeds[name].shape[axis] <= hi, (name, feeds[name].shape, label)
        for name in persistent:
            if name in ("past_key", "past_value"):  # the whole preallocated cache, in one of the profile's sizes
                assert feeds[name].shape[3] in (self.profile["past"][1], self.profile["past"][2])
            if graph_key is not None:  # a replayed graph reads it in place: the same buffer each call
                ptr = self.persistent.setdefault((graph_key, name), feeds[name].data_ptr())
                assert ptr == feeds[name].data_ptr(), (graph_key, name)
        self.calls.append((graph_key, {n: tuple(feeds[n].shape) for n in self.gio.inputs}))
        with torch.no_grad():
            outs = self.step(*[feeds[n] for n in self.gio.inputs])
        return dict(zip(self.gio.outputs, outs))


def standin_engine(e: LoadedEngine, target_profile=TOKENS_PROFILE, mtp_profile=TOKENS_PROFILE,
                   draft_profile=DRAFT_PROFILE) -> LoadedEngine:
    """The torch engine `e` behind the tensorrt backend's stand-ins (as `load_trt_engine` puts
    them together: the target's context limited by every component's profile)."""
    limit = position_limit(e.target.config.max_position_embeddings,
                           [p["past"][2] for p in (target_profile, mtp_profile, draft_profile)])
    target = GraphTarget(AdapterRunner("target", e.target, target_profile, ENGINE_TAPS), target_profile,
                       e.target.config, e.target.model.embed_tokens, ENGINE_TAPS, limit)
    mtp = GraphMTP(AdapterRunner("mtp", e.mtp, mtp_profile), mtp_profile, e.mtp.config.decoder)
    drafters = {}
    for name, d in e.drafters.items():
        books = None
        if d.config.version == 2:
            sel = d.candidate_selector
            books = (sel.predecessor_codebook.detach(), sel.successor_codebook.detach())
        drafters[name] = GraphDrafter(AdapterRunner("dflash", d, draft_profile), draft_profile,
                                    d.config, books)
    return LoadedEngine(e.path, e.manifest, e.tokenizer, target, mtp, drafters)


@pytest.fixture(scope="module")
def standins(tiny_engine):
    return standin_engine(tiny_engine)


def decode(engine, prompts, flags, params=GREEDY):
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(**flags))
    return [gen.decoder().generate(p, params).token_ids for p in prompts]


def test_standin_target_matches_torch_target_across_chunks(tiny_engine, standins, tiny_prompts):
    ids = torch.tensor([tiny_prompts[0][:12]])  # 12 tokens: three calls of at most 5
    ref_cache = tiny_engine.target.new_cache(1, 64)
    ref = tiny_engine.target(ids, ref_cache, taps=(0, 1, 3))
    cache = standins.target.new_cache(1, 64)
    got = standins.target(ids, cache, taps=(0, 1, 3))
    assert cache.length == 12 and cache.max_len == 64  # the profile's opt past, not its max
    assert [c[1]["input_ids"][1] for c in standins.target.runner.calls[-3:]] == [5, 5, 2]
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.last_hidden, ref.last_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.taps, ref.taps, rtol=1e-4, atol=1e-4)  # reordered from (3, 0, 1)
    torch.testing.assert_close(cache.k[:, :, :, :12], ref_cache.k[:, :, :, :12], rtol=1e-4, atol=1e-4)
    # one more token at position 12: a one-token step, the graphed shape
    nxt = torch.tensor([[tiny_prompts[0][12]]])
    torch.testing.assert_close(standins.target(nxt, cache).logits,
                               tiny_engine.target(nxt, ref_cache).logits, rtol=1e-4, atol=1e-4)
    assert standins.target.runner.calls[-1][0] == ("step", cache.slot_id)
    assert all(c[0] is None for c in standins.target.runner.calls[-4:-1])  # prefill chunks: eager


def test_tap_selection_reorders_and_refuses_untapped_layers(standins):
    h = standins.target.config.hidden_size
    tapped = torch.arange(3 * h, dtype=torch.float32).view(1, 1, 3 * h)  # layers 3, 0, 1
    got = standins.target.select_taps(tapped, (0, 1, 3))
    assert torch.equal(got[..., :h], tapped[..., h:2 * h])  # layer 0 sits second in the engine
    assert torch.equal(got[..., 2 * h:], tapped[..., :h])
    assert standins.target.select_taps(tapped, (3, 0, 1)) is tapped
    assert standins.target.select_taps(tapped, ()) is None
    with pytest.raises(EngineDirError, match=r"taps layers \[3, 0, 1\], not \[2\]"):
        standins.target.select_taps(tapped, (2,))


@pytest.mark.parametrize("mode", list(MODES))
def test_standins_decode_like_the_torch_backend(tiny_engine, standins, tiny_prompts, mode):
    prompts = tiny_prompts[:2]
    assert decode(standins, prompts, MODES[mode]) == decode(tiny_engine, prompts, MODES[mode])


def test_exact_verify_through_standins_equals_plain(standins, tiny_prompts):
    prompts = tiny_prompts[:2]
    plain = decode(standins, prompts, {})
    for flags in (MODES["mtp k=3"], MODES["dflash2"]):
        assert decode(standins, prompts, {**flags, "exact_verify": True}) == plain


def test_a_target_graph_whose_profile_takes_a_trees_rows_verifies_it_in_one_call(tiny_engine, tiny_prompts):
    """A target profile of at least a 64-node tree's rows (the build's default: 256) runs each
    tree's rows in one call with its `tree_mask` [N, N]; one of fewer rows walks the paths.
    Both decode as the torch backend's trees do."""
    wide = standin_engine(tiny_engine, target_profile={"tokens": (1, 2, 65), "past": (1, 64, 160)})
    assert wide.target.tree_rows and not standin_engine(tiny_engine).target.tree_rows
    flags = {**MODES["dflash2"], "dflash_tree_budget": 16, "dflash_tree_verify": "forward"}
    prompts = tiny_prompts[:2]
    calls = wide.target.runner.calls
    calls.clear()
    params = SamplingParams(temperature=0.0, max_tokens=40)
    assert decode(wide, prompts, flags, params) == decode(tiny_engine, prompts, flags, params)
    rows = [shapes["input_ids"][1] for _, shapes in calls]
    assert all(shapes["tree_mask"] == (t, t) for t, (_, shapes) in zip(rows, calls))
    assert rows.count(17) >= 4  # 16-node trees' rows, each in one call

def test_drafter_queue_and_graph_keys(standins, tiny_prompts):
    runner = standins.drafters["dflash"].runner
    runner.calls.clear()
    decode(standins, tiny_prompts[:1], MODES["dflash"])
    flushes = [c for k, c in runner.calls if c["block_embeds"][1] == 1]
    proposes = [(k, c) for k, c in runner.calls if c["block_embeds"][1] == 8]
    n_prompt = len(tiny_prompts[0])
    first = next(i for i, (_, c) in enumerate(runner.calls) if c["block_embeds"][1] == 8)
    ahead = [c for _, c in runner.calls[:first]]
    # the prompt's context goes ahead in chunks of 3; what is left rides with the first propose
    # (a step that accepts more rows than a propose carries flushes the rest the same way)
    assert sum(c["context_features"][1] for c in ahead) == 3 * ((n_prompt - 1) // 3)
    assert all(c["context_features"][1] == 3 for c in flushes)
    assert proposes and all(k == ("propose", k[1], c["context_features"][1], 8) for k, c in proposes)
    positions = [c for _, c in runner.calls]
    assert len(positions) == len(flushes) + len(proposes)


def test_caches_come_from_a_pool_and_return_to_it():
    pool = SlotPool((2, 1, 1, 4, 2), torch.float32, torch.device("cpu"))
    a = pool.cache()
    b = pool.cache()  # alive at once: never the same buffer
    assert a.slot_id != b.slot_id and a.k.data_ptr() != b.k.data_ptr()
    a_id, a_ptr = a.slot_id, a.k.data_ptr()
    a.write_new(1, torch.ones(2, 1, 1, 2, 2), torch.full((2, 1, 1, 2, 2), 2.0))
    assert a.k[0, 0, 0, :, 0].tolist() == [0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="holds 4 positions; 5 requested"):
        a.write_new(3, torch.ones(2, 1, 1, 2, 2), torch.ones(2, 1, 1, 2, 2))
    del a
    c = pool.cache()  # the collected cache's buffer (and the graphs captured on it) come back
    assert (c.slot_id, c.k.data_ptr(), c.length, c.pending) == (a_id, a_ptr, 0, None)
    assert pool.count == 2


def test_standin_caches_are_reused_by_the_next_request(standins, tiny_prompts):
    decode(standins, tiny_prompts[:1], {})
    keys = {k for k, _ in standins.target.runner.calls[-5:] if k is not None}
    decode(standins, tiny_prompts[1:2], {})
    assert keys and keys == {k for k, _ in standins.target.runner.calls[-5:] if k is not None}


# -- on a GPU: real engines --------------------------------------------------------------------


def _build_flavor(sm: int) -> str | None:
    """Full TensorRT where it imports (it builds for the local GPU), else TensorRT-RTX where it
    supports the SM, else None."""
    from metrale.builder.trt_env import TrtUnavailable, load_trt

    for flavor in ("tensorrt", "rtx"):
        try:
            tm = load_trt(flavor)
        except TrtUnavailable:
            continue
        if sm in tm.supported_sms():
            return flavor
    return None


@pytest.fixture(scope="session")
def gpu_engine_dir(engine_factory):
    from metrale.runtime.backends.trt_runner import gpu_sm

    given = dict(p.split("=", 1) for p in os.environ.get("METRALE_TRT_ENGINES", "").split(",") if p)
    sm = gpu_sm(torch.device("cuda"))
    built = {}

    def get(tier: str):
        if tier in given:
            return given[tier]
        if tier not in built:
            flavor = _build_flavor(sm)
            if flavor is None:
                pytest.skip(f"no TensorRT flavour here builds SM{sm} (tensorrt is not installed; "
                            "tensorrt_rtx builds SM75-SM121 without SM90/SM100)")
            built[tier] = engine_factory(tier, trt_flavor=flavor, target_sm=(sm,))
        return built[tier]

    return get


def _engines(gpu_engine_dir, tier="fp8"):
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.tensorrt import load_trt_engine

    from metrale.runtime.artifact.engine_dir import load_manifest

    path = gpu_engine_dir(tier)  # the torch reference computes in the plans' dtype
    dtype = getattr(torch, load_manifest(path).build.get("trt_dtype", "float32"))
    return load_engine(path, device="cuda", dtype=dtype), load_trt_engine(path, device="cuda")


def _same_up_to_near_ties(ref_logits, ref_ids, got_ids, margin=1e-2):
    """Greedy ids agree until the first position where the reference's own top-2 margin is
    below `margin` (a float32-vs-TF32 near tie); returns how many positions were compared."""
    for i, (a, b) in enumerate(zip(ref_ids, got_ids)):
        if a != b:
            top = ref_logits[i].float().topk(2).values
            assert top[0] - top[1] < margin, f"position {i}: {b} instead of {a}, clear margin"
            return i
    return len(ref_ids)


@pytest.mark.gpu
def test_gpu_target_and_head_logits_match_torch(gpu_engine_dir, tiny_prompts):
    ref, trt = _engines(gpu_engine_dir)
    ids = torch.tensor([tiny_prompts[0]], device="cuda")
    rc, tc = ref.target.new_cache(1, 256), trt.target.new_cache(1, 256)
    r, t = ref.target(ids, rc, taps=(0, 1, 3)), trt.target(ids, tc, taps=(0, 1, 3))
    scale = r.logits.abs().max().item()
    for a, b in ((r.logits, t.logits), (r.taps, t.taps), (r.last_hidden, t.last_hidden)):
        assert (a - b).abs().max().item() <= 2e-2 * max(1.0, scale)
    for tok in tiny_prompts[1][:6]:  # one-token steps: the CUDA-graph path
        step = torch.tensor([[tok]], device="cuda")
        a, b = ref.target(step, rc).logits, trt.target(step, tc).logits
        assert (a - b).abs().max().item() <= 2e-2 * max(1.0, a.abs().max().item())
    emb = ref.target.model.embed_tokens(ids[:, 1:])
    hc, hc2 = ref.mtp.new_cache(1, 256, ref.dtype, "cuda"), trt.mtp.new_cache(1, 256)
    a, _ = ref.mtp(emb, r.last_hidden[:, :-1], hc)
    b, _ = trt.mtp(emb, r.last_hidden[:, :-1], hc2)
    assert (a - b).abs().max().item() <= 2e-2 * max(1.0, a.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["fp8", "nvfp4"])  # nvfp4 below SM100 runs the plugin's cubin
@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_gpu_drafts_match_torch(gpu_engine_dir, tiny_prompts, tier, drafter):
    ref, trt = _engines(gpu_engine_dir, tier)
    ids = torch.tensor([tiny_prompts[2]], device="cuda")
    out = ref.target(ids, ref.target.new_cache(1, 256), taps=(0, 1, 3))
    anchor = out.logits[0, -1].argmax().view(1)
    props = []
    for e in (ref, trt):
        d = e.drafters[drafter]
        cache = d.new_cache(1, 256, ref.dtype, "cuda")
        d.add_context(out.taps, cache)
        props.append(d.propose(anchor, ref.target.model.embed_tokens, cache, d.config.block_size))
    a, b = props
    assert (a.logits - b.logits).abs().max().item() <= 2e-2 * max(1.0, a.logits.abs().max().item())
    n = _same_up_to_near_ties(a.logits[0], a.tokens[0].tolist(), b.tokens[0].tolist())
    assert n >= 1


@pytest.mark.gpu
def test_gpu_greedy_matches_torch_and_exact_verify_matches_plain(gpu_engine_dir, tiny_prompts):
    ref, trt = _engines(gpu_engine_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain = decode(trt, tiny_prompts, {}, params)
    for flags in (MODES["mtp k=3"], MODES["dflash"], MODES["dflash2"]):
        assert decode(trt, tiny_prompts, {**flags, "exact_verify": True}, params) == plain
    ref_plain = decode(ref, tiny_prompts, {}, params)
    agree = sum(a == b for a, b in zip(ref_plain, plain))
    # two implementations: TF32 may move one near tie in float32; bfloat16 rounds coarser
    assert agree >= (len(plain) - 1 if ref.dtype == torch.float32 else len(plain) // 2), (ref_plain, plain)


@pytest.mark.gpu
def test_gpu_trees_in_one_call_emit_what_their_paths_do(gpu_engine_dir, tiny_prompts):
    _, trt = _engines(gpu_engine_dir)
    assert trt.tree_attention  # the build's profile takes a 64-node tree's rows
    params = SamplingParams(temperature=0.0, max_tokens=24)
    tree = {**MODES["dflash2"], "dflash_tree_budget": 16}
    paths = decode(trt, tiny_prompts, {**tree, "dflash_tree_verify": "paths"}, params)
    calls, one_call = [], trt.target.forward_tree
    trt.target.forward_tree = lambda f: calls.append(len(f.tree.tokens)) or one_call(f)
    forward = decode(trt, tiny_prompts, {**tree, "dflash_tree_verify": "forward"}, params)
    del trt.target.forward_tree
    assert 17 in calls  # 16-node trees' rows, each in one engine call
    assert sum(a == b for a, b in zip(paths, forward)) >= len(paths) - 1  # a near tie may move
    assert decode(trt, tiny_prompts, {**tree, "exact_verify": True}, params) == decode(trt, tiny_prompts, {}, params)


@pytest.mark.gpu
def test_gpu_decode_steps_replay_cuda_graphs_and_reuse_them(gpu_engine_dir, tiny_prompts):
    from metrale.runtime.backends.tensorrt import runner_stats

    _, trt = _engines(gpu_engine_dir)
    decode(trt, tiny_prompts[:1], MODES["dflash"])
    first = runner_stats(trt)
    decode(trt, tiny_prompts[1:2], MODES["dflash"])
    second = runner_stats(trt)
    for name in ("target", "dflash"):
        mode = second[name]["graph_mode"]
        assert mode in ("manual", "rtx-native"), second[name]
        if mode == "manual":
            assert first[name]["graph_captures"] >= 1 and second[name]["graph_replays"] > 0
            # the second request got the first one's cache buffer back, and its graphs
            assert second[name]["graph_captures"] <= first[name]["graph_captures"] + 1


@pytest.mark.gpu
def test_gpu_cli_generate_with_the_tensorrt_backend(gpu_engine_dir):
    import json

    path = gpu_engine_dir("fp8")
    r = CliRunner().invoke(_app(), ["generate", "--engine-dir", str(path), "--prompt", "def main(",
                                    "--max-tokens", "12", "--json", "--dflash", "--exact-verify",
                                    "--backend", "tensorrt"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.output.strip().splitlines()[-1])
    plain = CliRunner().invoke(_app(), ["generate", "--engine-dir", str(path), "--prompt", "def main(",
                                        "--max-tokens", "12", "--json", "--backend", "tensorrt"])
    assert json.loads(plain.output.strip().splitlines()[-1])["token_ids"] == row["token_ids"]


@pytest.mark.gpu
def test_gpu_refuses_a_directory_without_engines(engine_factory):
    from metrale.runtime.backends.tensorrt import load_trt_engine

    with pytest.raises(EngineDirError, match="holds no TensorRT engines"):
        load_trt_engine(engine_factory("fp8"), device="cuda")  # the default build: trt_flavor none


def test_engine_cache_reports_its_length_and_size():
    cache = EngineCache({"id": 7, "k": torch.zeros(1, 1, 2, 5, 4), "v": torch.zeros(1, 1, 2, 5, 4)})
    assert (cache.slot_id, cache.max_len, cache.length) == (7, 5, 0)


# -- cache sizes, the context limit, graph keys ------------------------------------------------


def test_cache_starts_at_the_opt_size_and_grows_keeping_its_positions():
    from metrale.runtime.backends.graph_cache import CacheSizes

    sizes = CacheSizes(2, 1, 2, [8, 4], torch.float32, torch.device("cpu"))  # opt 4, max 8
    c = sizes.cache()
    assert c.max_len == 4 and c.slot_id == 0
    c.write_new(0, torch.ones(2, 1, 1, 3, 2), torch.full((2, 1, 1, 3, 2), 2.0))
    c.length = 3
    c.reserve(4)  # fits: same buffer
    assert c.max_len == 4
    c.reserve(6)  # the next call writes positions 3..5: moves to the max size first
    assert (c.max_len, c.slot_id, c.length) == (8, 1, 3)
    assert c.k[0, 0, 0, :, 0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert c.v[1, 0, 0, :3, 1].tolist() == [2, 2, 2]
    small, big = sizes.pools
    assert [s["id"] for s in small.free] == [0]  # the small buffer went back at once
    other = sizes.cache()
    assert other.slot_id == 0 and other.max_len == 4  # and serves the next cache
    with pytest.raises(ValueError, match=r"at most 8 positions \(the engine profile's largest past\); 9"):
        c.reserve(9)
    del c
    assert [s["id"] for s in big.free] == [1]  # collected: its (grown) buffer returns


def test_position_limit_takes_the_smallest_component_less_a_steps_rows():
    assert position_limit(1024, [1024, 1024, 1024]) == 1024 - 17
    assert position_limit(1024, [4096, 512]) == 512 - 17
    assert position_limit(100, [4096]) == 100
    assert position_limit(100, [10]) == 1


@pytest.mark.parametrize("mode", ["mtp k=3", "dflash"])
def test_a_shorter_head_or_drafter_profile_caps_the_context(tiny_engine, tiny_prompts, mode):
    # the head's and drafter's caches hold at most 100 positions, the target's 160: the usable
    # context is 100 - 17, so a request that runs to the limit never overflows a cache
    short = {"tokens": (1, 2, 5), "context": (1, 2, 3), "block": (1, 8, 8), "past": (1, 64, 100)}
    e = standin_engine(tiny_engine, mtp_profile=short, draft_profile=short)
    assert e.target.config.max_position_embeddings == 100 - 17
    prompt = tiny_prompts[0][:20]
    gen = EngineGenerator(e, SpeculativeConfig.from_flags(**MODES[mode]))
    ids = gen.decoder().generate(prompt, SamplingParams(temperature=0.0, max_tokens=500)).token_ids
    assert len(ids) == 100 - 17 - len(prompt)  # the whole budget the capped context leaves
    part = e.mtp if mode.startswith("mtp") else e.drafters["dflash"]
    assert max(c["past_key"][3] for _, c in part.runner.calls) == 100  # grew to the max size


def test_propose_graph_keys_cover_a_gamma_below_the_block():
    assert propose_graph_key(3, 4, 8, 8) == ("propose", 3, 4, 8)
    assert propose_graph_key(3, 2, 4, 8) == ("propose", 3, 2, 4)  # --dflash-gamma 4
    assert propose_graph_key(3, 5, 4, 8) is None  # more context than a step brings: the prompt's
    assert propose_graph_key(3, 3, 1, 8) is None  # a one-slot flush block
    assert propose_graph_key(3, 2, 9, 8) is None  # beyond the profile's block


def test_dflash_gamma_below_the_block_replays_graphs(standins, tiny_prompts):
    runner = standins.drafters["dflash"].runner
    runner.calls.clear()
    flags = {**MODES["dflash"], "dflash_gamma": 4}
    decode(standins, tiny_prompts[:1], flags)
    proposes = [(k, c) for k, c in runner.calls if c["block_embeds"][1] == 4]
    assert proposes and all(k == ("propose", k[1], c["context_features"][1], 4)
                            for k, c in proposes[1:])  # every step after the first is graphed


def test_closing_an_engine_releases_runners_before_the_plugins_they_use():
    from types import SimpleNamespace

    from metrale.runtime.backends.tensorrt import close_trt_engine

    order = []
    part = lambda name: SimpleNamespace(runner=SimpleNamespace(close=lambda: order.append(name)))  # noqa: E731
    target = part("target")
    target.keep_alive = (SimpleNamespace(close=lambda: order.append("plugins")), object())
    engine = SimpleNamespace(target=target, mtp=part("mtp"), drafters={"dflash": part("dflash")})
    close_trt_engine(engine)
    assert order == ["target", "mtp", "dflash", "plugins"]
