"""Triton kernels of metrale.plugins run in the CPU interpreter against the PyTorch references,
plus the references of the MoE and dynamic-conv ops against the runtime modules.

Triton fixes interpreter mode when it is first imported, so this module sets TRITON_INTERPRET=1
(and TRITON_DEFAULT_FP_FUSION=0) at import, before anything imports triton; pytest imports every
test module before running any test, and no other test module imports triton in this process
(`test_aot` compiles in a subprocess). Kernel tests skip when triton is not installed.
"""

import importlib.util
import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

from metrale.plugins import dynamic_conv, fp8_gemm, nvfp4_gemm, nvfp4_moe  # noqa: E402
from metrale.plugins.formats import E2M1_VALUES, dequantize_nvfp4  # noqa: E402
from metrale.runtime.models.configs import DecoderConfig  # noqa: E402
from metrale.runtime.models.dflash import DynamicConv  # noqa: E402
from metrale.runtime.models.layers import MoE  # noqa: E402


@pytest.fixture
def interpreter():
    from metrale.plugins.triton_mode import triton_interprets

    if not triton_interprets():
        pytest.fail("triton was imported before this module could set TRITON_INTERPRET=1")


def needs_triton(test):
    """Skip without triton; run in the interpreter with it."""
    test = pytest.mark.usefixtures("interpreter")(test)
    return pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                              reason="triton is not installed (pip install triton==3.9.0)")(test)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def nvfp4(shape, g, scale_hi=400.0):
    """Random NVFP4 weight [..., n, k]: (packed, block scales, a codes tensor)."""
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    bs = (torch.rand(*shape[:-1], shape[-1] // 16, generator=g) * scale_hi + 0.01)
    return packed, bs.to(torch.float8_e4m3fn), codes


def close(actual, expected, dtype):
    """Float32 kernels agree to rounding; bf16 outputs to one bf16 ulp."""
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2 ** -7, 1e-3)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


# -- FP8 and NVFP4 GEMMs ----------------------------------------------------------------------

@needs_triton
def test_fp8_kernel_decodes_every_e4m3_code_exactly():
    # x = identity, so y = W^T * scale: the kernel's bit-level E4M3 decode against torch's cast.
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # drop the two NaN codes -> 254 values
    w = codes.view(torch.float8_e4m3fn).reshape(2, 127)  # [N=2, K=127]
    x = torch.eye(127)
    y = fp8_gemm.fp8_w8a16_gemm_triton(x, w, torch.tensor([1.0, 0.5]))  # [127, 2]
    assert torch.equal(y.T, w.float() * torch.tensor([[1.0], [0.5]]))


@needs_triton
def test_nvfp4_kernel_decodes_every_e2m1_code_exactly():
    codes = torch.tensor([list(range(16)) * 2, list(range(15, -1, -1)) * 2], dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [2, 16]
    bs = torch.tensor([[2.0, 0.5], [448.0, 0.001953125]]).to(torch.float8_e4m3fn)
    gs = torch.tensor(0.25)  # a power of two: the kernel's product order is then exact too
    y = nvfp4_gemm.nvfp4_w4a16_gemm_triton(torch.eye(32), packed, bs, gs)  # [32, 2]
    assert torch.equal(y.T, dequantize_nvfp4(packed, bs, gs))
    assert y[:16, 0].tolist() == [v * 0.5 for v in E2M1_VALUES]  # block 0 of row 0: 2 * 0.25


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 70, 80), (17, 64, 64), (5, 130, 144)])
def test_fp8_kernel_matches_reference(m, n, k, dtype):
    g = gen(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=g).to(dtype)
    y = fp8_gemm.fp8_w8a16_gemm_triton(x, w, scale)
    assert y.shape == (m, n) and y.dtype == dtype
    close(y, fp8_gemm.fp8_w8a16_gemm(x, w, scale), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,n,k", [((1,), 70, 96), ((17,), 65, 144), ((2, 3), 64, 64)])
def test_nvfp4_kernel_matches_reference(shape, n, k, dtype):
    g = gen(n + k)
    packed, bs, _ = nvfp4((n, k), g)
    gs = torch.tensor(3e-4)
    x = torch.randn(*shape, k, generator=g).to(dtype)
    y = nvfp4_gemm.nvfp4_w4a16_gemm_triton(x, packed, bs, gs)
    assert y.shape == (*shape, n)
    close(y, nvfp4_gemm.nvfp4_w4a16_gemm(x, packed, bs, gs), dtype)


@needs_triton
def test_nvfp4_kernel_refuses_ragged_block_scale():
    packed = torch.zeros(4, 16, dtype=torch.uint8)  # K = 32 -> 2 blocks per row
    with pytest.raises(ValueError, match="block_scale"):
        nvfp4_gemm.nvfp4_w4a16_gemm_triton(torch.ones(1, 32), packed,
                                           torch.ones(4, 3).to(torch.float8_e4m3fn),
                                           torch.tensor(1.0))


# -- grouped NVFP4 MoE ------------------------------------------------------------------------

def moe_weights(e, h, i, g):
    gu_p, gu_s, _ = nvfp4((e, 2 * i, h), g, scale_hi=50.0)
    dn_p, dn_s, _ = nvfp4((e, h, i), g, scale_hi=50.0)
    return (gu_p, gu_s, torch.rand(e, 2, generator=g) * 2e-3 + 1e-4,  # gate's, up's
            dn_p, dn_s, torch.rand(e, generator=g) * 2e-3 + 1e-4)


def test_moe_reference_is_the_routed_part_of_layers_moe():
    e, h, i, t = 4, 32, 16, 6
    g = gen(7)
    weights = moe_weights(e, h, i, g)
    cfg = DecoderConfig(vocab_size=8, hidden_size=h, num_hidden_layers=1, num_attention_heads=1,
                        num_key_value_heads=1, head_dim=8, intermediate_size=8, rms_norm_eps=1e-6,
                        rope_theta=1e4, max_position_embeddings=16, num_experts=e,
                        num_experts_per_tok=2, moe_intermediate_size=i, norm_topk_prob=True)
    moe = MoE(cfg)  # no shared expert: its forward is the routed part alone
    with torch.no_grad():
        moe.gate.weight.normal_(generator=g)
        for x_idx, mlp in enumerate(moe.experts):
            gu = [dequantize_nvfp4(weights[0][x_idx, rows], weights[1][x_idx, rows],
                                   weights[2][x_idx, half])
                  for half, rows in enumerate((slice(0, i), slice(i, 2 * i)))]
            mlp.gate_proj.weight.copy_(gu[0])  # gate rows first, then up rows
            mlp.up_proj.weight.copy_(gu[1])
            mlp.down_proj.weight.copy_(dequantize_nvfp4(weights[3][x_idx], weights[4][x_idx],
                                                        weights[5][x_idx]))
        x = torch.randn(t, h, generator=g)
        route_w, ids = moe.route(x)
        expected = moe(x)
    y = nvfp4_moe.nvfp4_moe_w4a16(x, ids, route_w, *weights)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    assert expected.abs().max() > 0.1


def test_moe_reference_refuses_out_of_range_expert():
    weights = moe_weights(2, 16, 16, gen(0))
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 2\)"):
        nvfp4_moe.nvfp4_moe_w4a16(torch.ones(1, 16), torch.tensor([[2]]), torch.ones(1, 1),
                                  *weights)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,h,i,t,k", [(4, 48, 32, 5, 2), (3, 80, 48, 2, 3)])
def test_moe_kernels_match_reference(e, h, i, t, k, dtype):
    g = gen(e * h + i)
    weights = moe_weights(e, h, i, g)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.randint(0, e, (t, k), generator=g)
    ids[0, :] = 0  # a token routed twice to one expert still sums both slots
    w = torch.rand(t, k, generator=g).to(dtype)
    y = nvfp4_moe.nvfp4_moe_w4a16_triton(x, ids, w, *weights)
    close(y, nvfp4_moe.nvfp4_moe_w4a16(x, ids, w, *weights), dtype)


# -- DFlash2 dynamic conv ---------------------------------------------------------------------

def test_conv_reference_equals_dflash_dynamic_conv():
    b, t, h, groups, block = 2, 8, 12, 3, 4
    g = gen(11)
    conv = DynamicConv(h, groups)
    with torch.no_grad():
        conv.base_kernel.normal_(generator=g)
        conv.kernel_projection.weight.normal_(generator=g)
        x = torch.randn(b, t, h, generator=g)
        kernel = conv.base_kernel + conv.kernel_projection(x).view(b, t, groups, 2)
        xg = x.view(b, t // block, block, groups, h // groups)
        prev = torch.nn.functional.pad(xg, (0, 0, 0, 0, 1, 0))[:, :, :-1]  # x[t-1], 0 at slot 0
        k = kernel.view(b, t // block, block, groups, 2, 1)
        expected = (k[..., 0, :] * xg + k[..., 1, :] * prev).reshape(b, t, h)
    # the module runs the op; both are the two-tap formula, bit for bit in float32
    assert torch.equal(dynamic_conv.dflash2_dynamic_conv(x, kernel, block), expected)
    assert torch.equal(conv(x, block), expected)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,t,h,groups,block", [(2, 8, 40, 4, 4), (1, 6, 300, 3, 3),
                                                (1, 5, 16, 16, 5)])
def test_conv_kernel_is_bit_identical_to_reference(b, t, h, groups, block, dtype):
    g = gen(h + t)
    x = torch.randn(b, t, h, generator=g).to(dtype)
    kernel = torch.randn(b, t, groups, 2, generator=g).to(dtype)
    y = dynamic_conv.dflash2_dynamic_conv_triton(x, kernel, block)
    expected = dynamic_conv.dflash2_dynamic_conv(x, kernel, block)
    assert y.dtype == dtype and torch.equal(y, expected)


def test_conv_refuses_block_not_dividing_slots():
    with pytest.raises(ValueError, match="block must be >= 1 and divide the 6 slots"):
        dynamic_conv.dflash2_dynamic_conv(torch.ones(1, 6, 4), torch.ones(1, 6, 2, 2), 4)


def test_conv_op_gradients_are_those_of_its_math():
    # the drafters train through the op: its backward is the math's, x and kernel alike
    b, t, h, groups, block = 2, 8, 12, 3, 4
    g = gen(5)
    x = torch.randn(b, t, h, generator=g, requires_grad=True)
    kernel = torch.randn(b, t, groups, 2, generator=g, requires_grad=True)
    upstream = torch.randn(b, t, h, generator=g)

    def explicit(x, kernel):  # slot by slot: the second tap only inside a block
        xg = x.view(b, t, groups, h // groups)
        out = []
        for s in range(t):
            y = kernel[:, s, :, 0, None] * xg[:, s]
            if s % block:
                y = y + kernel[:, s, :, 1, None] * xg[:, s - 1]
            out.append(y.reshape(b, h))
        return torch.stack(out, 1)

    grads = []
    for fn in (lambda x, k: dynamic_conv.dflash2_dynamic_conv(x, k, block), explicit):
        y = fn(x, kernel)
        grads.append(torch.autograd.grad((y * upstream).sum(), (x, kernel)))
    for ours, want in zip(*grads):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.metrale.dflash2_dynamic_conv.default, (x, kernel, block))


def test_conv_op_decomposes_to_its_math_for_inductor():
    # the CPU packages compile the op's arithmetic (no call back into Python): exported, the
    # graph holds the op; after `inductor_decompositions`, plain aten ops computing the same bits
    class Step(torch.nn.Module):
        def forward(self, x, kernel):
            return dynamic_conv.dflash2_dynamic_conv(x, kernel, 4) * 2

    g = gen(3)
    x, kernel = torch.randn(2, 8, 6, generator=g), torch.randn(2, 8, 3, 2, generator=g)
    ep = torch.export.export(Step(), (x, kernel))
    op = torch.ops.metrale.dflash2_dynamic_conv.default
    assert op in [n.target for n in ep.graph.nodes]
    lowered = ep.run_decompositions(dynamic_conv.inductor_decompositions())
    targets = [n.target for n in lowered.graph.nodes if n.op == "call_function"]
    assert op not in targets and torch.ops.aten.mul.Tensor in targets
    assert torch.equal(lowered.module()(x, kernel), Step()(x, kernel))


# -- the decode step's kernels (step_kernels) --------------------------------------------------


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


@needs_triton
def test_decoding_with_the_step_kernels_is_plain_decoding(step_kernels_on_cpu, tiny_engine_dir):
    """The eager models on the kernels (the interpreter standing in for a GPU): DFlash2's
    drafts, the conv and every q/k of the target and the drafter take them, and greedy
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
    params = SamplingParams(temperature=0.0, max_tokens=12)
    counts = {"select": 0, "qk": 0, "conv": 0}
    real = (step_kernels_on_cpu.dflash2_select, step_kernels_on_cpu.qk_norm_rope,
            conv_op.dflash2_dynamic_conv_triton)

    def counted(key, fn):
        return lambda *a: counts.__setitem__(key, counts[key] + 1) or fn(*a)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(step_kernels_on_cpu, "dflash2_select", counted("select", real[0]))
        m.setattr(step_kernels_on_cpu, "qk_norm_rope", counted("qk", real[1]))
        m.setattr(conv_op, "dflash2_dynamic_conv_triton", counted("conv", real[2]))
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
            taps = target(ids, cache, taps=(0, 1, 3)).taps
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
        for name in ("dflash2_select", "qk_norm_rope"):
            m.setattr(step_kernels, name, one_launch(getattr(step_kernels, name)))
        step_kernels.on_cpu_for_tests()
        try:
            on = step_launches()
        finally:
            step_kernels.on_cpu_for_tests(False)
    layers = engine.target.config.num_hidden_layers
    assert on["target"] < off["target"] - 5 * layers, (off, on)  # q/k: about nine ops a layer, one launch
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
