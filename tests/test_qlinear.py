"""Dispatch of runtime.models.qlinear: the stored format picks the op, and the result is the op's."""

import pytest
import torch

from metrale.plugins.formats import dequantize_fp8, dequantize_nvfp4
from metrale.runtime.errors import CheckpointError
from metrale.runtime.models.qlinear import (
    DenseLinear,
    Fp8Linear,
    Nvfp4Linear,
    consumed_keys,
    linear_from_tensors,
    quantized_kind,
)

P = "layers.0.mlp.up_proj"


def fp8_tensors(out_f=6, in_f=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        f"{P}.weight": (torch.randn(out_f, in_f, generator=gen) * 50).to(torch.float8_e4m3fn),
        f"{P}.weight_scale": torch.rand(out_f, generator=gen) + 0.01,
    }


def nvfp4_tensors(out_f=6, in_f=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        f"{P}.weight": torch.randint(0, 256, (out_f, in_f // 2), generator=gen, dtype=torch.uint8),
        f"{P}.weight_scale": (torch.rand(out_f, in_f // 16, generator=gen) * 8).to(
            torch.float8_e4m3fn
        ),
        f"{P}.weight_scale_2": torch.tensor(0.02),
    }


def test_kind_and_module_per_format():
    dense = {f"{P}.weight": torch.randn(6, 32, dtype=torch.bfloat16)}
    cases = [(dense, "none", DenseLinear), (fp8_tensors(), "fp8", Fp8Linear),
             (nvfp4_tensors(), "nvfp4", Nvfp4Linear)]  # fmt: skip
    for tensors, kind, cls in cases:
        assert quantized_kind(tensors, P) == kind
        module = linear_from_tensors(P, tensors)
        assert type(module) is cls and module.kind == kind
        assert (module.in_features, module.out_features) == (32, 6)
    assert Fp8Linear.op is torch.ops.metrale.fp8_w8a16_gemm
    assert Nvfp4Linear.op is torch.ops.metrale.nvfp4_w4a16_gemm


def test_fp8_forward_runs_the_fp8_op(monkeypatch):
    tensors = fp8_tensors()
    module = linear_from_tensors(P, tensors)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    expected = (x.float() @ dequantize_fp8(tensors[f"{P}.weight"], tensors[f"{P}.weight_scale"]).T)
    torch.testing.assert_close(module(x), expected.to(torch.bfloat16), rtol=0, atol=0)
    calls = []
    spy = staticmethod(lambda *a: calls.append(a) or a[0].new_zeros(3, 6))
    monkeypatch.setattr(Fp8Linear, "op", spy)
    module(x)
    assert len(calls) == 1 and calls[0][1] is module.weight


def test_nvfp4_forward_runs_the_nvfp4_op(monkeypatch):
    tensors = nvfp4_tensors()
    module = linear_from_tensors(P, tensors)
    x = torch.randn(2, 5, 32)
    leaves = ("weight", "weight_scale", "weight_scale_2")
    w = dequantize_nvfp4(*(tensors[f"{P}.{leaf}"] for leaf in leaves))
    torch.testing.assert_close(module(x), x @ w.T, rtol=0, atol=0)
    calls = []
    spy = staticmethod(lambda *a: calls.append(a) or a[0].new_zeros(2, 5, 6))
    monkeypatch.setattr(Nvfp4Linear, "op", spy)
    module(x)
    assert len(calls) == 1 and calls[0][3] is module.weight_scale_2


def test_dense_forward_is_functional_linear_with_bias():
    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(6, 32, generator=gen), torch.randn(6, generator=gen)
    module = linear_from_tensors("proj", {"proj.weight": w, "proj.bias": b})
    x = torch.randn(4, 32, generator=gen)
    torch.testing.assert_close(module(x), x @ w.T + b)


def test_quantized_bias_is_added_after_the_op():
    tensors = fp8_tensors()
    tensors[f"{P}.bias"] = torch.arange(6, dtype=torch.float32)
    module = linear_from_tensors(P, tensors)
    x = torch.randn(2, 32)
    weight, scale = tensors[f"{P}.weight"], tensors[f"{P}.weight_scale"]
    no_bias = torch.ops.metrale.fp8_w8a16_gemm(x, weight, scale)
    torch.testing.assert_close(module(x), no_bias + torch.arange(6.0))
    assert consumed_keys(P, tensors) == [f"{P}.weight", f"{P}.weight_scale", f"{P}.bias"]


def test_per_tensor_fp8_scale_is_broadcast_per_row():
    tensors = fp8_tensors()
    tensors[f"{P}.weight_scale"] = torch.tensor(0.5)
    module = linear_from_tensors(P, tensors)
    assert module.weight_scale.tolist() == [0.5] * 6


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop(f"{P}.weight_scale_2"), "got layers.0.mlp.up_proj.weight: torch.uint8"),
        (lambda t: t.pop(f"{P}.weight"), "missing layers.0.mlp.up_proj.weight"),
        (lambda t: t.update({f"{P}.weight_scale": torch.ones(6, 3).to(torch.float8_e4m3fn)}),
         r"weight_scale must be float8_e4m3fn \[6, 2\]"),
    ],
)
def test_malformed_weight_sets_are_refused(edit, match):
    tensors = nvfp4_tensors()
    edit(tensors)
    with pytest.raises(CheckpointError, match=match):
        linear_from_tensors(P, tensors)


def test_plain_weight_with_scale_is_refused():
    tensors = {"a.weight": torch.randn(4, 16), "a.weight_scale": torch.ones(4)}
    with pytest.raises(CheckpointError, match="linear 'a'"):
        quantized_kind(tensors, "a")


def test_dtype_casts_keep_the_stored_format():
    # Module.to(dtype) would otherwise turn float8 weights into bf16 and round float32 scales.
    for tensors in (fp8_tensors(), nvfp4_tensors()):
        module = linear_from_tensors(P, tensors)
        x = torch.randn(2, 32)
        before = module(x)
        module.to(torch.bfloat16)
        for leaf in ("weight", "weight_scale", "weight_scale_2"):
            if f"{P}.{leaf}" in tensors:
                assert getattr(module, leaf).dtype == tensors[f"{P}.{leaf}"].dtype
        torch.testing.assert_close(module(x), before, rtol=0, atol=0)
    dense = linear_from_tensors(P, {f"{P}.weight": torch.randn(6, 32)}).to(torch.bfloat16)
    assert dense.weight.dtype == torch.bfloat16  # a plain weight follows the cast


@pytest.mark.parametrize("make", [fp8_tensors, nvfp4_tensors], ids=["fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_dequantizes_once_with_the_ops_bits(make, dtype):
    """`pack()` caches the float32 weight; results stay bit-identical to the per-call op, for
    one row and many (the decode loop's shapes), in float32 and bfloat16 activations."""
    lin = linear_from_tensors(P, make(out_f=48, in_f=64))
    xs = [torch.randn(1, 64).to(dtype), torch.randn(3, 8, 64).to(dtype)]
    before = [lin(x) for x in xs]
    lin.pack()
    assert lin.dequantized.dtype == torch.float32 and lin.dequantized.shape == (48, 64)
    assert "dequantized" not in lin.state_dict()  # the stored format is what the engine keeps
    for x, want in zip(xs, before):
        got = lin(x)
        assert got.dtype == dtype and torch.equal(got, want)
