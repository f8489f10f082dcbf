"""The eager inference forms of `layers` against their textbook forms (float32, CPU): the
few-kernel RMSNorm and rotary embedding, and the MoE step that reads only the selected experts."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from metrale.plugins.cpu_panels import unpack_panels
from metrale.runtime.models.configs import DecoderConfig
from metrale.runtime.models.layers import MoE, RMSNorm, apply_rope, rms_normalize
from metrale.runtime.models.rotary import rope_cos_sin, rope_table

CFG = DecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape,scale", [((1, 1, 128), 1.0), ((8, 3, 64), 100.0), ((5, 32), 1e-3)])
def test_rms_normalize_is_rms_norm(shape, scale):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * scale
    want = F.rms_norm(x, (shape[-1],), None, 1e-6)
    torch.testing.assert_close(rms_normalize(x, 1e-6), want, rtol=2e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("zero_centred", [False, True])
def test_the_eager_norm_agrees_with_the_traced_one(zero_centred):
    norm = RMSNorm(32, 1e-6, zero_centred)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)
    x = torch.randn(4, 32)
    traced = torch.jit.trace(norm, x)  # the TorchScript tracer takes the textbook formula
    assert any(n.kind() == "aten::rsqrt" for n in traced.graph.nodes())
    torch.testing.assert_close(norm(x), traced(x), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_norm_is_the_same_norm(zero_centred, dtype):
    """On a GPU the norm is one fused `F.rms_norm` of x with the (zero-centred: 1 + w) weight:
    here, the same function on the CPU agrees with the module's own arithmetic (bfloat16: the
    one rounding the fused kernel skips, before the weight's product, at most an ulp apart)."""
    norm = RMSNorm(64, 1e-6, zero_centred).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)
    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    weight = 1.0 + norm.weight if zero_centred else norm.weight
    fused = F.rms_norm(x, (64,), weight.to(dtype), 1e-6)
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(fused, norm(x), **tol)
    assert fused.dtype == dtype


def test_rope_by_roll_is_rotate_half():
    x = torch.randn(2, 6, 5, 16)
    cos, sin = rope_cos_sin(torch.arange(3, 8), 16, 10000.0, torch.float32)
    half = 8
    want = x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    torch.testing.assert_close(apply_rope(x, cos, sin), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gpu_step_gathers_its_rotary_rows_bit_for_bit(dtype, monkeypatch):
    """What a GPU step gathers from its step table (`rope_at` over `rope_tables`, taken here on
    CPU tensors) is what it would compute, at any positions, a tree's included."""
    from metrale.runtime.models import rotary
    from metrale.runtime.models.rotary import rope_at, rope_tables

    positions = torch.tensor([0, 7, 99, 149, 3, 3])
    want = rope_cos_sin(positions, 32, 1e6, dtype)
    monkeypatch.setattr(rotary, "gathers_rope", lambda p: True)
    calls = []
    monkeypatch.setattr(rotary, "rope_cos_sin", lambda *a: calls.append(a) or rope_cos_sin(*a))
    assert all(torch.equal(a, b) for a, b in zip(rope_at(positions, 32, 1e6, dtype), want))
    assert len(calls) == 1  # no step table for this head size yet: computed
    rope_tables([SimpleNamespace(head_dim=32, rope_theta=1e6, max_position_embeddings=100)], dtype,
                "cpu", margin=50)
    assert rope_table(32, 1e6, dtype, "cpu")[0].shape[0] == 150
    calls.clear()
    got = rope_at(positions, 32, 1e6, dtype)
    assert not calls and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # past the table (a sequence past the context it was built for): its last row
    assert torch.equal(rope_at(torch.tensor([400]), 32, 1e6, dtype)[0], want[0][3:4])


def _moe(seed=0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(CFG).eval()
    moe.pack()
    return moe


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_selected_experts_equal_the_dense_experts(rows):
    moe = _moe()
    x = torch.randn(rows, CFG.hidden_size)
    with torch.inference_mode():
        weights, ids = moe.route(x)
        got = moe._selected_experts(x, weights, ids)
        want = moe._dense_experts(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_one_row_step_reads_only_the_selected_experts():
    """Poison every expert the row did not select: the step's output stays exactly as it was."""
    moe = _moe()
    x = torch.randn(1, 1, CFG.hidden_size)
    with torch.inference_mode():
        before = moe(x)
        _, ids = moe.route(x.view(1, -1))
        unused = sorted(set(range(CFG.num_experts)) - set(ids[0].tolist()))
        inter = CFG.moe_intermediate_size
        for e in unused:
            moe.experts_gate_up[2 * inter * e:2 * inter * (e + 1)] = float("nan")
            moe.experts_down[e] = float("nan")
        after = moe(x)
    assert torch.equal(before, after)


def test_the_op_count_does_not_depend_on_the_routing():
    moe = _moe()
    with torch.inference_mode():
        moe(torch.randn(1, 1, CFG.hidden_size))  # the per-expert views are made once
    counts = set()
    for seed in range(6):
        x = torch.randn(1, 1, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode(), _Ops() as ops:
            moe(x)
        counts.add(len(ops.ops))
    assert len(counts) == 1


def test_many_rows_run_the_dense_experts_and_so_does_every_row_count_where_rows_must_stay_invariant():
    """bfloat16, where the dense experts' rows do not depend on the row count (as the engine's
    row-invariant mode requires)."""
    moe = _moe().to(torch.bfloat16)
    moe.pack()
    x = torch.randn(1, 8, CFG.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode(), _Ops() as ops:
        dense = moe(x)
    assert torch.ops.aten.bmm.default in ops.ops  # 8 rows × 2 slots > 8 experts: dense
    with torch.inference_mode():
        moe.row_invariant = True
        with _Ops() as ops:
            one = moe(x[:, :1])
        assert torch.ops.aten.bmm.default in ops.ops  # one row: dense too
        alone = torch.cat([one] + [moe(x[:, i:i + 1]) for i in range(1, 8)], dim=1)
    assert torch.equal(dense, alone)  # every row as it is alone


@pytest.mark.parametrize("widened", [True, False])
def test_the_routed_kernels_experts_are_held_as_bfloat16_exactly_when_they_are_bfloat16s(widened):
    """A bfloat16 checkpoint's experts, widened to float32, go to the CPU kernel as bfloat16 (half
    the bytes, the same values); other float32 experts stay float32. Either way the op computes
    the stacked experts' math."""
    moe = _moe()
    if widened:
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        moe.pack()
    moe.use_routed_kernel()
    want = torch.bfloat16 if widened else torch.float32
    assert moe.experts_gate_up_panels.dtype == moe.experts_down_panels.dtype == want
    assert torch.equal(unpack_panels(moe.experts_down_panels).float(), moe.experts_down)
    x = torch.randn(5, CFG.hidden_size)
    with torch.inference_mode():
        weights, ids = moe.route(x)
        got = moe._kernel_experts(x, weights, ids)  # eagerly, the op's math
        torch.testing.assert_close(got, moe._dense_experts(x, weights, ids), rtol=1e-5, atol=1e-6)
