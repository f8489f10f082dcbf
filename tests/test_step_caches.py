"""The compiled steps are the runtime's own modules over caches the steps own (`step_caches`):
rows of several sequences in one call give each sequence's own forward, a step holds no weights
but the model's, and its captured graph takes the forms the CPU packages rely on (row-wise
projections, gathered experts, rotary tables)."""

import pytest
import torch

from metrale.runtime.backends.aoti_steps import BatchedDFlashStep, BatchedMTPStep, BatchedTargetStep
from metrale.runtime.models.rotary import rope_at

SLOTS = 48


def _pools(d, seqs=3, layers=None):
    n = d.num_hidden_layers if layers is None else layers
    return [t for _ in range(n) for t in (torch.zeros(seqs, d.num_key_value_heads, d.head_dim, SLOTS),
                                          torch.zeros(seqs, SLOTS, d.num_key_value_heads, d.head_dim))]


@pytest.fixture()
def fresh_engine(tiny_engine_dir):
    """A loaded engine of its own: building a step prepares the models in place."""
    from metrale.runtime.backends import load_engine

    engine = load_engine(tiny_engine_dir, backend="torch")
    engine.pack()
    return engine


def _interleaved(lengths, chunks):
    """Calls over sequences of `lengths`, each call taking every unfinished sequence's next
    `chunks[b]` rows: (rows as (sequence, position) pairs) per call."""
    done, calls = [0] * len(lengths), []
    while any(d < n for d, n in zip(done, lengths)):
        rows = []
        for b, n in enumerate(lengths):
            take = min(chunks[b], n - done[b])
            rows += [(b, done[b] + i) for i in range(take)]
            done[b] += take
        calls.append(rows)
    return calls


def test_pooled_target_rows_are_each_sequences_own_forward(fresh_engine):
    target = fresh_engine.target
    taps = (0, 1, 3)
    step = BatchedTargetStep(target, taps, positions=SLOTS + 64).eval()
    lengths, chunks = (9, 5, 12), (4, 1, 5)
    ids = torch.randint(0, target.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    kv = _pools(target.config)
    got = {b: [] for b in range(3)}
    with torch.inference_mode():
        for rows in _interleaved(lengths, chunks):
            seq = torch.tensor([b for b, _ in rows])
            pos = torch.tensor([p for _, p in rows])
            logits, last, tapped = step(ids[seq, pos], pos, seq, torch.arange(len(rows)), *kv)
            for i, (b, _) in enumerate(rows):
                got[b].append((logits[i], last[i], tapped[i]))
        for b, n in enumerate(lengths):
            want = target(ids[b:b + 1, :n], target.new_cache(1, SLOTS), taps=taps)
            for field, ref in enumerate((want.logits, want.last_hidden, want.taps)):
                mine = torch.stack([row[field] for row in got[b]])
                assert (mine - ref[0]).abs().max().item() <= 1e-4


def _mtp_step(head, seqs: int, entries: int):
    """The head's batched step, random embeddings and hidden states [seqs, entries, H], pools."""
    d = head.config.decoder
    gen = torch.Generator().manual_seed(seqs)
    emb, hid = (torch.randn(seqs, entries, d.hidden_size, generator=gen) for _ in range(2))
    return BatchedMTPStep(head, SLOTS + 64).eval(), emb, hid, _pools(d, seqs, layers=1)


def test_pooled_mtp_entries_are_each_chains_own_forward(fresh_engine):
    head = fresh_engine.mtp
    step, emb, hid, (k, v) = _mtp_step(head, 2, 6)
    with torch.inference_mode():
        rows = [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2), (1, 3), (0, 3), (0, 4), (0, 5)]
        seq, pos = torch.tensor([b for b, _ in rows]), torch.tensor([p for _, p in rows])
        logits, h = step(emb[seq, pos], hid[seq, pos], pos, seq, k, v)
        for b, n in ((0, 6), (1, 4)):
            want_logits, want_h = head(emb[b:b + 1, :n], hid[b:b + 1, :n], head.new_cache(1, SLOTS, emb.dtype))
            mine = seq == b
            assert (logits[mine] - want_logits[0]).abs().max().item() <= 1e-4
            assert (h[mine] - want_h[0]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_pooled_blocks_are_each_sequences_own_propose(fresh_engine, name):
    """Two sequences fed and proposed in one call: the eager drafter's drafts for each alone."""
    import copy

    drafter = fresh_engine.drafters[name]
    eager = copy.deepcopy(drafter)
    embed = fresh_engine.target.model.embed_tokens
    cfg = drafter.config
    step = BatchedDFlashStep(drafter, embed, 8, SLOTS + 64).eval()
    width = cfg.num_context_features * cfg.target_hidden_size
    gen = torch.Generator().manual_seed(2)
    feats = [torch.randn(1, n, width, generator=gen) for n in (7, 4)]
    anchors, gammas = torch.tensor([11, 23]), torch.tensor([cfg.block_size, 4])
    block = torch.full((2, cfg.block_size), cfg.mask_token_id)
    block[:, 0] = anchors
    with torch.inference_mode():
        drafts = step(torch.cat([f[0] for f in feats]), torch.cat([torch.arange(7), torch.arange(4)]),
                      torch.tensor([0] * 7 + [1] * 4), block, torch.tensor([0, 1]), torch.tensor([7, 4]),
                      gammas, *_pools(cfg.decoder, 2))
        for b in range(2):
            cache = eager.new_cache(1, SLOTS, feats[b].dtype)
            eager.add_context(feats[b], cache)
            want = eager.propose(anchors[b:b + 1], embed, cache, int(gammas[b])).tokens[0]
            assert drafts[b, :len(want)].tolist() == want.tolist()
        # with the distributions: the same drafts beside them, or the distributions alone
        args = (torch.cat([f[0] for f in feats]), torch.cat([torch.arange(7), torch.arange(4)]),
                torch.tensor([0] * 7 + [1] * 4), block, torch.tensor([0, 1]), torch.tensor([7, 4]), gammas)
        both = BatchedDFlashStep(drafter, embed, 8, SLOTS + 64, distributions=True)(*args, *_pools(cfg.decoder, 2))
        alone = BatchedDFlashStep(drafter, embed, 8, SLOTS + 64, distributions=True, picks=False)(
            *args, *_pools(cfg.decoder, 2))
        assert torch.equal(both[0], drafts) and len(alone) == 2
        assert all(torch.equal(a, b) for a, b in zip(alone, both[1:]))
    with pytest.raises(ValueError, match="without picks"):
        BatchedDFlashStep(drafter, embed, 8, SLOTS, picks=False)


def test_a_step_holds_only_its_models_weights(fresh_engine):
    """No second copy of any forward: every tensor of a step is one of the runtime model's."""
    target = fresh_engine.target
    names = set(BatchedTargetStep(target, (0,), positions=SLOTS).state_dict())
    assert names and all(n.startswith("model.") for n in names)
    assert names == {f"model.{n}" for n in target.state_dict()}
    drafter = fresh_engine.drafters["dflash2"]
    names = set(BatchedDFlashStep(drafter, target.model.embed_tokens, 8, SLOTS).state_dict())
    assert names == {f"drafter.{n}" for n in drafter.state_dict()} | {"embed.weight"}


def _ops(ep) -> set[str]:
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("linear", ["gemm", "rowwise"])
def test_the_exported_target_step_takes_the_linears_it_was_asked_for(fresh_engine, linear):
    target = fresh_engine.target
    step = BatchedTargetStep(target, (1,), linear, SLOTS + 64).eval()
    args = (torch.tensor([5, 7, 9, 11]), torch.tensor([0, 1, 2, 0]), torch.tensor([0, 0, 0, 1]),
            torch.tensor([2, 3]), *_pools(target.config, 2))
    with torch.inference_mode():
        ep = torch.export.export(step, args)
        eager = step(*[a.clone() for a in args])
        traced = ep.module()(*[a.clone() for a in args])
    gemms = {o for o in _ops(ep) if o.startswith("aten.") and o.split(".")[1] in ("mm", "addmm", "bmm", "linear")}
    assert bool(gemms) == (linear == "gemm"), gemms
    assert "aten.cos.default" not in _ops(ep)  # rotary embeddings gathered from the table
    for a, b in zip(eager, traced):
        assert (a - b).abs().max().item() <= 1e-4


def test_nvfp4_experts_export_as_gathered_float_experts(engine_factory):
    """An MTP head with NVFP4 experts (the grouped op, eagerly): its step's graph holds no metrale
    op, gathers each row's experts, and gives the eager head's outputs."""
    import copy

    from metrale.runtime.backends import load_engine

    head = load_engine(engine_factory("nvfp4", mtp_experts_nvfp4=True), components=("mtp",),
                       backend="torch").mtp
    from metrale.runtime.models.layers import pack_for_inference

    pack_for_inference(head)
    eager = copy.deepcopy(head)
    step, emb, hid, (k, v) = _mtp_step(head, 1, 3)
    with torch.inference_mode():
        args = (emb[0], hid[0], torch.arange(3), torch.zeros(3, dtype=torch.long), k, v)
        ep = torch.export.export(step, args)
        logits, h = ep.module()(*args)
        want_logits, want_h = eager(emb, hid, eager.new_cache(1, SLOTS, emb.dtype))
    assert not any(o.startswith("metrale.") for o in _ops(ep))
    assert "aten.index.Tensor" in _ops(ep)
    assert (logits - want_logits[0]).abs().max().item() <= 1e-4
    assert (h - want_h[0]).abs().max().item() <= 1e-4


def test_a_compiled_step_refuses_a_rotary_table_it_was_not_given():
    class Rope(torch.nn.Module):
        def forward(self, positions):
            return rope_at(positions, 6, 1234.5, torch.float32)[0]

    with pytest.raises(Exception, match="build the table before tracing"):
        torch.export.export(Rope(), (torch.arange(3),))
