"""The CPU kernel of a step's projections (`plugins.cpu_linear`) and the panels its tiles read
(`cpu_panels.pack_panels`): against its math in torch ops, row by row bit-identical whatever
the other rows of the call, and what the tiny engine's packages call in place of inductor's
GEMM for their projections."""

from __future__ import annotations

import ctypes
import json
import zipfile

import pytest
import torch

from conftest import NEEDS_CPU_KERNELS
from metrale.plugins import cpu_linear
from metrale.plugins.cpu_panels import PANEL, pack_panels, unpack_panels

P = ctypes.c_void_p


@pytest.fixture(scope="module")
def kernel(cpu_kernels_lib):
    """The kernel over ctypes on x [N, K] and B [K, C], handed to it in panels: float32 weights,
    or bfloat16 ones (its bfloat16 entry)."""
    lib = cpu_kernels_lib

    def run(x, b):
        (n, k), c = x.shape, b.shape[1]
        out = torch.full((n, c), float("nan"))
        fn = lib.metrale_linear_rows_bf16 if b.dtype == torch.bfloat16 else lib.metrale_linear_rows
        panels = pack_panels(b)
        fn(P(x.data_ptr()), P(panels.data_ptr()), P(out.data_ptr()), *(ctypes.c_int64(v) for v in (n, k, c)))
        return out
    return run


def test_panels_hold_every_group_of_columns_with_its_rows_in_order():
    b = torch.arange(3 * 48, dtype=torch.float32).reshape(3, 48)  # K = 3, C = 48
    p = pack_panels(b)
    assert p.shape == (3, 3, PANEL)
    for k in range(3):
        for c in range(48):
            assert p.reshape(-1)[((c // PANEL) * 3 + k) * PANEL + c % PANEL] == b[k, c]
    assert torch.equal(unpack_panels(p), b)
    batched = torch.randn(2, 5, 32)
    assert torch.equal(unpack_panels(pack_panels(batched)), batched)
    with pytest.raises(ValueError, match="whole panels of 16"):
        pack_panels(torch.randn(4, 40))


@NEEDS_CPU_KERNELS
@pytest.mark.parametrize("n,k,c", [(1, 128, 2048), (7, 128, 2048), (33, 128, 2048), (5, 64, 48), (13, 16, 16),
                                   (6, 40, 272)])
def test_the_kernel_computes_the_ops_math(kernel, n, k, c):
    g = torch.Generator().manual_seed(n + c)
    x, b = torch.randn(n, k, generator=g), torch.randn(k, c, generator=g) * 0.1
    ref = x.double() @ b.double()
    # float32 sums of up to 128 products against float64: a few units in the 6th digit
    torch.testing.assert_close(kernel(x, b).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_linear.linear_math(x, pack_panels(b)), x @ b, rtol=0, atol=0)


@NEEDS_CPU_KERNELS
@pytest.mark.parametrize("c", [2048, 80, 16])
def test_a_rows_bits_do_not_depend_on_the_other_rows(kernel, c):
    """Every row count (every tile shape the rows fall into) gives a row the bits it gets alone."""
    g = torch.Generator().manual_seed(c)
    x, b = torch.randn(40, 128, generator=g), torch.randn(128, c, generator=g) * 0.1
    alone = torch.cat([kernel(x[r:r + 1].contiguous(), b) for r in range(40)])
    for n in (1, 2, 3, 5, 6, 7, 12, 13, 40):
        assert torch.equal(kernel(x[:n].contiguous(), b), alone[:n])
    perm = torch.randperm(40, generator=g)
    assert torch.equal(kernel(x[perm].contiguous(), b), alone[perm])


@NEEDS_CPU_KERNELS
@pytest.mark.parametrize("c", [2048, 80])
def test_bfloat16_weights_give_the_float32_kernels_bits(kernel, c):
    """Every row count (every tile shape, up to eight rows with AVX-512 and six with AVX2, and
    their tails): the float32 kernel's bits on the widened weights, and a row's bits are those
    it gets alone."""
    g = torch.Generator().manual_seed(3)
    x, b = torch.randn(40, 128, generator=g), (torch.randn(128, c, generator=g) * 0.1).to(torch.bfloat16)
    alone = torch.cat([kernel(x[r:r + 1].contiguous(), b) for r in range(40)])
    for n in (2, 5, 7, 9, 12, 14, 15, 33, 40):
        narrow = kernel(x[:n].contiguous(), b)
        assert torch.equal(narrow, kernel(x[:n].contiguous(), b.float()))
        assert torch.equal(narrow, alone[:n])
    torch.testing.assert_close(alone, cpu_linear.linear_math(x, pack_panels(b)), rtol=1e-5, atol=1e-5)


def test_weights_are_held_narrow_only_when_that_is_exact():
    lin = torch.nn.Linear(32, 64, bias=False)
    assert cpu_linear.held(lin.weight).dtype == torch.float32  # values off bfloat16's grid
    with torch.no_grad():
        lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
    held = cpu_linear.held(lin.weight)
    assert held.dtype == torch.bfloat16 and torch.equal(unpack_panels(held).float(), lin.weight.t())
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(cpu_linear.KernelLinear.of(lin)(x), lin(x), rtol=1e-6, atol=1e-6)  # eagerly, the math
    with pytest.raises(ValueError, match="without a bias"):
        cpu_linear.KernelLinear.of(torch.nn.Linear(32, 64))
    assert cpu_linear.fits(128, 2048) and not cpu_linear.fits(128, 2040)


@NEEDS_CPU_KERNELS
def test_a_router_padded_to_a_panel_keeps_its_columns(kernel):
    """A MoE router's 8 columns held with 8 columns of zeros: eagerly its math, and in the kernel
    each of its columns has the bits it has among the padded ones (every row count)."""
    router = torch.nn.Linear(128, 8, bias=False)
    with torch.no_grad():
        router.weight.copy_(router.weight.to(torch.bfloat16).float())
    padded = cpu_linear.KernelLinear.of(router, pad=True)
    assert padded.panels.shape == (1, 128, 16) and padded.panels.dtype == torch.bfloat16
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(padded(x), router(x), rtol=1e-6, atol=1e-6)
    b = unpack_panels(padded.panels)  # [128, 16], the last 8 columns zeros
    assert not b[:, 8:].any()
    alone = torch.cat([kernel(x[r:r + 1].contiguous(), b)[:, :8] for r in range(9)])
    assert torch.equal(kernel(x, b)[:, :8], alone)
    torch.testing.assert_close(alone, router(x), rtol=1e-5, atol=1e-5)


def _calls(package) -> int:
    with zipfile.ZipFile(package) as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    return wrapper.count("aoti_torch_cpu_linear_rows(") - 1  # less its declaration


@NEEDS_CPU_KERNELS
def test_the_tiny_packages_project_through_the_kernel(aoti_engine_dir):
    """The target's LM head and each of its 4 layers' fused q/k/v and output projections and
    router; the MTP head's input projection, its layer's two, its router, its shared expert's
    fused gate/up and down projections and its LM head; each drafter's context projection,
    stacked context K/V, each of its 2 layers' fused q/k/v, output, fused gate/up and down
    projections and its LM head, and DFlash2's too each layer's two conv kernels' projections
    and its selector's query. The drafters' manifest entries say so, and their packages
    proposed the eager drafters' drafts, for sequences together as alone."""
    assert _calls(aoti_engine_dir / "target" / "cpu" / "steps.pt2") == 1 + 3 * 4
    assert _calls(aoti_engine_dir / "mtp" / "cpu" / "steps.pt2") == 7
    assert _calls(aoti_engine_dir / "dflash" / "cpu" / "propose.pt2") == 2 + 4 * 2 + 1
    for package in ("propose.pt2", "propose_tree.pt2"):  # (the tree's: its selector's query once)
        assert _calls(aoti_engine_dir / "dflash2" / "cpu" / package) == 2 + 6 * 2 + 1 + 1
    manifest = json.loads((aoti_engine_dir / "config.json").read_text())["components"]
    for name in ("dflash", "dflash2"):
        cpu = manifest[name]["cpu"]
        assert cpu["linear"] == "kernel"
        assert cpu["check"] == {"drafts_equal": 1.0, "batched_equal_alone": 1.0,
                                **({"tables_trees_equal": 1.0} if name == "dflash2" else {})}


@NEEDS_CPU_KERNELS
def test_a_dense_mlp_through_the_kernel_is_its_math():
    """`MLP.use_linear_kernel`: its fused gate/up projection through the kernel's op (eagerly,
    its math) gives the plain MLP's output."""
    from metrale.runtime.models.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(64, 96)
    with pytest.raises(ValueError, match="pack"):
        mlp.use_linear_kernel()
    mlp.pack()
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        want = mlp(x)
        mlp.use_linear_kernel()
        assert isinstance(mlp.gate_up_kernel, cpu_linear.KernelLinear)
        torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)
