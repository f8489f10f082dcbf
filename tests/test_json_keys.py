"""No object of a constrained document takes a key twice (`spec.json_keys`): the lexer's keys per
object, wherever the tokens cut the bytes; the mask and the drafts' refusal at a repeated key, and
its rollback; a schema whose keys run out repeats one rather than stall; random walks through
free objects' grammars never repeat a key, where the grammar alone allows it."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from metrale.runtime.spec.grammar import JSON_OBJECT, Grammars
from metrale.runtime.spec.json_keys import At, KeyTracker, free_keys, read

from conftest import char_grammar_state

DOC = b'{"a": {"a": 1}, "b": "{\\"a\\": [", "c": [{"a": 2}, "a"], "d\\u00e9": 3, '


def _allowed(state) -> torch.Tensor:
    return state.masked(torch.zeros(state.vocab_size)) > float("-inf")


@pytest.fixture(scope="module")
def grammars(tiny_engine):
    return Grammars(tiny_engine.tokenizer, tiny_engine.target.config.vocab_size)


def test_keys_are_read_per_object_wherever_the_tokens_cut_the_bytes():
    at, repeated = read(At(), DOC)
    assert not repeated
    assert [f.is_object for f in at.frames] == [True] and at.frames[0].key_next
    assert at.frames[0].keys == {"a", "b", "c", "dé"}  # inner objects' keys and strings' braces are not its
    for key, again in [(b'"a"', True), (b'"\\u0061"', True), (b'"d\\u00e9"', True), (b'"d\xc3\xa9"', True),
                       (b'"e"', False), (b'"\\"a"', False)]:
        assert read(at, key)[1] == again, key
    for cut in range(len(DOC) + 1):  # two tokens, cut anywhere: the same state
        assert read(read(At(), DOC[:cut])[0], DOC[cut:]) == (at, False)
    # a value's string and a nested object's key are not the outer object's keys
    inner, _ = read(at, b'"e": {"')
    assert not read(inner, b'a"')[1] and read(read(inner, b'a": 1, "')[0], b'a"')[1]
    assert not read(at, b'"e": "a"')[1]


def test_a_repeated_key_is_masked_refused_as_a_draft_and_rolled_back(tiny_engine, grammars):
    tok = tiny_engine.tokenizer
    quote, a, b = (tok.encode(t)[0] for t in ('"', "a", "b"))
    state = grammars.state(JSON_OBJECT)
    state.advance(tok.encode('{"a": 1, "'))
    assert state.push(a)
    assert not _allowed(state)[quote] and not state.push(quote)  # "a" again
    only = torch.full((state.vocab_size,), float("-inf"))
    only[quote] = 0.0  # whatever the row's values: the grammar allows other tokens than the repeat
    assert state.masked(only)[quote] == float("-inf")
    state.rollback(1)
    assert state.push(b) and _allowed(state)[quote] and state.push(quote)  # "b" is new
    state.rollback(2)
    assert state.valid_drafts(tok.encode('b": 2}')) == len(tok.encode('b": 2}'))
    assert state.valid_drafts(tok.encode('a": 2}')) == 1  # cut where the key would close
    # a verify's rows are masked at their own states: the row after "a is the one refusing the close
    rows = state.masked_rows(torch.zeros(3, state.vocab_size), [a, b])  # keys "", "a", "ab"
    assert [bool(r[quote] > float("-inf")) for r in rows] == [True, False, True]
    with pytest.raises(AssertionError):
        state.advance([a, quote])
    # an inner object holds keys of its own; dropping a key's tokens frees it again
    state = grammars.state(JSON_OBJECT)
    state.advance(tok.encode('{"a": {"'))
    assert state.valid_drafts(tok.encode('a": 1}')) == len(tok.encode('a": 1}'))
    state.advance(tok.encode('a": 1}, "'))
    assert state.valid_drafts([a, quote]) == 1


def test_the_grouped_lookup_finds_what_reading_every_token_finds(grammars):
    """`KeyTracker.repeating` (tokens grouped by what precedes their quote) against each quoted
    token read whole, at every byte of documents with keys, escapes and nested objects."""
    vocab = grammars.keys
    docs = [DOC + b'"a', DOC + b'"d\\', DOC + b'"d\\u00', b'{"": 1, "x": {"', b'[{"a": "b", "c": "d"}, {"a']
    seen = 0
    for doc in docs:
        for cut in range(1, len(doc) + 1):
            tracker = KeyTracker(vocab)
            tracker.history.append(read(At(), doc[:cut])[0])
            whole = sorted(t for t in vocab.quoted if read(tracker.history[-1], vocab.vocab[t])[1])
            assert tracker.repeating() == whole, doc[:cut]
            seen += len(whole)
    assert seen > 0


def test_a_key_that_can_only_end_as_a_held_one_is_not_begun(tiny_engine, grammars):
    """Keys from a short list: the lookahead refuses a key's first letters that only a held key
    ends with, and a `,` once every key is held, so the object closes instead."""
    tok = tiny_engine.tokenizer
    a, b, comma, close = (tok.encode(t)[0] for t in ("a", "b", ",", "}"))
    state = grammars.state(json.dumps({"type": "object", "propertyNames": {"enum": ["a", "b"]}}))
    state.advance(tok.encode('{"a": 1, "'))
    assert not _allowed(state)[a] and _allowed(state)[b] and not state.push(a)
    state = grammars.state(json.dumps({"type": "object", "propertyNames": {"enum": ["a"]}}))
    state.advance(tok.encode('{"a": 1'))
    assert not _allowed(state)[comma] and _allowed(state)[close]
    doc = tok.encode('{"a": 1}') + [min(tok.eos_token_ids)]
    assert state.valid_drafts(doc[len(tok.encode('{"a": 1')):]) == 2  # `}` and the end
    # free keys: every key's first letters can end as a new one
    state = grammars.state(JSON_OBJECT)
    state.advance(tok.encode('{"a": 1, "'))
    assert _allowed(state)[a]


def test_keys_that_run_out_repeat_rather_than_stall(tiny_engine, grammars):
    """A grammar that requires more keys than its list holds (minProperties, which the schema
    check refuses beside a short list; compiled here unchecked): a key is repeated rather than
    the document stalled."""
    tok = tiny_engine.tokenizer
    state = grammars.state(json.dumps({"type": "object", "propertyNames": {"enum": ["a"]}, "minProperties": 2}))
    doc = tok.encode('{"a": 1, "a": 2}')
    assert state.valid_drafts(doc) == len(doc)


SCHEMAS = [json.loads(JSON_OBJECT),
           {"type": "object", "additionalProperties": {"type": "integer"}},
           {"type": "object", "patternProperties": {"^[a-c]+$": {"type": "integer"}}, "additionalProperties": False},
           {"type": "object", "properties": {"x": {"type": "object"}}, "required": ["x"]}]
# a document each schema's grammar allows, with a key repeated
REPEATS = ['{"a": 1, "a": 2}', '{"b": 1, "b": 2}', '{"ab": 1, "ab": 2}', '{"x": {"c": 1, "c": 2}}']


def _walks(tok, grammars, schema: dict, keys: bool, n: int = 48) -> tuple[int, int]:
    """n random walks through `schema`'s grammar, each token drawn from what the state allows,
    mostly from a few short keys' tokens (so a free object meets a key again often), an end
    (`}`, EOS) a quarter of the time it is among them -> (complete documents, documents with an
    object that repeats a key); each complete one validates."""
    ends = set(tok.encode("}")) | set(tok.eos_token_ids)
    favoured = set(tok.encode('{"a": 1, "b": 2, "ab": {"c": 3')) | ends
    rng, complete, repeating = random.Random(0), 0, 0
    for _ in range(n):
        state = grammars.state(json.dumps(schema))
        if not keys:
            _without_keys(state)
        ids: list[int] = []
        while not state.done and len(ids) < 120:
            allowed = _allowed(state).nonzero().flatten().tolist()
            near = [t for t in allowed if t in favoured]
            closing, going = [t for t in near if t in ends], [t for t in near if t not in ends]
            if near and rng.random() < 0.95:
                ids.append(rng.choice(closing if closing and (not going or rng.random() < 0.25) else going))
            else:
                ids.append(rng.choice(allowed))
            state.accept(ids[-1])
        if not state.done:
            continue
        pairs: list[list[str]] = []
        doc = json.loads(tok.decode(ids[:-1]), object_pairs_hook=lambda kv: pairs.append([k for k, _ in kv]) or dict(kv))
        jsonschema.validate(doc, schema)
        complete += 1
        repeating += any(len(set(p)) < len(p) for p in pairs)
    return complete, repeating


def _without_keys(state):
    """`state` as the grammar alone masks it: no token refused for its key."""
    state.keys.repeating = list
    state.keys.dead_ends = lambda allowed, walker: []
    return state


@pytest.mark.parametrize("schema,doc", list(zip(SCHEMAS, REPEATS)),
                         ids=["json_object", "additional", "pattern", "nested"])
def test_walks_through_free_objects_never_repeat_a_key(tiny_engine, grammars, schema, doc):
    tok = tiny_engine.tokenizer
    complete, repeating = _walks(tok, grammars, schema, keys=True)
    assert complete >= 30 and repeating == 0
    ids = tok.encode(doc)
    assert _without_keys(grammars.state(json.dumps(schema))).valid_drafts(ids) == len(ids)
    assert grammars.state(json.dumps(schema)).valid_drafts(ids) < len(ids)


def test_the_walks_find_repeated_keys_where_the_grammar_alone_masks(tiny_engine, grammars):
    tok = tiny_engine.tokenizer
    assert sum(_walks(tok, grammars, schema, keys=False)[1] for schema in SCHEMAS) > 0


CLOSED = {"type": "object", "properties": {"a": {"type": "array", "items": {
    "type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": False}}},
    "$defs": {"c": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"d": {"enum": [1]}}}]}}}


@pytest.mark.parametrize("schema,free", [
    (CLOSED, False), ({"type": "string"}, False), ({"enum": [{"a": 1}]}, False),
    ({**CLOSED, "additionalProperties": True}, True), ({"type": "array", "items": {}}, True),
    ({"type": "object", "properties": {"a": {}}}, True),  # `a` may be any object
    ({"$defs": {"c": {"type": "object"}}, "$ref": "#/$defs/c"}, True),
    ({"anyOf": [{"type": "string"}, {"type": ["object", "null"]}]}, True),
    ({"type": "array", "prefixItems": [{"type": "object", "patternProperties": {"^a$": {}}}]}, True),
    ({"type": "object", "properties": {"a": {"type": "object", "propertyNames": {"enum": ["x"]}}}}, True),
    ({"type": "array"}, True), ({"type": "object", "properties": {"x": {"type": "array"}}}, True),  # any items
    ({"type": "array", "items": {"type": "integer"}}, False)])
def test_keys_are_tracked_where_an_object_may_hold_keys_it_does_not_list(grammars, schema, free):
    """`free_keys`: only schemas whose objects may hold keys they do not list track them (the
    grammar writes each listed property once); the others' states walk the grammar alone."""
    assert free_keys(schema) == free
    assert (grammars.state(json.dumps(schema)).keys is not None) == free


def test_a_token_spanning_a_close_and_the_next_key_is_looked_ahead():
    """Tokens that close a value, a key or an inner object and begin a key of the object around
    it are refused where that key can only end as a held one."""
    state, ids = char_grammar_state({"type": "object", "propertyNames": {"const": "a"},
                                     "additionalProperties": {"type": "integer"}}, ['": 1, "'])
    state.advance([ids[c] for c in '{"a'])  # the first key: closing it and beginning another
    assert not state.push(ids['": 1, "']) and state.push(ids['"'])
    state, ids = char_grammar_state({"type": "object", "propertyNames": {"enum": ["a", "b"]},
                                     "additionalProperties": {"type": "object"}}, ['}, "'])
    state.advance([ids[c] for c in '{"a": {}, "b": {'])
    assert not state.push(ids['}, "']) and state.push(ids["}"])  # the inner object closes (taken)
    assert not state.push(ids[","]) and state.push(ids["}"])  # then the outer


def test_the_lookahead_stays_bounded_and_weighs_each_token_alone():
    """A key pattern without bound (`a+c`) beside a held key (`b`): the walk along `a...` stops
    at its depth (no recursion error), and `b` is still looked at and refused; a token that ends
    a value and begins a held key (`1, "`) is refused where the value's own digit is allowed."""
    state, ids = char_grammar_state({"type": "object", "propertyNames": {"pattern": "^(b|a+c)$"}}, [])
    state.advance([ids[c] for c in '{"b": 1'])
    assert state.push(ids[","]) and state.push(ids[" "]) and state.push(ids['"'])
    assert not state.push(ids["b"]) and state.push(ids["a"])
    state, ids = char_grammar_state({"type": "object", "propertyNames": {"enum": ["a"]},
                                     "additionalProperties": {"type": "integer"}}, ['1, "'])
    state.advance([ids[c] for c in '{"a": '])
    assert not state.push(ids['1, "']) and state.push(ids["1"]) and state.push(ids["}"])
