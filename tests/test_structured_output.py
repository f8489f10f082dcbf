"""Structured output under speculation (`spec.grammar`, `response_format`): every answer parses
and validates against its schema in every speculative mode, greedy constrained speculation
(exact verify, and chunkwise on a row-invariant target) emits plain constrained decoding's
tokens, drafts the grammar refuses are never verified, and the matcher's state after a step is
the state of the tokens the step emitted (rejected drafts roll back)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import requests
import torch
from openai import OpenAI

from metrale.runtime.serving.http_guard import ServerLimits
from metrale.runtime.serving.server import create_app
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec import decode, pattern_grammar
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.spec.grammar import JSON_OBJECT, GrammarStall, Grammars, GrammarState
from metrale.runtime.spec.sampling import SamplingParams, sample
from metrale.runtime.steps import Forward

from conftest import char_grammar_state, serve_in_thread

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "kind": {"enum": ["a", "b"]}}, "required": ["name", "count", "tags", "kind"], "additionalProperties": False}
MODES = {"plain": {}, "mtp": dict(speculative=True, num_drafts=3),
         "mtp-cum": dict(speculative=True, num_drafts=3, draft_confidence_stop="cum:0.5"),
         "dflash": dict(dflash=True), "dflash2": dict(dflash=True, dflash_drafter="dflash2"),
         "dflash-exact": dict(dflash=True, exact_verify=True),
         "dflash2-exact": dict(dflash=True, dflash_drafter="dflash2", exact_verify=True),
         "mtp-exact": dict(speculative=True, num_drafts=3, exact_verify=True)}


def _text(tok, ids: list[int]) -> str:
    return tok.decode([i for i in ids if i not in tok.eos_token_ids])


@pytest.fixture(scope="module")
def grammars(tiny_engine):
    return Grammars(tiny_engine.tokenizer, tiny_engine.target.config.vocab_size)


def _allowed(state) -> torch.Tensor:
    return state.masked(torch.zeros(state.vocab_size)) > float("-inf")


def test_drafts_walk_the_grammar_and_roll_back(tiny_engine, grammars):
    tok = tiny_engine.tokenizer
    state = grammars.state(json.dumps(SCHEMA))
    doc = tok.encode('{"name": "x", "count": 12, "tags": [], "kind": "a"}')
    state.advance(doc[:3])
    before = _allowed(state)
    bad = min(tok.eos_token_ids)  # an end before the document is complete
    assert state.valid_drafts(doc[3:8] + [bad] + doc[8:10]) == 5  # cut at the refused draft
    assert torch.equal(_allowed(state), before)  # and the state is the emitted tokens' again
    # each verify row is masked at the state after the drafts before it
    rows = torch.randn(4, state.vocab_size)
    masked = state.masked_rows(rows, doc[3:6])
    assert torch.equal(_allowed(state), before)
    for i in range(4):
        step = grammars.state(json.dumps(SCHEMA))
        step.advance(doc[:3 + i])
        assert torch.equal(masked[i] > float("-inf"), _allowed(step))
        assert torch.equal(masked[i][_allowed(step)], rows[i][_allowed(step)])
    # greedy verify keeps drafts while each is its row's masked argmax, then the row's token
    rows = torch.full((4, state.vocab_size), -5.0)
    rows[0, doc[3]] = rows[1, doc[4]] = 9.0  # rows 0 and 1 take the drafts
    rows[2, bad] = 9.0  # row 2 prefers a refused token: its masked argmax is another
    ids = state.greedy(rows, doc[3:6])
    assert ids[:2] == doc[3:5] and ids[2] != bad and len(ids) == 3
    fresh = grammars.state(json.dumps(SCHEMA))
    fresh.advance(doc[:3] + ids)
    assert torch.equal(_allowed(state), _allowed(fresh))


def test_json_object_admits_any_object_only(tiny_engine, grammars):
    tok = tiny_engine.tokenizer
    state = grammars.state(JSON_OBJECT)
    assert state.valid_drafts(tok.encode('{"a": [1, {"b": null}]}')) == len(tok.encode('{"a": [1, {"b": null}]}'))
    assert state.valid_drafts(tok.encode("[1]")) == 0


@pytest.mark.parametrize("mode", [m for m in MODES if m != "plain"])
def test_greedy_constrained_speculation_emits_plain_constrained_decoding(tiny_engine, tiny_prompts, mode,
                                                                         monkeypatch):
    """Under exact verify always, running its rows one a forward up to the first whose token
    rejects the next draft; chunkwise where the target's rows are plain decoding's (the verify
    rows of eager float32 may flip a near-tie, as unconstrained chunkwise may)."""
    schema = json.dumps(SCHEMA)
    plain = EngineGenerator(tiny_engine, SpeculativeConfig())
    spec = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    tok = tiny_engine.tokenizer
    verified = 0
    ran, forwards = [], decode.run_forwards
    monkeypatch.setattr(decode, "run_forwards", lambda target, needs: (
        ran.extend(n.rows for n in needs if isinstance(n, Forward)), forwards(target, needs))[1])
    for p in tiny_prompts[:3]:
        params = SamplingParams(temperature=0.0, max_tokens=96, json_schema=schema)
        want = plain.generate(p[:10], params)
        ran.clear()
        got = spec.generate(p[:10], params)
        jsonschema.validate(json.loads(_text(tok, got.token_ids)), SCHEMA)
        if "exact" in mode:
            assert got.token_ids == want.token_ids, mode
            assert sum(ran[1:]) == len(got.token_ids) - 1 == got.metrics.verify_rows, mode  # (after the prompt's)
        verified += got.metrics.drafts_verified
    assert verified > 0  # drafts were verified, not all refused


# patterns whose converter rules kept xgrammar's parser tracking many ways through a text
PATTERNED = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^(\\w{1,6} ?){1,3}$"},
    "path": {"type": "string", "pattern": "^(a|\\S{1,4}.){1,3}$"}},
    "required": ["name", "path"], "additionalProperties": False}


@pytest.mark.parametrize("mode", ["mtp-exact", "dflash2-exact", "dflash2"])
def test_patterned_strings_under_speculation(tiny_engine, tiny_prompts, mode):
    """Under patterns written as automata, drafts walked and rolled back through their rules:
    every answer validates (Python's `re.search`), and greedy exact answers are plain
    constrained decoding's."""
    schema = json.dumps(PATTERNED)
    plain = EngineGenerator(tiny_engine, SpeculativeConfig())
    spec = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    for i, p in enumerate(tiny_prompts[:3]):
        params = SamplingParams(temperature=0.9 if i == 2 else 0.0, seed=i, max_tokens=96, json_schema=schema)
        got = spec.generate(p[:10], params)
        jsonschema.validate(json.loads(_text(tiny_engine.tokenizer, got.token_ids)), PATTERNED)
        if "exact" in mode and i < 2:
            assert got.token_ids == plain.generate(p[:10], params).token_ids


def test_chunkwise_constrained_speculation_on_the_cpu_packages_emits_plain_decoding(aoti_engine, tiny_prompts):
    """And the drafters' packages give their blocks' logits, so a DFlash block is redrafted
    within the grammar (as the eager drafter's is), not cut at its first refused draft."""
    schema = json.dumps(SCHEMA)
    plain = EngineGenerator(aoti_engine, SpeculativeConfig())
    for flags in (MODES["mtp"], MODES["dflash"], MODES["dflash2"]):
        spec = EngineGenerator(aoti_engine, SpeculativeConfig.from_flags(**flags))
        verified = proposed = 0
        for p in tiny_prompts[:2]:
            params = SamplingParams(temperature=0.0, max_tokens=96, json_schema=schema)
            got = spec.generate(p[:10], params)
            assert got.token_ids == plain.generate(p[:10], params).token_ids, flags
            verified, proposed = verified + got.metrics.drafts_verified, proposed + got.metrics.drafts_proposed
        if flags.get("dflash"):
            assert verified > 0.6 * proposed, flags


def test_adaptive_k_counts_the_grammars_host_work_per_row(tiny_engine, tiny_prompts):
    """The grammar's work at a drafting step (its walk over the drafts, its masks) goes to
    adaptive k's choice beside the measured table; the answer is plain constrained decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=48, json_schema=json.dumps(SCHEMA))
    want = EngineGenerator(tiny_engine, SpeculativeConfig()).generate(tiny_prompts[0][:10], params)
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(
        dflash=True, exact_verify=True, dflash_adaptive_k="0:1,1:1.1,2:1.2,3:1.3,4:1.4,5:1.5,6:1.6,7:1.7"))
    decoder = gen.decoder(params)
    assert decoder.generate(tiny_prompts[0][:10], params).token_ids == want.token_ids
    assert decoder.proposer.controller.host_row_ms > 0.0


@pytest.mark.parametrize("mode", list(MODES))
def test_every_answer_validates_against_its_schema(tiny_engine, mode):
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=8))) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int):
            sampled = dict(temperature=0.9, seed=i) if i % 2 else dict(temperature=0)
            if i % 3 == 0:
                r = client.chat.completions.create(
                    model=gen.model_id, max_tokens=128, response_format=fmt if i % 4 else {"type": "json_object"},
                    messages=[{"role": "user", "content": f"item {i}"}], **sampled)
                return i % 4 != 0, r.choices[0].message.content, r.choices[0].finish_reason
            r = client.completions.create(model=gen.model_id, prompt=f"def f{i}(", max_tokens=128,
                                          extra_body={"response_format": fmt}, **sampled)
            return True, r.choices[0].text, r.choices[0].finish_reason

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, range(12)))
    for schema_given, text, finish in answers:
        assert finish == "stop", text  # the document ended (EOS once complete), not the budget
        doc = json.loads(text)
        if schema_given:
            jsonschema.validate(doc, SCHEMA)
        else:
            assert isinstance(doc, dict)


def test_a_bad_response_format_is_refused(tiny_engine):
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True))
    with serve_in_thread(create_app(gen, ServerLimits())) as base:
        def refused(fmt) -> str:
            r = requests.post(base + "/v1/completions", timeout=30,
                              json={"prompt": "x", "max_tokens": 4, "response_format": fmt})
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
            return r.json()["error"]["message"]

        assert "`response_format` must be an object" in refused({"type": "yaml"})
        assert "json_schema.schema" in refused({"type": "json_schema", "json_schema": {"name": "x"}})
        assert "cannot be enforced" in refused({"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
        ok = requests.post(base + "/v1/completions", timeout=30, json={
            "prompt": "x", "max_tokens": 4, "response_format": {"type": "text"}})
        assert ok.status_code == 200


def test_schemas_are_honoured_beside_graph_lanes(tiny_engine_dir, tiny_engine, tiny_prompts):
    """On a target whose requests run in the lanes of whole-iteration graphs (the capture
    stand-in), requests with a schema run the decode loop on the eager model beside them, in the
    same scheduler iterations as the lanes' replays: every answer validates, greedy exact
    answers are plain constrained decoding's, and the requests without one still get plain
    decoding's answers from the lanes. Chunkwise, every schema answer validates too."""
    from metrale.runtime.backends import load_engine
    from metrale.runtime.backends.cuda_graphs import EagerGraphs, use_cuda_graphs

    engine = load_engine(tiny_engine_dir, backend="torch")
    use_cuda_graphs(engine, graphs=EagerGraphs())
    flags = dict(dflash=True, exact_verify=True)
    gen = EngineGenerator(engine, SpeculativeConfig.from_flags(**flags))
    assert gen.capabilities.max_running == 32  # lanes
    calls = []  # the step types of each batched call
    run_forwards = gen.run_forwards
    gen.run_forwards = lambda steps: calls.append({type(s).__name__ for s in steps}) or run_forwards(steps)
    tok = tiny_engine.tokenizer
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    texts = [tok.decode(p[:10]) for p in tiny_prompts[:3]]
    plain = EngineGenerator(tiny_engine, SpeculativeConfig())
    want = {}
    for i, text in enumerate(texts):
        for schema in (True, False):
            params = SamplingParams(temperature=0.0, max_tokens=64, json_schema=json.dumps(SCHEMA) if schema else None)
            want[i, schema] = _text(tok, plain.generate(tok.encode(text), params).token_ids)
    with serve_in_thread(create_app(gen, ServerLimits(max_num_seqs=8))) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(job):
            i, schema, sampled = job
            extra = {"response_format": fmt} if schema else None
            r = client.completions.create(model=gen.model_id, prompt=texts[i], max_tokens=64, extra_body=extra,
                                          **(dict(temperature=0.9, seed=i) if sampled else dict(temperature=0)))
            return job, r.choices[0].text

        jobs = [(i, schema, sampled) for i in range(len(texts)) for schema in (True, False) for sampled in (False, True)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, jobs))
    for (i, schema, sampled), text in answers:
        if schema:
            jsonschema.validate(json.loads(text), SCHEMA)
        if not sampled:
            assert text == want[i, schema], (i, schema)
    assert any({"EagerRows", "LaneStep"} <= kinds for kinds in calls)  # beside the lanes
    chunkwise = EngineGenerator(engine, SpeculativeConfig.from_flags(dflash=True, dflash_drafter="dflash2"))
    with serve_in_thread(create_app(chunkwise, ServerLimits(max_num_seqs=8))) as base:
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda i: client.completions.create(
                model=gen.model_id, prompt=f"item {i}", max_tokens=96, temperature=0.9 if i % 2 else 0,
                seed=i, extra_body={"response_format": fmt}).choices[0].text, range(4)))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


# A pattern whose grammar, as xgrammar's regex converter writes it, xgrammar masks wrongly: after
# `"b` its bitmask allows `61"`, which its matcher refuses ("b61" matches none of the
# alternatives; "b" alone does). Patterns are automata now (`pattern_dfa`), but the decode loop
# still takes only what the matcher accepts, whatever grammar a mask comes from.
MISMASKED = {"type": "string", "pattern": "^b\\d+[\U0002fa1e-\U0002ffff]x|b$"}


@pytest.fixture
def converter_rules(monkeypatch):
    """Patterns written by xgrammar's regex converter, as they were before they became automata."""
    monkeypatch.setattr(pattern_grammar, "dfa_rules", lambda *args: None)
    pattern_grammar.schema_grammar.cache_clear()
    yield
    pattern_grammar.schema_grammar.cache_clear()


def test_the_automaton_masks_what_the_matcher_takes():
    """The pattern's own rules (`pattern_dfa`) mask no token the matcher refuses: after `"b`, `61"`
    is masked."""
    state, ids = char_grammar_state(MISMASKED, ['61"'])
    state.advance([ids['"'], ids["b"]])
    assert state.masked(torch.zeros(state.vocab_size))[ids['61"']] == float("-inf")
    assert not state.push(ids['61"'])


def test_a_token_the_mask_allows_and_the_matcher_refuses_is_drawn_again(converter_rules):
    state, ids = char_grammar_state(MISMASKED, ['61"'])
    state.advance([ids['"'], ids["b"]])
    spans = ids['61"']
    assert state.masked(torch.zeros(state.vocab_size))[spans] == 0.0  # xgrammar's mask allows it
    assert not state.push(spans)  # and its matcher refuses it
    row = torch.full((state.vocab_size,), -5.0)
    row[spans], row[ids["6"]], row[ids['"']] = 9.0, 3.0, 1.0
    assert state.greedy(row[None], []) == [ids["6"]]  # the next best the matcher accepts, taken
    state.rollback(1)
    # sampled: drawn again from the row without it, its nucleus taken again (the refused token
    # may have been all of it), and without the draft a recovered token replaces
    gen = torch.Generator().manual_seed(0)
    row = torch.full((state.vocab_size,), -20.0)
    row[spans], row[ids["6"]], row[ids['"']] = 9.0, 1.0, 1.0
    nucleus = SamplingParams(temperature=1.0, top_p=0.9)
    draw = lambda r: sample(r, nucleus, gen)  # noqa: E731
    assert int(draw(state.masked(row))) == spans  # the nucleus holds it alone
    drawn = []
    for _ in range(400):
        drawn.append(state.take_drawn([spans], row, draw)[0])
        state.rollback(1)
    assert set(drawn) == {ids["6"], ids['"']} and 150 < drawn.count(ids["6"]) < 250
    for _ in range(20):
        assert state.take_drawn([spans], row, draw, recovered=ids["6"]) == [ids['"']]
        state.rollback(1)
    with pytest.raises(GrammarStall):  # nothing the matcher accepts: a clear error, not a token
        state.pick(row, torch.argmax, refused=(ids["6"], ids['"']) + tuple(ids[d] for d in "012345789"))


class _Refusing:
    """A matcher that refuses `banned`, and whose mask still allows it where `in_mask` (xgrammar's
    defect above, at a token plain constrained decoding emits) or masks it too (a grammar without
    the token)."""

    def __init__(self, matcher, banned: int, in_mask: bool):
        self._matcher, self._banned, self._in_mask = matcher, banned, in_mask

    def accept_token(self, token: int) -> bool:
        return token != self._banned and self._matcher.accept_token(token)

    def fill_next_token_bitmask(self, bitmask, *args) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, *args)
        if not self._in_mask:
            words = bitmask.numpy().view(np.uint32)
            words[0, self._banned >> 5] &= ~np.uint32(1 << (self._banned & 31))

    def __getattr__(self, name):
        return getattr(self._matcher, name)


@pytest.mark.parametrize("mode", ["plain", "mtp-exact", "dflash-exact", "dflash2-exact"])
def test_decoding_where_the_mask_allows_a_token_the_matcher_refuses(tiny_engine, tiny_prompts, monkeypatch, mode):
    """Every emitted token comes from the tokens the matcher accepts: greedy decoding where the
    mask wrongly allows one emits what decoding with that token masked emits, and a sampled
    request never emits it; neither fails."""
    schema = json.dumps(SCHEMA)
    tok = tiny_engine.tokenizer
    prompt = tiny_prompts[0][:10]
    greedy = SamplingParams(temperature=0.0, max_tokens=96, json_schema=schema)
    plain = EngineGenerator(tiny_engine, SpeculativeConfig()).generate(prompt, greedy).token_ids
    banned = next(t for t in plain if tok.decode([t]).strip().isalnum())  # a token of a value
    init, in_mask = GrammarState.__init__, [False]

    def refusing(self, *args):
        init(self, *args)
        self.matcher = self._ahead.matcher = _Refusing(self.matcher, banned, in_mask[0])

    monkeypatch.setattr(GrammarState, "__init__", refusing)
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(**MODES[mode]))
    want = gen.generate(prompt, greedy).token_ids  # the token masked outright
    in_mask[0] = True
    got = gen.generate(prompt, greedy).token_ids
    assert got == want and banned not in got
    jsonschema.validate(json.loads(_text(tok, got)), SCHEMA)
    for seed in range(3):
        sampled = gen.generate(prompt, SamplingParams(temperature=1.0, top_p=0.5 if seed else 1.0, seed=seed,
                                                      max_tokens=96, json_schema=schema)).token_ids
        assert banned not in sampled
