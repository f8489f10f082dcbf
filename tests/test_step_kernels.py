"""The decode step's Triton kernels (`plugins.step_kernels`) in the CPU interpreter against the
model forms they replace (the selector, q/k norm with rotary), the models taking them, the
check an engine's load runs (`backends.step_check`) and its switch.

Triton's interpreter mode is set by `test_kernels` when imported (before anything imports
triton); this module imports its helpers, so it is set here too.
"""

import pytest
import torch
from test_kernels import gen, interpreter, needs_triton  # noqa: F401 - `interpreter`: the fixture needs_triton uses


@pytest.fixture
def step_kernels_on_cpu():
    """The models' fused paths taken on CPU tensors (the kernels in the interpreter)."""
    from metrale.plugins import step_kernels

    step_kernels.on_cpu_for_tests()
    try:
        yield step_kernels
    finally:
        step_kernels.on_cpu_for_tests(False)


def random_selector(hidden: int, vocab: int, dim: int, k: int, seed: int):
    from metrale.runtime.models.dflash import CandidateSelector

    sel = CandidateSelector(hidden, vocab, dim, k)
    g = gen(seed)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return sel


@needs_triton
@pytest.mark.parametrize("b,n,k,d", [(1, 7, 16, 32), (3, 5, 10, 24), (2, 15, 16, 8)])
def test_select_kernel_drafts_the_selectors_tokens(b, n, k, d):
    from metrale.plugins import step_kernels

    sel = random_selector(48, 300, d, k, seed=b * 100 + n)
    g = gen(n + k)
    hidden = torch.randn(b, n, 48, generator=g)
    cand_logits, cand_ids = (3 * torch.randn(b, n, 300, generator=g)).topk(k, dim=-1)
    anchor = torch.randint(0, 300, (b,), generator=g)
    with torch.no_grad():
        want = sel.select_candidates(hidden, cand_logits, cand_ids, anchor)
        got = step_kernels.dflash2_select(sel.hidden_projection(hidden), cand_logits, cand_ids, anchor,
                                          sel.predecessor_codebook, sel.successor_codebook)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    # each slot's pick follows the one before it: a different anchor changes the drafts
    other = step_kernels.dflash2_select(sel.hidden_projection(hidden), cand_logits, cand_ids, anchor + 1,
                                        sel.predecessor_codebook, sel.successor_codebook)
    with torch.no_grad():
        assert torch.equal(other, sel.select_candidates(hidden, cand_logits, cand_ids, anchor + 1))


def qwen3_attention(dtype, zero_centred: bool, seed: int, nh: int = 4, nkv: int = 2, hd: int = 32):
    from metrale.runtime.models.configs import DecoderConfig
    from metrale.runtime.models.layers import Attention

    cfg = DecoderConfig(vocab_size=16, hidden_size=64, num_hidden_layers=1, num_attention_heads=nh,
                        num_key_value_heads=nkv, head_dim=hd, intermediate_size=64, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=64)
    attn = Attention(cfg, zero_centred_norm=zero_centred)
    g = gen(seed)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.5) + (p.dim() == 1))
    return attn.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("zero_centred", [False, True])
def test_qk_norm_rope_kernel_is_project_qkv(step_kernels_on_cpu, dtype, packed, zero_centred):
    from metrale.runtime.models.rotary import rope_cos_sin

    attn = qwen3_attention(dtype, zero_centred, seed=int(packed) + 2 * int(zero_centred))
    attn.pack()
    if not packed:  # two projections (quantized ones keep their own ops): q and k from each
        attn.qkv_weight = None
    x = torch.randn(2, 5, 64, generator=gen(9)).to(dtype)
    cos, sin = rope_cos_sin(torch.tensor([3, 4, 5, 9, 9]), 32, 10000.0, dtype)  # (a tree's rows)
    calls = []
    real = step_kernels_on_cpu.qk_norm_rope
    with pytest.MonkeyPatch.context() as m, torch.no_grad():
        m.setattr(step_kernels_on_cpu, "qk_norm_rope", lambda *a: calls.append(1) or real(*a))
        q, k, v = attn.project_qkv(x, cos, sin)
        m.setattr(step_kernels_on_cpu, "_state", {"on": False, "cpu": False})
        want = attn.project_qkv(x, cos, sin)
    assert calls == [1]
    assert (q.shape, k.shape, v.shape) == tuple(t.shape for t in want) and q.dtype == dtype
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2 ** -5, 2 ** -5)  # the eager form rounds per op
    torch.testing.assert_close(q, want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(k, want[1], rtol=rtol, atol=atol)
    assert torch.equal(v, want[2])


def random_moe(dtype, norm: bool, shared: int, seed: int, hidden: int = 40, inter: int = 48):
    from metrale.runtime.models.configs import DecoderConfig
    from metrale.runtime.models.layers import MoE

    cfg = DecoderConfig(vocab_size=16, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, intermediate_size=64, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=64, num_experts=6, num_experts_per_tok=3,
                        moe_intermediate_size=inter, norm_topk_prob=norm, shared_expert_intermediate_size=shared)
    moe = MoE(cfg)
    g = gen(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    moe = moe.to(dtype)
    moe.pack()
    moe.row_invariant = True  # what the graphs capture: the dense experts' fixed ops
    return moe


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm,shared", [(True, 0), (False, 24)])
def test_moe_kernels_are_the_routed_experts(step_kernels_on_cpu, dtype, norm, shared):
    """The router and routed experts in three launches (`step_kernels.moe_experts`) give the
    dense PyTorch form's output (rounding where it rounds: float32 exactly up to the sums'
    order, bfloat16 within its rounding), a row's output whatever rows run beside it, with
    tiles that do not divide the sizes (H 40, I 48, 6 experts, top 3)."""
    moe = random_moe(dtype, norm, shared, seed=int(norm) + shared)
    x = torch.randn(3, 5, 40, generator=gen(11)).to(dtype)
    calls = []
    real = step_kernels_on_cpu.moe_experts
    with pytest.MonkeyPatch.context() as m, torch.no_grad():
        m.setattr(step_kernels_on_cpu, "moe_experts", lambda *a: calls.append(1) or real(*a))
        got = moe(x)
        m.setattr(step_kernels_on_cpu, "_state", {"on": False, "cpu": False})
        want = moe(x)
    assert calls == [1] and got.dtype == dtype and got.shape == want.shape
    with torch.no_grad():  # the routed part's rows (the shared expert is the GEMM library's)
        rows = x.reshape(-1, 40)
        args = (moe.gate.weight, moe.experts_gate_up, moe.experts_down, 3, norm)
        assert torch.equal(real(rows, *args)[7], real(rows[7:8], *args)[0])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bfloat16: at most a unit in the last place of the output's rounding apart, mostly none
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=2 ** -8)
        assert ((got.float() - want.float()).abs() <= ulp).all()
        assert (got == want).float().mean() > 0.9


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["own", "block", "tree"])
def test_lane_attention_kernel_is_lane_kv(step_kernels_on_cpu, dtype, kind):
    """`LaneKV.attend` in one launch (`step_kernels.lane_attention`) gives the PyTorch form's
    rows (float32 to 1e-5; bfloat16 within its rounding, mostly equal): two lanes of a three-lane
    pool, 3 rows each over the first 40 of 72 slots (neither a multiple of the kernel's 64),
    rows that see up to their own slot, a drafter block's rows that see the whole block, and a
    tree's rows that see what `hidden` leaves them."""
    from metrale.runtime.models.step_caches import LaneKV

    g = gen(5)
    b, r, nkv, grp, hd, s = 2, 3, 2, 2, 16, 40
    k_pool = torch.randn(3, nkv, hd, 72, generator=g).to(dtype)
    v_pool = torch.randn(3, nkv, 72, hd, generator=g).to(dtype)
    kv = [k_pool[1:, :, :, :s], v_pool[1:, :, :s]]
    pos = (torch.randint(0, s - r, (b, 1), generator=g) + torch.arange(r)).reshape(-1)
    seq = torch.arange(b).repeat_interleave(r)
    last = pos.view(b, r)[:, -1:].expand(b, r).reshape(-1) if kind == "block" else None
    hidden = None
    if kind == "tree":
        hidden = torch.rand(b, 1, r, s, generator=g) < 0.5
        hidden[0, 0, torch.arange(r), pos[:r]] = False  # each row sees its own slot
        hidden[1, 0, torch.arange(r), pos[r:]] = False
    q = torch.randn(1, nkv * grp, b * r, hd, generator=g).to(dtype)
    calls = []
    real = step_kernels_on_cpu.lane_attention
    with pytest.MonkeyPatch.context() as m, torch.no_grad():
        m.setattr(step_kernels_on_cpu, "lane_attention", lambda *a: calls.append(1) or real(*a))
        got = LaneKV(kv, seq, pos, last, hidden=hidden).attend(0, q)
        m.setattr(step_kernels_on_cpu, "_state", {"on": False, "cpu": False})
        want = LaneKV(kv, seq, pos, last, hidden=hidden).attend(0, q)
    assert calls == [1] and got.shape == want.shape == (1, b * r, nkv * grp * hd) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)
        assert (got == want).float().mean() > 0.9


@needs_triton
def test_lane_attention_leaves_a_prompts_rows_to_the_pytorch_form(step_kernels_on_cpu, monkeypatch):
    """More query rows than a program holds (a prompt's, `LANE_MAX_ROWS`) take the PyTorch form."""
    from metrale.runtime.models.step_caches import LaneKV

    calls = []
    monkeypatch.setattr(step_kernels_on_cpu, "lane_attention", lambda *a: calls.append(a))
    rows = step_kernels_on_cpu.LANE_MAX_ROWS // 2 + 1  # two query heads per key/value head
    kv = [torch.randn(1, 1, 16, 2 * rows), torch.randn(1, 1, 2 * rows, 16)]
    with torch.no_grad():
        out = LaneKV(kv, torch.zeros(rows, dtype=torch.long), torch.arange(rows)).attend(0, torch.randn(1, 2, rows, 16))
    assert not calls and out.shape == (1, rows, 32)


@needs_triton
def test_step_kernels_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    from metrale.plugins import step_kernels
    from metrale.runtime.backends.step_check import agree, prepare

    for dtype in (torch.float32, torch.bfloat16):  # the check, here in the interpreter
        assert agree(torch.device("cpu"), dtype) == ""
    assert prepare(torch.device("cpu"), torch.float32) == "the fused step kernels run on CUDA devices only"
    assert "interpreter mode" in prepare(torch.device("cuda"), torch.float32)
    assert not step_kernels.use(torch.zeros(1))
    wrong = lambda p, cl, ids, *a: ids[..., 1]  # noqa: E731 - the runner-up, not the selector's pick
    monkeypatch.setattr(step_kernels, "dflash2_select", wrong)
    assert agree(torch.device("cpu"), torch.float32).startswith("dflash2_select drafted")
    monkeypatch.undo()
    real = step_kernels.moe_experts
    unrouted = lambda x, w, gu, dn, k, norm: real(x, w, gu, dn, k, not norm)  # noqa: E731 - weights not renormalised
    monkeypatch.setattr(step_kernels, "moe_experts", unrouted)
    assert agree(torch.device("cpu"), torch.float32).startswith("moe_experts is")
    monkeypatch.undo()
    unmasked = lambda q, k, v, last, hid, r: real_lane(q, k, v, last + 1, hid, r)  # noqa: E731 - one slot too many
    real_lane = step_kernels.lane_attention
    monkeypatch.setattr(step_kernels, "lane_attention", unmasked)
    assert agree(torch.device("cpu"), torch.float32).startswith("lane_attention is")
    untree = lambda q, k, v, last, hid, r: real_lane(q, k, v, last, None, r)  # noqa: E731 - no tree mask
    monkeypatch.setattr(step_kernels, "lane_attention", untree)
    assert agree(torch.device("cpu"), torch.float32).startswith("lane_attention (a tree's rows) is")


@needs_triton
def test_decoding_with_the_step_kernels_is_plain_decoding(step_kernels_on_cpu, tiny_engine_dir):
    """The eager models on the kernels (the interpreter standing in for a GPU): DFlash2's
    drafts, the conv, every q/k of the target and the drafter and the target's MoE layers take
    them, and greedy
    speculative decoding still emits plain decoding's tokens."""
    from metrale.plugins import dynamic_conv as conv_op
    from metrale.runtime.backends import load_engine
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig
    from metrale.runtime.spec.sampling import SamplingParams

    engine = load_engine(tiny_engine_dir, backend="torch")
    plain = EngineGenerator(engine, SpeculativeConfig())
    spec = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash2"))
    prompt = engine.tokenizer.encode("The river ran")
    params = SamplingParams(temperature=0.0, max_tokens=7)  # (the interpreter: a verify takes seconds)
    counts = {"select": 0, "qk": 0, "conv": 0, "moe": 0}
    real = (step_kernels_on_cpu.dflash2_select, step_kernels_on_cpu.qk_norm_rope,
            conv_op.dflash2_dynamic_conv_triton, step_kernels_on_cpu.moe_experts)

    def counted(key, fn):
        return lambda *a: counts.__setitem__(key, counts[key] + 1) or fn(*a)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(step_kernels_on_cpu, "dflash2_select", counted("select", real[0]))
        m.setattr(step_kernels_on_cpu, "qk_norm_rope", counted("qk", real[1]))
        m.setattr(conv_op, "dflash2_dynamic_conv_triton", counted("conv", real[2]))
        m.setattr(step_kernels_on_cpu, "moe_experts", counted("moe", real[3]))
        got = spec.generate(prompt, params)
    want = plain.generate(prompt, params)  # (the kernels still on: plain's rows take them too)
    step_kernels_on_cpu.on_cpu_for_tests(False)
    eager, eager_spec = plain.generate(prompt, params), spec.generate(prompt, params)
    assert got.token_ids == want.token_ids == eager.token_ids
    # the kernels' drafts are the PyTorch forms' (float32 here): the same accepted, step by step
    assert [s.accepted for s in got.steps] == [s.accepted for s in eager_spec.steps]
    steps = sum(1 for s in got.steps if s.drafted)
    assert steps > 0 and counts["select"] == steps
    assert counts["conv"] >= 4 * steps  # two convs per drafter layer, two layers
    assert counts["qk"] > 4 * steps  # every target layer's verify, and the drafter's
    assert counts["moe"] >= 4 * steps  # every target layer's MoE at every verify


def test_the_step_kernels_switch_is_checked(monkeypatch):
    from metrale.plugins import step_kernels
    from metrale.runtime.backends.step_check import prepare
    from metrale.runtime.errors import ConfigError
    from metrale.runtime.models.rotary import rope_cos_sin

    step_kernels.on_cpu_for_tests()
    try:
        with torch.no_grad():
            assert step_kernels.use(torch.zeros(1))
        with torch.enable_grad():  # the kernels have no backward: autograd takes the PyTorch forms
            assert not step_kernels.use(torch.zeros(1))
        attn = qwen3_attention(torch.float32, False, seed=4, nh=2, nkv=1, hd=24)
        attn.pack()
        calls = []
        monkeypatch.setattr(step_kernels, "qk_norm_rope", lambda *a: calls.append(a))
        with torch.no_grad():  # a head size the kernel does not take: the PyTorch form
            q, k, _ = attn.project_qkv(torch.randn(1, 3, 64), *rope_cos_sin(torch.arange(3), 24, 1e4, torch.float32))
        assert not calls and q.shape == (1, 2, 3, 24) and k.shape == (1, 1, 3, 24)
    finally:
        step_kernels.on_cpu_for_tests(False)
    monkeypatch.setenv("METRALE_STEP_KERNELS", "0")
    assert prepare(torch.device("cuda"), torch.float32) == "fused step kernels off (METRALE_STEP_KERNELS=0)"
    monkeypatch.setenv("METRALE_STEP_KERNELS", "yes")
    with pytest.raises(ConfigError, match=r"METRALE_STEP_KERNELS='yes': expected 1 .* or 0"):
        prepare(torch.device("cuda"), torch.float32)
    assert not step_kernels.use(torch.zeros(1))


@needs_triton
def test_the_step_kernels_cut_the_ops_a_step_dispatches(tiny_engine_dir):
    """What the kernels are for: a step's launches. Counted here as the aten ops the eager
    models dispatch plus one per kernel launch (the interpreter's own work not counted): a
    target step and each drafter's propose (DFlash2's selector the most) take fewer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from metrale.plugins import step_kernels
    from metrale.runtime.backends import load_engine

    engine = load_engine(tiny_engine_dir, backend="torch").pack()
    inside = [0]

    class Launches(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Launches.count += inside[0] == 0
            return func(*args, **(kwargs or {}))

    def one_launch(fn):
        def run(*args):
            inside[0] += 1
            try:
                return fn(*args)
            finally:
                inside[0] -= 1
                Launches.count += 1
        return run

    def step_launches() -> dict[str, int]:
        target, embed = engine.target, engine.target.model.embed_tokens
        ids = torch.arange(40, 80)[None]
        out = {}
        with torch.no_grad():
            cache = target.new_cache(1, 128)
            on, step_kernels._state["on"] = step_kernels._state["on"], False  # the context: not counted
            taps = target(ids, cache, taps=(0, 1, 3)).taps
            step_kernels._state["on"] = on
            for name, run in [("target", lambda: target(ids[:, :9], cache, taps=(0, 1, 3)))] + [
                    (n, lambda d=d: d.propose(torch.tensor([5]), embed, dc, 8))
                    for n, d in engine.drafters.items()]:
                if name != "target":
                    dc = engine.drafters[name].new_cache(1, 128, torch.float32)
                    engine.drafters[name].add_context(taps[:, :30], dc)
                Launches.count = 0
                with Launches():
                    run()
                out[name] = Launches.count
        return out

    off = step_launches()
    with pytest.MonkeyPatch.context() as m:
        for name in ("dflash2_select", "qk_norm_rope", "moe_experts"):
            m.setattr(step_kernels, name, one_launch(getattr(step_kernels, name)))
        step_kernels.on_cpu_for_tests()
        try:
            on = step_launches()
        finally:
            step_kernels.on_cpu_for_tests(False)
    layers = engine.target.config.num_hidden_layers
    # q/k: about nine ops a layer, one launch; the router and the experts: about ten, one launch
    assert on["target"] < off["target"] - 15 * layers, (off, on)
    assert on["dflash"] < off["dflash"] and on["dflash2"] < off["dflash2"] - 7 * 10, (off, on)


@needs_triton
def test_qk_norm_rope_takes_any_layout_of_its_rows():
    """Rows of a fused projection's slice, of a batch's transposed view, or of one row: the
    kernel's q and k are those of contiguous copies."""
    from metrale.plugins import step_kernels
    from metrale.runtime.models.rotary import rope_cos_sin

    attn = qwen3_attention(torch.float32, False, seed=6)
    attn.pack()
    w, cos, sin = attn.qk_norm_weight, *rope_cos_sin(torch.arange(4), 32, 1e4, torch.float32)
    qkv = torch.randn(4, 3, 256, generator=gen(2)).transpose(0, 1)  # [3, 4, 256], batch not outermost
    want = step_kernels.qk_norm_rope(qkv.contiguous(), qkv.contiguous()[..., 128:], w, cos, sin, 1e-6, 4, 2, 32)
    got = step_kernels.qk_norm_rope(qkv, qkv[..., 128:], w, cos, sin, 1e-6, 4, 2, 32)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    one = qkv[:1, :1]  # one row: its size-1 dims' strides say nothing
    got = step_kernels.qk_norm_rope(one, one[..., 128:], w, cos[:1], sin[:1], 1e-6, 4, 2, 32)
    want = step_kernels.qk_norm_rope(one.contiguous(), one.contiguous()[..., 128:], w, cos[:1], sin[:1], 1e-6, 4, 2, 32)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
