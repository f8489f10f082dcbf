"""The CPU kernel of a batched step's attention (`plugins.cpu_attention`): against its masked
math in torch ops, a row's bits independent of the other rows, of the pool's slot count and of
its stale slots, and what the tiny engine's packages call for every attention layer."""

from __future__ import annotations

import ctypes
import zipfile

import pytest
import torch

from conftest import NEEDS_CPU_KERNELS
from metrale.plugins import cpu_attention

pytestmark = NEEDS_CPU_KERNELS
P = ctypes.c_void_p


@pytest.fixture(scope="module")
def kernel(cpu_kernels_lib):
    lib = cpu_kernels_lib

    def run(q, k_pool, v_pool, seq, last):
        t, nh, hd = q.shape
        out = torch.full((t, nh * hd), float("nan"))
        lib.metrale_pooled_attention(*(P(x.data_ptr()) for x in (q, k_pool, v_pool, seq, last, out)),
                                     *(ctypes.c_int64(v) for v in (t, nh, k_pool.shape[1], hd, k_pool.shape[3])))
        return out
    return run


@pytest.fixture(scope="module")
def kernel_tree(cpu_kernels_lib):
    lib = cpu_kernels_lib

    def run(q, k_pool, v_pool, seq, last, hide):
        t, nh, hd = q.shape
        out = torch.full((t, nh * hd), float("nan"))
        lib.metrale_pooled_tree_attention(*(P(x.data_ptr()) for x in (q, k_pool, v_pool, seq, last, hide, out)),
                                          *(ctypes.c_int64(v) for v in (t, nh, k_pool.shape[1], hd, k_pool.shape[3])))
        return out
    return run


def _pools(b, nkv, hd, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, nkv, hd, s, generator=g), torch.randn(b, s, nkv, hd, generator=g)


def _rows(t, nh, hd, b, s, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, nh, hd, generator=g)
    seq = torch.randint(0, b, (t,), generator=g)
    last = torch.randint(0, s, (t,), generator=g)
    return q, seq, last


@pytest.mark.parametrize("t,nh,nkv,hd,s", [(1, 4, 2, 32, 64), (7, 4, 2, 32, 64), (33, 8, 2, 16, 128),
                                           (5, 4, 4, 64, 192), (12, 6, 1, 32, 80), (6, 4, 2, 48, 77)])
def test_the_kernel_computes_the_ops_math(kernel, t, nh, nkv, hd, s):
    k_pool, v_pool = _pools(5, nkv, hd, s)
    q, seq, last = _rows(t, nh, hd, 5, s)
    last[0] = 0  # one visible slot
    last[-1] = s - 1  # every slot
    ref = cpu_attention.pooled_math(q.double(), k_pool.double(), v_pool.double(), seq, last)
    torch.testing.assert_close(kernel(q, k_pool, v_pool, seq, last).double(), ref, rtol=1e-5, atol=1e-5)


def test_a_rows_bits_do_not_depend_on_the_call_the_pool_or_stale_slots(kernel):
    """Alone, among 30 rows, reordered, in a pool of more slots and sequences whose slots past
    the row's last visible one hold other values: the same bits."""
    k_pool, v_pool = _pools(6, 2, 32, 64)
    q, seq, last = _rows(30, 4, 32, 6, 64, seed=2)
    together = kernel(q, k_pool, v_pool, seq, last)
    alone = torch.cat([kernel(q[r:r + 1].contiguous(), k_pool, v_pool, seq[r:r + 1].contiguous(),
                              last[r:r + 1].contiguous()) for r in range(30)])
    assert torch.equal(together, alone)
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kernel(q[perm].contiguous(), k_pool, v_pool, seq[perm].contiguous(),
                              last[perm].contiguous()), together[perm])
    big_k, big_v = _pools(9, 2, 32, 256, seed=5)  # other values everywhere, then the rows' slots copied in
    big_k[:6, :, :, :64], big_v[:6, :64] = k_pool, v_pool
    big_k[:6, :, :, 64:] = float("nan")  # never read: past every row's visible slots
    assert torch.equal(kernel(q, big_k, big_v, seq, last), together)


def test_the_ops_math_is_the_steps_masked_attention():
    """The op's eager form is the masked math the compiled steps run without the kernel."""
    from metrale.runtime.models.step_caches import PooledKV

    k_pool, v_pool = _pools(3, 2, 32, 64)
    q, seq, last = _rows(9, 4, 32, 3, 64, seed=3)
    eager = PooledKV([k_pool, v_pool], seq, last).attend(0, q.transpose(0, 1)[None])
    with_op = PooledKV([k_pool, v_pool], seq, last, kernel=True).attend(0, q.transpose(0, 1)[None])
    assert torch.equal(eager, with_op)  # the op's eager kernel is that math
    torch.testing.assert_close(eager[0], cpu_attention.pooled_math(q, k_pool, v_pool, seq, last))


@pytest.mark.parametrize("component,file,layers", [("target", "steps.pt2", 4), ("mtp", "steps.pt2", 1),
                                                   ("dflash", "propose.pt2", 2), ("dflash2", "propose.pt2", 2),
                                                   ("dflash2", "propose_tree.pt2", 2)])
def test_the_tiny_engines_packages_call_the_kernel(aoti_engine_dir, component, file, layers):
    """Every attention layer of the built packages is the kernel's shim, none inductor's masked math."""
    with zipfile.ZipFile(aoti_engine_dir / component / "cpu" / file) as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    # the target's rows may be a draft tree's: its attention takes each row's hidden drafts
    shim = "aoti_torch_cpu_pooled_tree_attention(" if component == "target" else "aoti_torch_cpu_pooled_attention("
    assert wrapper.count(shim) - 1 == layers  # less its declaration


def test_the_kernel_takes_heads_of_whole_vectors_only():
    assert cpu_attention.fits(32, 4, 2) and cpu_attention.fits(128, 32, 8)
    assert not cpu_attention.fits(40, 4, 2) and not cpu_attention.fits(32, 6, 4)
    assert not cpu_attention.fits(512, 4, 2)


def _random_tree(n: int, seed: int):
    from metrale.runtime.spec.ddtree import Tree

    g = torch.Generator().manual_seed(seed)
    parents, depths = [-1], [0]
    for i in range(1, n + 1):
        p = int(torch.randint(0, i, (1,), generator=g))
        parents.append(p)
        depths.append(depths[p] + 1)
    return Tree(tuple(range(n + 1)), tuple(parents), tuple(depths))


@pytest.mark.parametrize("nodes,base,seed", [(8, 5, 0), (16, 40, 1), (64, 70, 2), (30, 0, 3)])
def test_a_tree_nodes_row_has_the_bits_of_its_paths_chain_row(kernel_tree, kernel, nodes, base, seed):
    """A draft tree's rows (node i at slot base+i, hiding the drafts before it that are not its
    ancestors) against a chain verify of each node's path (its ancestors at the slots just after
    the root): the same bits, and the masked math's values."""
    tree = _random_tree(nodes, seed)
    s = 192
    k_pool, v_pool = _pools(3, 2, 32, s, seed=seed)
    q = torch.randn(nodes + 1, 4, 32, generator=torch.Generator().manual_seed(seed + 7))
    seq = torch.full((nodes + 1,), 1)
    last = torch.arange(base, base + nodes + 1)
    hide = torch.tensor(tree.hidden_bits())
    got = kernel_tree(q, k_pool, v_pool, seq, last, hide)
    ref = cpu_attention.pooled_math(q.double(), k_pool.double(), v_pool.double(), seq, last, hide)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    for i in range(nodes + 1):
        path = [i]
        while path[-1] > 0:
            path.append(tree.parents[path[-1]])
        path = path[::-1]  # root .. i
        assert len(path) - 1 == tree.depths[i] and int(hide[i]).bit_count() == i - tree.depths[i]
        ck, cv = k_pool.clone(), v_pool.clone()  # the chain's layout: the path from the root's slot on
        ck[1, :, :, base:base + len(path)] = k_pool[1, :, :, [base + n for n in path]]
        cv[1, base:base + len(path)] = v_pool[1, [base + n for n in path]]
        chain = kernel(q[i:i + 1].contiguous(), ck, cv, seq[:1].contiguous(), torch.tensor([base + tree.depths[i]]))
        assert torch.equal(got[i], chain[0]), i
