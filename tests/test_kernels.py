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
