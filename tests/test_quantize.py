"""builder.quantize: stored bytes are ModelOpt's, errors stay within each format's bound, tiers
quantize exactly their sets, refusals fire before any work, shards keep the one-rank bytes."""

import contextlib
import functools
import io
import warnings

import pytest
import torch
from torch import nn

from metrale.builder import quantize as q
from metrale.builder.quantize import DraftWeightQuantization as Tier
from metrale.plugins.formats import dequantize_fp8, dequantize_nvfp4
from metrale.runtime.errors import ConfigError, QuantizationError
from metrale.runtime.models.qlinear import linear_from_tensors

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import modelopt.torch.export.unified_export_hf as modelopt_export
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

SHAPES = [(8, 64), (16, 128), (5, 48)]


def weight(shape, seed, zero_row=1):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    w[zero_row] = 0  # an all-zero row: FP8 scale 1.0, NVFP4 block scales 1.0, bytes 0
    return w


def modelopt_export_linear(w, cfg):
    """What ModelOpt's HF export writes for one Linear holding w (the oracle for the bytes)."""
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    model = nn.Sequential(linear)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg)
        modelopt_export._export_quantized_weight(model[0], w.dtype)
    return model[0]


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_bytes_are_modelopt_export(shape):
    w = weight(shape, seed=shape[0])
    out = q.quantize_fp8(w)
    assert out["weight"].dtype == torch.float8_e4m3fn and out["weight"].shape == shape
    assert out["weight_scale"].dtype == torch.float32 and out["weight_scale"].shape == (shape[0],)
    exported = modelopt_export_linear(w, q._FP8_PER_ROW_CFG)
    assert torch.equal(as_bytes(out["weight"]), as_bytes(exported.weight))
    assert torch.equal(out["weight_scale"], exported.weight_scale.reshape(-1))
    # From the definition: scale = row amax / 448 (zero row: 1.0), weight = fp8(w / scale).
    amax = w.float().abs().amax(dim=1)
    expected_scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    assert torch.equal(out["weight_scale"], expected_scale)
    expected_weight = (w.float() / expected_scale[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(as_bytes(out["weight"]), as_bytes(expected_weight))
    assert not out["weight"][1].float().any()


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_error_within_e4m3_half_step(shape):
    w = weight(shape, seed=10 + shape[0]).float()
    out = q.quantize_fp8(w)
    scale = out["weight_scale"][:, None]
    err = (dequantize_fp8(out["weight"], out["weight_scale"]) - w).abs()
    # E4M3 has 3 mantissa bits: for |v| = |w|/scale in [2^e, 2^(e+1)), e >= -6, the grid step is
    # 2^(e-3) <= |v| * 2^-3, so round-to-nearest is off by at most |v| * 2^-4; below 2^-6 the
    # subnormal step is 2^-9 (half: 2^-10). |v| <= 448 by the choice of scale, so no clamping.
    bound = scale * torch.maximum(w.abs() / scale * 2.0**-4, torch.tensor(2.0**-10))
    assert torch.all(err <= bound * (1 + 1e-6) + 1e-12)
    assert err.max() > 0  # the check is not vacuous


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_nvfp4_bytes_are_modelopt_export(shape):
    w = weight(shape, seed=20 + shape[0])
    out = q.quantize_nvfp4(w)
    assert out["weight"].dtype == torch.uint8 and out["weight"].shape == (shape[0], shape[1] // 2)
    assert out["weight_scale"].dtype == torch.float8_e4m3fn
    assert out["weight_scale"].shape == (shape[0], shape[1] // 16)
    assert out["weight_scale_2"].dtype == torch.float32 and out["weight_scale_2"].shape == ()
    exported = modelopt_export_linear(w, mtq.W4A16_NVFP4_CFG)
    assert torch.equal(out["weight"], exported.weight)
    assert torch.equal(as_bytes(out["weight_scale"]), as_bytes(exported.weight_scale))
    assert torch.equal(out["weight_scale_2"], exported.weight_scale_2)
    # The global scale is exactly amax / (6 * 448).
    assert torch.equal(out["weight_scale_2"], w.float().abs().max() / (6 * 448))
    assert not out["weight"][1].any() and torch.all(out["weight_scale"][1].float() == 1.0)
    # The reference dequantize gives ModelOpt's own dequantize, bit for bit.
    packed = NVFP4QTensor(w.shape, torch.float32, out["weight"])
    theirs = packed.dequantize(scale=out["weight_scale"], double_scale=out["weight_scale_2"],
                               block_sizes={-1: 16}, dtype=torch.float32)  # fmt: skip
    ours = dequantize_nvfp4(out["weight"], out["weight_scale"], out["weight_scale_2"])
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_error_within_e2m1_half_step(shape):
    w = weight(shape, seed=30 + shape[0]).float()
    out = q.quantize_nvfp4(w)
    g = out["weight_scale_2"]
    blocks = w.view(shape[0], -1, 16)  # [out, in/16, 16]
    block_amax = blocks.abs().amax(-1)  # [out, in/16]
    stored = out["weight_scale"].float()  # FP8 block scales
    ideal = block_amax / (6 * g)  # the block scale before its FP8 rounding
    nonzero = block_amax > 0
    # Precondition of the bound: nonzero block scales are FP8 normals (>= 2^-6), where E4M3's
    # 3 mantissa bits round to within 2^-4 relative; zero blocks store 1.0.
    assert torch.all(ideal[nonzero] >= 2.0**-6)
    assert torch.all((stored - ideal)[nonzero].abs() <= ideal[nonzero] * 2.0**-4)
    assert torch.all(stored[~nonzero] == 1.0)
    # With S = stored * g in [a/6 * 15/16, a/6 * 17/16], v = w / S lies in [-6.4, 6.4]. E2M1's
    # grid {0, .5, 1, 1.5, 2, 3, 4, 6} has half-steps 0.25 up to 2, 0.5 up to 4, 1 up to 6; past
    # 6 the clamp errs by at most 0.4 < 1. So |error| <= S * halfstep(|v|) <= S <= 17/16 * a/6.
    s = (stored * g).unsqueeze(-1)  # [out, in/16, 1]
    v = blocks.abs() / s
    half_step = torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))
    err = (dequantize_nvfp4(out["weight"], out["weight_scale"], g).view_as(blocks) - blocks).abs()
    assert torch.all(err <= s * half_step * (1 + 1e-6))
    assert torch.all(err.amax(-1) <= block_amax / 6 * 17 / 16 * (1 + 1e-6))
    assert err.max() > 0


def test_nvfp4_row_shards_with_the_whole_global_scale_keep_the_bytes():
    w = weight((8, 64), seed=40, zero_row=7)
    w[4:] *= 0.25  # the halves' amax differ, so their own global scales would differ
    whole = q.quantize_nvfp4(w)
    g = q.nvfp4_global_scale(w)
    halves = [q.quantize_nvfp4(w[:4], global_scale=g), q.quantize_nvfp4(w[4:], global_scale=g)]
    for key in ("weight", "weight_scale"):
        joined = torch.cat([as_bytes(h[key]) for h in halves])
        assert torch.equal(joined, as_bytes(whole[key]))
    assert all(torch.equal(h["weight_scale_2"], whole["weight_scale_2"]) for h in halves)
    # Each half with its own global scale: the half without the maximum changes its bytes.
    own = q.quantize_nvfp4(w[4:])
    assert not torch.equal(own["weight_scale_2"], whole["weight_scale_2"])
    assert not torch.equal(as_bytes(own["weight_scale"]), as_bytes(whole["weight_scale"][4:]))


def test_nvfp4_all_zero_tensor_and_bad_inputs():
    out = q.quantize_nvfp4(torch.zeros(4, 32))
    assert not out["weight"].any() and torch.all(out["weight_scale"].float() == 1.0)
    assert out["weight_scale_2"].item() == pytest.approx(1 / 448)  # ModelOpt's zero-amax substitute
    assert not dequantize_nvfp4(out["weight"], out["weight_scale"], out["weight_scale_2"]).any()
    with pytest.raises(QuantizationError, match="multiple of 16, got 40"):
        q.quantize_nvfp4(torch.randn(4, 40))
    with pytest.raises(QuantizationError, match="positive and finite"):
        q.quantize_nvfp4(torch.randn(4, 32), global_scale=torch.tensor(0.0))
    with pytest.raises(QuantizationError, match="NaN or infinite"):
        q.quantize_fp8(torch.tensor([[1.0, float("nan")]]))


H, I, V = 128, 128, 128  # hidden, intermediate, draft vocabulary (in >= 100 keeps FP8 <= 0.52x)


def dflash2_state(layers=2, seed=0):
    """A DFlash2-shaped drafter state dict in engine names (float32, as a tiny checkpoint)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "lm_head.weight": (V, H), "context_kv_proj.weight": (layers * 2 * 64, H),
              "candidate_selector.predecessor_codebook": (16, H),
              "candidate_selector.successor_codebook": (16, H),
              "candidate_selector.hidden_projection.weight": (H, H)}  # fmt: skip
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (H, H), p + "self_attn.k_proj.weight": (64, H),
                   p + "self_attn.v_proj.weight": (64, H), p + "self_attn.o_proj.weight": (H, H),
                   p + "self_attn.q_norm.weight": (32,), p + "self_attn.k_norm.weight": (32,),
                   p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                   p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                   p + "post_attention_layernorm.weight": (H,),
                   p + "attention_conv.base_kernel": (H, 2), p + "mlp_conv.base_kernel": (H, 2),
                   p + "attention_conv.kernel_projection.weight": (16, H),
                   p + "mlp_conv.kernel_projection.weight": (16, H)}  # fmt: skip
    return {name: torch.randn(shape, generator=gen) * 0.05 for name, shape in shapes.items()}


def expected_modules(tier, layers=2):
    if tier == "declared":
        return set()
    core = {f"layers.{i}.{m}" for i in range(layers) for m in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} | {"lm_head"}  # fmt: skip
    if tier == "fp8":
        return core
    convs = {f"layers.{i}.{c}.kernel_projection"
             for i in range(layers) for c in ("attention_conv", "mlp_conv")}  # fmt: skip
    return core | convs | {"fc", "context_kv_proj", "candidate_selector.hidden_projection"}


@functools.cache
def drafted(tier):
    """(input state, a copy taken before, quantized state, section), once per tier."""
    state = dflash2_state()
    before = {k: v.clone() for k, v in state.items()}
    return (state, before, *q.quantize_drafter(state, tier))


@pytest.mark.parametrize("tier", ["declared", "fp8", "fp8-aux", "nvfp4"])
def test_drafter_tier_quantizes_exactly_its_set(tier):
    state, before, out, section = drafted(tier)
    expected = expected_modules(tier)
    assert {k.removesuffix(".weight_scale") for k in out if k.endswith(".weight_scale")} == expected
    assert q.draft_tier_modules(state, tier) == sorted(expected)
    fmt = {"declared": None, "fp8": "fp8", "fp8-aux": "fp8", "nvfp4": "nvfp4"}[tier]
    for m in expected:
        assert out[f"{m}.weight"].dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.uint8)
        assert (f"{m}.weight_scale_2" in out) == (fmt == "nvfp4")
        assert linear_from_tensors(m, out).kind == fmt
    # Everything else (norms, base kernels, codebooks, untiered linears) is the BF16 original.
    for name, t in state.items():
        if name.removesuffix(".weight") not in expected:
            assert torch.equal(out[name], t.to(torch.bfloat16))
            assert out[name].dtype == torch.bfloat16
    assert all(torch.equal(state[k], before[k]) for k in state)  # the input is untouched
    quant = section["quantization"]
    assert section["producer"]["name"] == "modelopt"
    assert quant["quant_algo"] == {None: None, "fp8": "FP8", "nvfp4": "NVFP4"}[fmt]
    assert quant["quantized_modules"] == sorted(expected)
    assert quant.get("group_size") == (16 if fmt == "nvfp4" else None)
    assert quant["per_channel"] == (fmt == "fp8")
    assert ("lm_head" in quant["exclude_modules"]) == (fmt is None)
    assert "hidden_norm" not in quant["exclude_modules"]  # norms are not linears


def test_byte_ratios_of_the_quantized_tensors():
    state = {k: v.to(torch.bfloat16) for k, v in dflash2_state().items()}
    modules = expected_modules("nvfp4")
    bf16 = sum(state[f"{m}.weight"].nbytes for m in modules)
    ratios = {}
    for tier in ("fp8-aux", "nvfp4"):
        out = drafted(tier)[2]
        quantized = {k: v for k, v in out.items() if k.rsplit(".", 1)[0] in modules}
        ratios[tier] = q.weight_bytes(quantized) / bf16
    # NVFP4: 0.5 byte + 1/16 byte of scale per weight against 2 bytes: 0.28125 (+ 4 B per tensor).
    assert ratios["nvfp4"] <= 0.30
    # FP8: 1 byte per weight + 4 B per row against 2 bytes: 0.5 + 2 / in_features.
    assert ratios["fp8-aux"] <= 0.52
    assert q.memory_estimate({Tier.DECLARED: state}) == {"declared": q.weight_bytes(state)}


def test_byte_estimates_match_the_quantized_states():
    for tier in q.DRAFT_TIERS:
        state, _, out, _ = drafted(tier)
        assert q.estimate_bytes(state, tier) == q.weight_bytes(out)
    state = mtp_state("moe")
    out, _ = q.quantize_mtp(state, experts_nvfp4=True, mtp_quantization="bf16", ffn_kind="moe")
    assert q.estimate_mtp_bytes(state) == q.weight_bytes(out)


def test_weight_bytes_hand_example():
    state = {"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(4),
             "c": torch.zeros(5, dtype=torch.uint8)}  # fmt: skip
    assert q.weight_bytes(state) == 12 + 16 + 5


def test_tier_parse():
    assert [Tier.parse(s) for s in ("declared", "fp8", "fp8-aux", "nvfp4")] == list(Tier)
    message = '^expected one of declared, fp8, fp8-aux, nvfp4, got "x"$'
    with pytest.raises(ConfigError, match=message):
        Tier.parse("x")
    with pytest.raises(ConfigError):
        q.quantize_drafter(dflash2_state(layers=1), "FP8")


def mtp_state(ffn_kind, experts=2, expert_dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, 2 * H), "norm.weight": (H,), "layer.input_layernorm.weight": (H,),
              "layer.self_attn.q_proj.weight": (H, H), "layer.self_attn.k_proj.weight": (64, H),
              "layer.self_attn.v_proj.weight": (64, H),
              "layer.self_attn.o_proj.weight": (H, H)}  # fmt: skip
    projs = {"gate_proj": (64, H), "up_proj": (64, H), "down_proj": (H, 64)}
    if ffn_kind == "dense":
        shapes |= {f"layer.mlp.{p}.weight": s for p, s in projs.items()}
    else:
        shapes |= {"layer.mlp.gate.weight": (experts, H),
                   "layer.mlp.shared_expert_gate.weight": (1, H)}  # fmt: skip
        for e in [f"experts.{i}" for i in range(experts)] + ["shared_expert"]:
            shapes |= {f"layer.mlp.{e}.{p}.weight": s for p, s in projs.items()}
    state = {name: torch.randn(shape, generator=gen) * 0.05 for name, shape in shapes.items()}
    for name in state:
        if ".experts." in name:
            state[name] = state[name].to(expert_dtype)
    return state


def modules_with_scale(out):
    return {k.removesuffix(".weight_scale") for k in out if k.endswith(".weight_scale")}


def test_mtp_experts_nvfp4_quantizes_routed_and_shared_experts_only():
    state = mtp_state("moe")
    out, section = q.quantize_mtp(
        state, experts_nvfp4=True, mtp_quantization="bf16", ffn_kind="moe"
    )
    experts = {f"layer.mlp.{e}.{p}" for e in ("experts.0", "experts.1", "shared_expert")
               for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    assert modules_with_scale(out) == experts
    assert all(out[f"{m}.weight"].dtype == torch.uint8 for m in experts)
    kept = ("layer.mlp.gate.weight", "layer.mlp.shared_expert_gate.weight", "fc.weight",
            "layer.self_attn.q_proj.weight")  # fmt: skip
    for keep in kept:
        assert torch.equal(out[keep], state[keep].to(torch.bfloat16))
    assert section["quantization"]["quant_algo"] == "NVFP4"
    assert "layer.mlp.gate" in section["quantization"]["exclude_modules"]


def test_mtp_fp8_quantizes_attention_fc_and_ffn_but_not_the_router():
    for ffn_kind in ("moe", "dense"):
        state = mtp_state(ffn_kind)
        out, section = q.quantize_mtp(
            state, experts_nvfp4=False, mtp_quantization="fp8", ffn_kind=ffn_kind
        )
        linears = {k.removesuffix(".weight") for k, v in state.items() if v.dim() == 2}
        routers = {"layer.mlp.gate", "layer.mlp.shared_expert_gate"} if ffn_kind == "moe" else set()
        assert modules_with_scale(out) == linears - routers
        assert section["quantization"]["quant_algo"] == "FP8"
    out, section = q.quantize_mtp(
        state, experts_nvfp4=False, mtp_quantization="bf16", ffn_kind="dense"
    )
    assert not modules_with_scale(out) and section["quantization"]["quant_algo"] is None


@pytest.mark.parametrize(
    "state_kind, expert_dtype, mtp_quantization, reason",
    [
        ("dense", torch.bfloat16, "bf16", "needs a MoE MTP head; this head's FFN is dense"),
        ("moe", torch.float8_e4m3fn, "bf16",
         r"experts are stored as FP8 \(layer.mlp.experts.0.down_proj"),
        ("moe", torch.bfloat16, "fp8", 'needs --mtp-quantization bf16, got "fp8"'),
    ],
)
def test_mtp_refusals_fire_before_any_work(
    monkeypatch, state_kind, expert_dtype, mtp_quantization, reason
):
    def no_work(*args, **kwargs):
        raise AssertionError("converted tensors before refusing")

    monkeypatch.setattr(q, "_quantize_modules", no_work)
    state = mtp_state(state_kind, expert_dtype=expert_dtype)
    with pytest.raises(QuantizationError, match=reason):
        q.quantize_mtp(
            state, experts_nvfp4=True, mtp_quantization=mtp_quantization, ffn_kind=state_kind
        )


def test_mtp_unknown_values_are_config_errors():
    message = '--mtp-quantization: expected one of bf16, fp8, got "int4"'
    with pytest.raises(ConfigError, match=message):
        q.quantize_mtp(
            mtp_state("dense"), experts_nvfp4=False, mtp_quantization="int4", ffn_kind="dense"
        )


def test_every_tier_names_its_format():
    from metrale.builder.quantize import DraftWeightQuantization as T

    assert {t: t.format for t in T} == {T.DECLARED: None, T.FP8: "fp8", T.FP8_AUX: "fp8",
                                        T.NVFP4: "nvfp4"}
