"""The CPU kernel of a MoE layer's routed experts (`plugins.cpu_moe`): against its math in torch
ops, row by row bit-identical whatever the other rows of the call, and what the tiny engine's
target package calls in place of inductor's code for its routed experts."""

from __future__ import annotations

import ctypes
import zipfile

import pytest
import torch

from conftest import NEEDS_CPU_KERNELS
from metrale.plugins import cpu_moe
from metrale.plugins.cpu_panels import pack_panels

pytestmark = NEEDS_CPU_KERNELS
P = ctypes.c_void_p


@pytest.fixture(scope="module")
def kernel(cpu_kernels_lib):
    """The kernel over ctypes: float32 expert weights, or bfloat16 ones (its bfloat16 entry),
    given as gate_up [E, H, 2I] and down [E, I, H] and handed to it in panels."""
    lib = cpu_kernels_lib

    def run(x, ids, weights, gate_up, down):
        out = torch.full_like(x, float("nan"))
        (n, h), k, e, i = x.shape, ids.shape[1], gate_up.shape[0], down.shape[1]
        fn = lib.metrale_routed_experts_bf16 if gate_up.dtype == torch.bfloat16 else lib.metrale_routed_experts
        gate_up, down = pack_panels(gate_up), pack_panels(down)
        fn(*(P(t.data_ptr()) for t in (x, ids, weights, gate_up, down, out)),
           *(ctypes.c_int64(v) for v in (n, k, e, h, i)))
        return out
    return run


def _math(x, ids, weights, gate_up, down):
    """The op's math on gate_up [E, H, 2I] and down [E, I, H] (it takes them in panels)."""
    return cpu_moe.routed_math(x, ids, weights, pack_panels(gate_up), pack_panels(down))


def _layer(e=8, h=128, i=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, h, 2 * i, generator=g) * 0.1, torch.randn(e, i, h, generator=g) * 0.1)


def _routing(n, e, k, seed, skewed=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g)
    if skewed:  # expert 0 in every row, the last expert in none
        logits[:, 0] += 10
        logits[:, -1] -= 10
    w, ids = torch.topk(torch.softmax(logits, -1), k)
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids.contiguous()


@pytest.mark.parametrize("n,k,skewed", [(1, 2, False), (3, 2, False), (17, 2, True), (64, 2, False),
                                        (9, 1, False), (5, 4, True)])
def test_the_kernel_computes_the_ops_math(kernel, n, k, skewed):
    gate_up, down = _layer()
    x = torch.randn(n, 128, generator=torch.Generator().manual_seed(n))
    w, ids = _routing(n, 8, k, seed=n, skewed=skewed)
    ref = _math(x.double(), ids, w.double(), gate_up.double(), down.double())
    # float32 sums of 128 and 64 products against float64: a few units in the 6th digit
    torch.testing.assert_close(kernel(x, ids, w, gate_up, down).double(), ref, rtol=1e-5, atol=1e-5)


def test_the_ops_math_is_the_moe_layers(kernel):
    """routed_math is what `MoE`'s compiled path computes for the same weights (its stacked
    layout: gate/up [E·2I, H], the op's [E, H, 2I] transposed)."""
    from types import SimpleNamespace

    from metrale.runtime.models.layers import MoE

    gate_up, down = _layer(i=128)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(6))
    w, ids = _routing(6, 8, 2, seed=1)
    stacked = SimpleNamespace(experts_gate_up=gate_up.transpose(1, 2).reshape(-1, 128), experts_down=down)
    layer = MoE._gathered_experts(stacked, x, w, ids)
    torch.testing.assert_close(_math(x, ids, w, gate_up, down), layer, rtol=1e-5, atol=1e-6)


def test_a_rows_bits_do_not_depend_on_the_other_rows(kernel):
    """Alone, in a call of 40 rows, with other rows' experts and in another order: the same bits."""
    gate_up, down = _layer()
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(40))
    w, ids = _routing(40, 8, 2, seed=3, skewed=True)
    together = kernel(x, ids, w, gate_up, down)
    alone = torch.cat([kernel(x[r:r + 1], ids[r:r + 1], w[r:r + 1], gate_up, down) for r in range(40)])
    assert torch.equal(together, alone)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    shuffled = kernel(x[perm].contiguous(), ids[perm].contiguous(), w[perm].contiguous(), gate_up, down)
    assert torch.equal(shuffled, together[perm])


@pytest.mark.parametrize("h,i", [(48, 80), (16, 16), (128, 128)])
def test_every_tile_shape_gives_a_row_the_same_bits(kernel, h, i):
    """Calls of 1 to 9 rows with one, two or three slots on three experts: the experts' pair
    counts, so the tiles' shapes (one pair up to a full tile of eight with AVX-512 or six with
    AVX2, one to eight vectors, column tails where I or H is no whole number of wide tiles),
    vary from call to call; each row's bits stay those it gets alone, and match the op's math."""
    gate_up, down = _layer(e=3, h=h, i=i, seed=h + i)
    x = torch.randn(9, h, generator=torch.Generator().manual_seed(h))
    for k in (1, 2, 3):
        w, ids = _routing(9, 3, k, seed=k)
        alone = torch.cat([kernel(x[r:r + 1], ids[r:r + 1], w[r:r + 1], gate_up, down) for r in range(9)])
        ref = _math(x.double(), ids, w.double(), gate_up.double(), down.double())
        torch.testing.assert_close(alone.double(), ref, rtol=1e-5, atol=1e-5)
        for n in range(2, 10):
            assert torch.equal(kernel(x[:n], ids[:n].contiguous(), w[:n].contiguous(), gate_up, down), alone[:n])


@pytest.mark.parametrize("h,i", [(48, 80), (128, 128)])
def test_bfloat16_experts_give_the_float32_kernels_bits(kernel, h, i):
    """Expert weights held as bfloat16 are widened exactly as they are read: every row's bits
    are the float32 kernel's on the widened weights, whatever the tiles (1 to 40 rows, skewed
    routing), and the op's math agrees."""
    gate_up, down = (t.to(torch.bfloat16) for t in _layer(e=5, h=h, i=i, seed=i))
    x = torch.randn(40, h, generator=torch.Generator().manual_seed(7))
    for n, skewed in ((1, False), (3, True), (17, False), (40, True)):
        w, ids = _routing(n, 5, 2, seed=n, skewed=skewed)
        narrow = kernel(x[:n], ids, w, gate_up, down)
        assert torch.equal(narrow, kernel(x[:n], ids, w, gate_up.float(), down.float()))
        torch.testing.assert_close(narrow, _math(x[:n], ids, w, gate_up, down), rtol=1e-5, atol=1e-5)


def test_experts_are_held_narrow_only_when_that_is_exact():
    gate_up, down = _layer()
    exact = (gate_up.to(torch.bfloat16).float(), down.to(torch.bfloat16).float())
    g, d = cpu_moe.narrowed(*exact)
    assert g.dtype == d.dtype == torch.bfloat16 and torch.equal(g.float(), exact[0]) and torch.equal(d.float(), exact[1])
    for pair in ((gate_up, down), (exact[0], down), (exact[0].double(), exact[1].double())):
        assert all(a is b for a, b in zip(cpu_moe.narrowed(*pair), pair))  # a weight off bfloat16's grid, or not float32: as it is


def test_the_tiny_targets_package_calls_the_kernel(aoti_engine_dir):
    """The built target package's routed experts are the kernel's shim, one call per layer."""
    with zipfile.ZipFile(aoti_engine_dir / "target" / "cpu" / "steps.pt2") as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    calls = wrapper.count("aoti_torch_cpu_routed_experts(") - 1  # less its declaration
    assert calls == 4  # the tiny target's four MoE layers


def test_the_kernel_takes_experts_of_whole_vectors_only():
    assert cpu_moe.fits(128, 128) and cpu_moe.fits(48, 64)
    assert not cpu_moe.fits(100, 128) and not cpu_moe.fits(128, 72)
