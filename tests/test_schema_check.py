"""A request's JSON schema before it becomes a grammar (`spec.schema_check`, `Grammars.compile`):
what the grammar would drop, what costs too much to compile, what no document satisfies and
what xgrammar fails on is refused by name and place, over HTTP as a 400 naming
`response_format`; the keyword lists match what the installed xgrammar really enforces."""

from __future__ import annotations

import json

import pytest
import requests
import xgrammar

from conftest import serve_in_thread
from metrale.runtime.errors import ConfigError
from metrale.runtime.serving.http_guard import ServerLimits
from metrale.runtime.serving.server import create_app
from metrale.runtime.serving.service import EngineGenerator
from metrale.runtime.spec.config import SpeculativeConfig
from metrale.runtime.spec.schema_check import FORMATS, IGNORED, MAX_PROPERTIES, MAX_REPEAT, MAX_REPEATS, check_shape

REFUSED = [
    ({"type": "string", "pattern": "[a-z]{1,15000}"}, "$.pattern: the quantifier {1,15000} repeats 15000"),
    ({"type": "string", "pattern": "^[A-Za-z0-9]{1,150}$"}, "at most 128"),
    ({"type": "string", "pattern": "^(?=a)a+$"}, "$.pattern: lookahead"),
    ({"type": "string", "minLength": -1}, "$.minLength: a whole number of at least 0, got -1"),
    ({"type": "array", "minItems": 5, "maxItems": 2}, "minItems 5 is greater than maxItems 2"),
    ({"type": "integer", "minimum": float("nan")}, "NaN or Infinity"),
    ({"anyOf": []}, "$.anyOf: an empty list"),
    ({"enum": []}, "$.enum: a non-empty list"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "$.allOf: 2 subschemas"),
    ({"not": {"type": "string"}}, "$.not: this keyword is not enforced"),
    ({"type": "object", "properties": {"a": {"type": "string", "if": {"const": "x"}}}},
     "$.properties.a.if: this keyword is not enforced"),
    ({"type": "string", "format": "bogus"}, "$.format: 'bogus' is not enforced"),
    ({"type": "number", "multipleOf": 0.1}, "$.multipleOf: enforced for"),
    ({"$ref": "http://example.com/s.json"}, "$.$ref: only references inside the schema"),
    ({"type": "object", "properties": {}, "required": ["zz"]}, "$.required: names 'zz'"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_PROPERTIES + 1)}},
     f"more than {MAX_PROPERTIES} properties"),
    ({"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {
        "type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {
            "type": "array", "items": {"type": "array", "items": {"type": "array", "items": {}}}}}}}}}}}},
     "nest 11 deep; at most 10"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,128}$"} for i in range(MAX_REPEATS // 128 + 1)}},
     f"repeat more than {MAX_REPEATS} times in all"),
    ({"type": "object", "properties": "x"}, "$.properties: an object of subschemas"),
    ([1, 2], "$: a schema is a JSON object, got a list"),
]


@pytest.mark.parametrize("schema,words", REFUSED, ids=[w[:30] for _, w in REFUSED])
def test_the_shape_check_refuses_by_name_and_place(schema, words):
    with pytest.raises(ConfigError) as e:
        check_shape(schema)
    assert words in str(e.value)


def test_the_shape_check_passes_what_the_grammar_enforces():
    check_shape({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12, "pattern": f"^[a-z]{{1,{MAX_REPEAT}}}$"},
        "when": {"type": "string", "format": "date"},
        "n": {"type": "integer", "multipleOf": 3, "minimum": 0},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 0, "maxItems": 3},
        "pick": {"anyOf": [{"type": "null"}, {"allOf": [{"enum": ["a", "b"]}]}]}},
        "required": ["name"], "additionalProperties": False,
        "$defs": {"tag": {"type": "string", "description": "{not a quantifier: \\{1,999}"}}})


# a character-level vocabulary: a document is its characters, one token each, then the end
_CHARS = [chr(i) for i in range(32, 127)]


@pytest.fixture(scope="module")
def compiler():
    info = xgrammar.TokenizerInfo(["<end>", *_CHARS], xgrammar.VocabType.RAW, vocab_size=len(_CHARS) + 1,
                                  stop_token_ids=[0])
    return xgrammar.GrammarCompiler(info)


def _accepts(compiler, schema: dict, doc: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    return all(matcher.accept_token(1 + _CHARS.index(c)) for c in doc) and matcher.accept_token(0)


# per refused keyword: a schema using it, and a document that breaks it but not the rest
BROKEN = {
    "not": ({"type": "string", "not": {"const": "a"}}, '"a"'),
    "if": ({"type": "string", "if": {"const": "a"}, "then": {"minLength": 3}}, '"a"'),
    "then": ({"type": "string", "then": {"minLength": 3}}, '"a"'),
    "else": ({"type": "string", "if": {"const": "b"}, "else": {"minLength": 3}}, '"a"'),
    "dependentSchemas": ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": "x"}'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": "x"}'),
    "dependencies": ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                      "dependencies": {"a": ["b"]}}, '{"a": "x"}'),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]"),
    "minContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "minContains": 2}, "[1, 1]"),
    "maxContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "maxContains": 1}, "[3, 3]"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
}


@pytest.mark.parametrize("keyword", IGNORED)
def test_each_refused_keyword_is_one_the_grammar_drops(compiler, keyword):
    """A document that breaks the keyword still passes the grammar: refusing it is right (if
    xgrammar starts enforcing one, this fails and the keyword can be let through)."""
    schema, doc = BROKEN[keyword]
    assert _accepts(compiler, schema, doc)


def test_what_passes_is_enforced(compiler):
    for fmt in FORMATS:
        assert not _accepts(compiler, {"type": "string", "format": fmt}, '"x y%"'), fmt
        assert _accepts(compiler, {"type": "string"}, '"x y%"')
    assert not _accepts(compiler, {"type": "integer", "multipleOf": 3}, "4")
    assert not _accepts(compiler, {"allOf": [{"type": "string", "minLength": 3}]}, '"a"')
    assert not _accepts(compiler, {"type": "string", "pattern": f"^a{{{MAX_REPEAT}}}$"}, '"a"')
    # past the limit the compiler fails outright, deep inside
    with pytest.raises(RuntimeError):
        compiler.compile_json_schema(json.dumps({"type": "string", "pattern": f"^a{{{MAX_REPEAT + 1}}}$"}))


def test_a_schema_the_grammar_cannot_enforce_is_a_400_before_generation(tiny_engine):
    """Over HTTP, each kind of refusal is a 400 naming `response_format` in a few words of its
    own (xgrammar's log prefix, source file and failed check cut away), both endpoints; what
    no document satisfies (a reference to itself) is found by compiling it; a good schema
    beside them is answered."""
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True))
    cases = [({"type": "string", "pattern": "[a-z]{1,15000}"}, "at most 128"),
             ({"$ref": "#"}, "no JSON document satisfies it"),
             ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
              "no JSON document satisfies it"),
             ({"type": "objectx"}, 'Unsupported type "objectx"'),
             ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is greater than maxLength 2"),
             ({"not": {"type": "string"}}, "$.not")]
    with serve_in_thread(create_app(gen, ServerLimits())) as base:
        for chat in (False, True):
            for schema, words in cases:
                fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
                body = ({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}) | {
                    "max_tokens": 4, "response_format": fmt}
                r = requests.post(base + ("/v1/chat/completions" if chat else "/v1/completions"),
                                  json=body, timeout=60)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == "response_format" and words in err["message"], err
                assert ".cc:" not in err["message"] and "Check failed" not in err["message"]
                assert len(err["message"]) < 400
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "^[a-z]{1,100}$"}}, "required": ["a"]}}}
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 40, "temperature": 0, "response_format": fmt})
        assert r.status_code == 200, r.text
