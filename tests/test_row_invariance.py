"""Batch-invariant verify on the eager torch backend in bfloat16 (CPU), where loading measures
it (`row_probe`): each row of a k+1-row verify forward is bit-identical to the one-row decode
step at its position, so chunkwise speculation emits plain greedy decoding's text in every
mode, without --exact-verify; where it does not hold, it is not claimed.
(The aoti backend's float32 promise is tested in test_aoti_backend.)"""

import json

import pytest
import torch
from conftest import CHUNKWISE_MODES, assert_verify_rows_are_one_row_steps


@pytest.fixture(scope="module")
def bf16_engine(tiny_engine_dir):
    from metrale.runtime.backends import load_engine

    return load_engine(tiny_engine_dir, backend="torch", dtype=torch.bfloat16).pack()


def _claimed(engine) -> None:
    if not engine.rows_invariant:
        pytest.skip(f"not claimed: this CPU's bfloat16 GEMMs under torch {torch.__version__} give "
                    "a row other bits in a forward of several rows (`row_probe`, measured at pack; "
                    "test_the_claim_is_what_the_rows_do checks that verdict)")


@pytest.fixture(scope="module")
def held_out(tiny_recipe, bf16_engine) -> list[list[int]]:
    texts = json.loads((tiny_recipe.target.checkpoint.parent / "prompts.json").read_text())
    assert len(texts) == 24
    return [bf16_engine.tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("k", range(8))
def test_verify_rows_equal_one_row_steps(bf16_engine, k):
    _claimed(bf16_engine)
    assert_verify_rows_are_one_row_steps(bf16_engine.target, k, seed=200 + k, trials=3)


def test_the_claim_is_what_the_rows_do(tiny_engine_dir):
    """Claimed: verify forwards of 1 to 17 rows on other random prompts hold too. Not claimed:
    with attention over whole caches, some forward the probe covers does give a row other bits
    than its one-row step on other random prompts."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.models.row_probe import PROBE_MOST

    engine = load_engine(tiny_engine_dir, backend="torch", dtype=torch.bfloat16).pack()
    if engine.rows_invariant:
        for k in range(17):
            assert_verify_rows_are_one_row_steps(engine.target, k, seed=300 + k)
        return
    engine._row_invariant_modules(True)
    for k in range(PROBE_MOST):
        try:
            assert_verify_rows_are_one_row_steps(engine.target, k, seed=300 + k)
        except AssertionError:
            return
    pytest.fail("the claim was withdrawn, but no verify forward of up to 65 rows differs")


def test_float32_eager_does_not_claim_it(tiny_engine_dir):
    from metrale.runtime.backends import load_engine

    engine = load_engine(tiny_engine_dir, backend="torch").pack()
    assert engine.dtype == torch.float32 and not engine.rows_invariant


def test_every_chunkwise_mode_emits_plain_greedy_text(bf16_engine, held_out):
    """The 24 held-out prompts × 128 tokens, bfloat16, chunkwise verify, every mode."""
    from metrale.runtime.spec.sampling import SamplingParams
    from metrale.runtime.serving.service import EngineGenerator
    from metrale.runtime.spec.config import SpeculativeConfig

    _claimed(bf16_engine)
    params = SamplingParams(temperature=0.0, max_tokens=128)
    plain = [EngineGenerator(bf16_engine).generate(ids, params).token_ids for ids in held_out]
    for flags in CHUNKWISE_MODES:
        gen = EngineGenerator(bf16_engine, SpeculativeConfig.from_flags(**flags))
        verified = 0
        for ids, want in zip(held_out, plain):
            res = gen.generate(ids, params)
            assert res.token_ids == want, flags
            verified += res.metrics.drafts_verified
        assert verified > 0


class _RowCountSkew(torch.nn.Module):
    """An LM head whose GEMM gives other bits in a forward of `rows` rows (as a GEMM library
    that picks another kernel for that row count)."""

    def __init__(self, inner, rows: int):
        super().__init__()
        self.inner, self.rows = inner, rows

    def forward(self, x):
        y = self.inner(x)
        return y * (1 + 2 ** -6) if x.shape[-2] == self.rows else y


def _rowwise_gemms(monkeypatch) -> None:
    """Every GEMM of the eager target one row at a time (its linears and the dense experts'
    batched product), so its rows are invariant by construction on any CPU."""
    import torch.nn.functional as F

    linear, bmm = F.linear, torch.bmm

    def rowwise_linear(x, w, b=None):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.cat([linear(flat[i:i + 1], w, b) for i in range(flat.shape[0])])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    monkeypatch.setattr(F, "linear", rowwise_linear)
    monkeypatch.setattr(torch, "bmm", lambda a, b: torch.cat([bmm(a[:, i:i + 1], b) for i in range(a.shape[1])], 1))


@pytest.mark.parametrize("rows", [5, 33, 65])
def test_a_kernel_that_differs_at_one_row_count_withdraws_the_claim(tiny_engine_dir, rows, monkeypatch, caplog):
    """Whether bfloat16 GEMMs give a row the same bits at every row count depends on the torch
    build and the CPU (torch 2.13 on an AVX-512 CPU without BF16 instructions gives two rows
    other bits), so `pack` measures it (`row_probe`) at every count the decode loop runs. With
    row-at-a-time GEMMs the claim holds on any CPU; an LM head that gives other bits at one row
    count (a verify of 4 drafts, an MTP chain of 32, a 64-node tree) withdraws it."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.models.layers import Attention

    _rowwise_gemms(monkeypatch)
    engine = load_engine(tiny_engine_dir, backend="torch", dtype=torch.bfloat16)
    assert not engine.rows_invariant  # before pack: not measured, not claimed
    assert engine.pack().rows_invariant
    assert all(m.row_invariant for m in engine.target.modules() if isinstance(m, Attention))

    engine = load_engine(tiny_engine_dir, backend="torch", dtype=torch.bfloat16)
    engine.target.lm_head = _RowCountSkew(engine.target.lm_head, rows)
    with caplog.at_level("WARNING"):
        engine.pack()
    assert not engine.eager_rows_invariant and not engine.rows_invariant
    assert "chunkwise verify is not plain decoding's bits" in caplog.text
    assert not any(m.row_invariant for m in engine.target.modules() if isinstance(m, Attention))


class _Cache:
    def __init__(self, max_len: int):
        self.k, self.v, self.length = torch.zeros(1, max_len, 8), torch.zeros(1, max_len, 8), 0


class _Rowwise(torch.nn.Module):
    """A target whose every row is computed alone (an embedding, a per-row projection, its K/V
    the embedding), so row-invariant by construction, unless `skew` rows come in one forward
    (`field`: in its logits, or in the K/V it writes)."""

    def __init__(self, skew: int = 0, field: str = "logits"):
        super().__init__()
        self.config = type("C", (), {"vocab_size": 50, "num_hidden_layers": 2})()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 50)
        self.skew, self.field = skew, field

    def new_cache(self, batch, max_len):
        return _Cache(max_len)

    def forward(self, ids, cache, taps=()):
        h = self.model.embed_tokens(ids)  # [1, T, 8]
        logits = torch.cat([self.proj(h[:, i:i + 1]) for i in range(ids.shape[1])], dim=1)
        skewed = ids.shape[1] == self.skew
        if skewed and self.field == "logits":
            logits = logits * (1 + 2 ** -20)
        n = cache.length
        cache.k[:, n:n + ids.shape[1]] = h[0] * (1 + 2 ** -20) if skewed and self.field == "kv" else h[0]
        cache.v[:, n:n + ids.shape[1]] = h[0]
        cache.length += ids.shape[1]
        return type("Out", (), {"logits": logits, "last_hidden": h, "taps": torch.cat([h] * len(taps), -1) if taps else None})()


def test_the_probe_reads_every_row_count_the_decode_loop_runs():
    from metrale.runtime.models.row_probe import PROBE_MOST, rows_invariant
    from metrale.runtime.spec.config import MAX_NUM_DRAFTS
    from metrale.runtime.spec.decode import CATCH_UP_ROWS
    from metrale.runtime.steps import MAX_TREE_NODES

    assert PROBE_MOST == max(MAX_TREE_NODES + 1, CATCH_UP_ROWS, MAX_NUM_DRAFTS + 1)
    torch.manual_seed(0)
    assert rows_invariant(_Rowwise())
    for skew in range(2, PROBE_MOST + 1):
        assert not rows_invariant(_Rowwise(skew)), skew
    assert not rows_invariant(_Rowwise(7, "kv"))  # the K/V a forward leaves counts too


def test_an_engine_without_drafters_is_probed_too(tiny_engine_dir):
    """A target (and MTP head) without DFlash drafters, as a `--draft-tp-size 1` follower rank
    loads it: the probe reads the decode loop's own row counts."""
    from metrale.runtime.artifact.engine_dir import load_manifest
    from metrale.runtime.components import Role, names_with_role
    from metrale.runtime.backends import load_engine

    components = load_manifest(tiny_engine_dir, verify=False).components
    kept = tuple(n for n in components if n not in names_with_role(components, Role.DRAFTER))
    engine = load_engine(tiny_engine_dir, backend="torch", dtype=torch.bfloat16, components=kept)
    assert not engine.drafters and engine.mtp is not None
    assert engine.pack().eager_invariant in (True, False)
