"""Reference ops and format helpers of metrale.plugins, checked against hand-worked values and
an independent dequantize (E2M1 decoded from its bits, FP8 from torch's own cast)."""

import pytest
import torch

from metrale.plugins import fp8_gemm, nvfp4_gemm
from metrale.plugins.formats import (
    E2M1_VALUES,
    dequantize_fp8,
    dequantize_nvfp4,
    e2m1_table,
    unpack_fp4,
)


def e2m1_from_bits(code: int) -> float:
    """E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return sign * mag


def test_e2m1_table_matches_bit_decoding():
    assert [e2m1_from_bits(c) for c in range(16)] == list(E2M1_VALUES)
    assert e2m1_table().tolist() == list(E2M1_VALUES)
    # Code 8 is negative zero, not a second +0.
    assert torch.signbit(e2m1_table()[8])


def test_unpack_fp4_low_nibble_first():
    packed = torch.tensor([[0x21, 0xF7], [0x00, 0x9A]], dtype=torch.uint8)
    # 0x21 -> element 0 = 1 (low), element 1 = 2 (high); 0xF7 -> 7, 15; 0x9A -> 10, 9.
    assert unpack_fp4(packed).tolist() == [[1, 2, 7, 15], [0, 0, 10, 9]]


def test_dequantize_fp8_hand_example():
    weight = torch.tensor([[1.0, -2.0], [0.5, 448.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.5, 2.0])
    assert dequantize_fp8(weight, scale).tolist() == [[0.5, -1.0], [1.0, 896.0]]


def test_dequantize_nvfp4_hand_example():
    # One row of 32 inputs = two blocks. Codes 0..15 in block 0 and code 7 (6.0) in block 1.
    codes = torch.tensor([list(range(16)) + [7] * 16], dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # uint8 [1, 16]
    block_scale = torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn)  # exact in E4M3
    global_scale = torch.tensor(0.25)
    w = dequantize_nvfp4(packed, block_scale, global_scale)
    # Block 0: value * 2.0 * 0.25 = value / 2; block 1: 6.0 * 0.5 * 0.25 = 0.75.
    assert w[0, :16].tolist() == [v / 2 for v in E2M1_VALUES]
    assert w[0, 16:].tolist() == [0.75] * 16


def test_dequantize_nvfp4_rejects_bad_scale_shape():
    packed = torch.zeros(2, 16, dtype=torch.uint8)  # 32 inputs -> 2 blocks per row
    with pytest.raises(ValueError, match=r"weight_scale must be \[2, in/16\]"):
        dequantize_nvfp4(packed, torch.ones(2, 3).to(torch.float8_e4m3fn), torch.tensor(1.0))


def random_fp8(out_f: int, in_f: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weight = (torch.randn(out_f, in_f, generator=gen) * 100).clamp(-448, 448)
    weight = weight.to(torch.float8_e4m3fn)
    scale = torch.rand(out_f, generator=gen) * 0.01 + 1e-3
    return weight, scale


def random_nvfp4(out_f: int, in_f: int, gen: torch.Generator):
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    block_scale = torch.rand(out_f, in_f // 16, generator=gen) * 400 + 0.01
    block_scale = block_scale.to(torch.float8_e4m3fn)
    global_scale = torch.tensor(3e-4)
    # Independent dequantize: decode each code from its bits, scale per 16-element block.
    values = torch.tensor([[e2m1_from_bits(int(c)) for c in row] for row in codes])
    scale = (block_scale.float() * global_scale).repeat_interleave(16, dim=1)
    return (packed, block_scale, global_scale), values * scale


@pytest.mark.parametrize("x_shape", [(5, 64), (2, 3, 128), (0, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_equals_matmul_of_dequantized(x_shape, dtype):
    gen = torch.Generator().manual_seed(1)
    weight, scale = random_fp8(24, x_shape[-1], gen)
    x = torch.randn(x_shape, generator=gen).to(dtype)
    y = torch.ops.metrale.fp8_w8a16_gemm(x, weight, scale)
    w_ref = weight.to(torch.float64) * scale.to(torch.float64)[:, None]  # [24, in]
    y_ref = x.to(torch.float64) @ w_ref.T
    assert y.dtype == dtype and y.shape == (*x_shape[:-1], 24)
    # float32 accumulation: ~1e-6 relative to the sum of magnitudes; bf16 output: 2^-8.
    tol = 1e-5 if dtype == torch.float32 else 2.0**-8
    scale_ref = x.abs().to(torch.float64) @ w_ref.abs().T
    assert torch.all((y.to(torch.float64) - y_ref).abs() <= tol * scale_ref + 1e-9)


@pytest.mark.parametrize("x_shape", [(5, 64), (2, 3, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_gemm_equals_matmul_of_dequantized(x_shape, dtype):
    gen = torch.Generator().manual_seed(2)
    args, w_ref = random_nvfp4(24, x_shape[-1], gen)
    x = torch.randn(x_shape, generator=gen).to(dtype)
    y = torch.ops.metrale.nvfp4_w4a16_gemm(x, *args)
    assert torch.equal(dequantize_nvfp4(*args), w_ref)  # the dequantize itself is exact
    y_ref = x.to(torch.float64) @ w_ref.to(torch.float64).T
    tol = 1e-5 if dtype == torch.float32 else 2.0**-8
    scale_ref = x.abs().to(torch.float64) @ w_ref.abs().to(torch.float64).T
    assert y.dtype == dtype and y.shape == (*x_shape[:-1], 24)
    assert torch.all((y.to(torch.float64) - y_ref).abs() <= tol * scale_ref + 1e-9)


def test_ops_fake_kernels_give_shape_and_dtype():
    # Meta tensors dispatch to the registered fake kernels: shape propagation without data.
    x = torch.empty(3, 7, 64, dtype=torch.bfloat16, device="meta")
    y = torch.ops.metrale.fp8_w8a16_gemm(
        x,
        torch.empty(24, 64, dtype=torch.float8_e4m3fn, device="meta"),
        torch.empty(24, device="meta"),
    )
    assert y.shape == (3, 7, 24) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    y = torch.ops.metrale.nvfp4_w4a16_gemm(
        x,
        torch.empty(24, 32, dtype=torch.uint8, device="meta"),
        torch.empty(24, 4, dtype=torch.float8_e4m3fn, device="meta"),
        torch.empty((), device="meta"),
    )
    assert y.shape == (3, 7, 24) and y.dtype == torch.bfloat16


def test_opcheck_schema_and_fake():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=gen)
    # test_schema compares inputs with an op float8 lacks on CPU; the fake check is the one
    # that matters for export (shapes and dtypes without data).
    checks = ("test_faketensor",)
    torch.library.opcheck(fp8_gemm.fp8_w8a16_gemm, (x, *random_fp8(8, 32, gen)), test_utils=checks)
    nv_args, _ = random_nvfp4(8, 32, gen)
    torch.library.opcheck(nvfp4_gemm.nvfp4_w4a16_gemm, (x, *nv_args), test_utils=checks)


def test_ops_reject_mismatched_inputs():
    gen = torch.Generator().manual_seed(4)
    with pytest.raises(ValueError, match="x has 48 input features"):
        torch.ops.metrale.fp8_w8a16_gemm(torch.randn(2, 48), *random_fp8(8, 32, gen))
    nv_args, _ = random_nvfp4(8, 32, gen)
    with pytest.raises(ValueError, match="x has 16 input features"):
        torch.ops.metrale.nvfp4_w4a16_gemm(torch.randn(2, 16), *nv_args)
