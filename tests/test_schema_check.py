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
from metrale.runtime.spec.schema_check import (FORMATS, IGNORED, MAX_DEPTH, MAX_ENUM, MAX_EXPANSION, MAX_PROPERTIES,
                                                check_shape)
from metrale.runtime.spec.schema_patterns import MAX_REPEAT

def _nested(levels: int) -> dict:
    schema: dict = {}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def _deep_value(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


REFUSED = [
    ({"type": "string", "pattern": "[a-z]{1,15000}"}, "$.pattern: a quantifier repeats 15000 times"),
    ({"type": "string", "pattern": f"^[A-Za-z0-9]{{1,{MAX_REPEAT + 1}}}$"}, f"at most {MAX_REPEAT}"),
    ({"type": "string", "pattern": "^\\.{1,15000}$"}, "repeats 15000 times"),  # an escaped dot, repeated
    ({"type": "string", "pattern": "^\\\\$"}, "$.pattern: a pattern matching `\"`, `\\` or a control character"),
    ({"type": "string", "pattern": '^"$'}, "$.pattern: a pattern matching"),
    ({"type": "string", "pattern": "^a\\nb$"}, "$.pattern: a pattern matching"),
    ({"type": "integer", "multipleOf": 2, "maximum": 3}, "$.multipleOf: not enforced beside a bound on one side"),
    ({"const": 12345678901234567890}, "$: an integer past 2^53 in `enum` or `const`"),
    ({"enum": [[1, 2 ** 60]]}, "$: an integer past 2^53"),
    ({"type": "object", "properties": {"x\\y": {}}}, "$.properties: a name holding"),
    ({"type": "object", "properties": {"ab": {}}, "propertyNames": {"maxLength": 1, "type": "string"}},
     "$.propertyNames: not enforced beside `properties`"),
    ({"type": "object", "additionalProperties": False, "propertyNames": {"type": "string"}},
     "$.propertyNames: not enforced beside"),
    ({"type": "object", "properties": {"b": {}}, "patternProperties": {"^b$": {"type": "boolean"}}},
     "$.patternProperties: '^b$' matches property 'b'"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
     "$.minProperties: not enforced past the required properties"),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"]}, "minProperties": 2},
     "$.minProperties: not enforced past the required properties"),
    ({"type": "object", "patternProperties": {"^a{1,15000}$": {}}}, "$.patternProperties: a quantifier"),
    ({"type": "string", "pattern": "((x{128}){128}){2}"}, f"more than {MAX_EXPANSION} items in all"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,1000}$"}
                                       for i in range(MAX_EXPANSION // 1000 + 1)}}, "in all, the most allowed"),
    ({"type": "string", "pattern": "^(?=a)a+$"}, "$.pattern: lookahead"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2}, "$.minLength: not enforced beside `pattern`"),
    ({"type": "string", "format": "email", "maxLength": 20}, "$.maxLength: not enforced beside `format`"),
    ({"type": "string", "format": "email", "pattern": "^a"}, "$.pattern: not enforced beside `format`"),
    ({"type": "string", "nullable": True}, "$.nullable: OpenAPI's keyword"),
    ({"type": "array", "uniqueItems": True}, "$.uniqueItems: only false"),
    ({"type": "string", "minLength": -1}, "$.minLength: a whole number of at least 0, got -1"),
    ({"type": "array", "minItems": 5, "maxItems": 2}, "minItems 5 is greater than maxItems 2"),
    ({"type": "integer", "minimum": float("nan")}, "$.minimum: a finite number, got nan"),
    ({"type": "string", "default": float("inf")}, "NaN or Infinity"),
    ({"type": "array", "default": _deep_value(5000)}, "nests JSON too deeply"),
    ({"anyOf": []}, "$.anyOf: an empty list"),
    ({"enum": []}, "$.enum: a non-empty list"),
    ({"anyOf": [{"enum": list(range(MAX_ENUM))}, {"enum": [-1]}]}, f"more than {MAX_ENUM} enum values in all"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "$.allOf: 2 subschemas"),
    ({"not": {"type": "string"}}, "$.not: this keyword is not enforced"),
    ({"type": "object", "properties": {"a": {"type": "string", "if": {"const": "x"}}}},
     "$.properties.a.if: this keyword is not enforced"),
    ({"type": "number", "multipleOf": 0.1}, "$.multipleOf: enforced for integers only"),
    ({"$ref": "http://example.com/s.json"}, "$.$ref: only JSON pointers inside the schema"),
    ({"$defs": {"a": {"$anchor": "d", "type": "integer"}}, "$ref": "#d"}, "$.$ref: only JSON pointers"),
    ({"type": []}, "$.type: one of object, array, string, number, integer, boolean, null, or a non-empty"),
    ({"type": ["string", "text"]}, "$.type: one of object"),
    ({"type": "string", "format": 5}, "$.format: a format's name as a string, got 5"),
    ({"type": "integer", "minimum": 10 ** 400}, "$.minimum: a finite number"),
    ({"type": "integer", "maximum": 2 ** 63}, "$.maximum: from -9223372036854775808 to 9223372036854775807 on an integer"),
    ({"type": ["integer", "string"], "minimum": -1e19}, "$.minimum: from -9223372036854775808"),
    ({"type": "integer", "minimum": 1.5}, "$.minimum: a whole number on an integer, got 1.5"),
    ({"type": "integer", "multipleOf": 0}, "$.multipleOf: a number greater than 0, got 0"),
    ({"minItems": 1}, "$.minItems: not enforced in a subschema without `type`"),
    ({"type": "object", "properties": {}, "required": ["zz"]}, "$.required: names 'zz'"),
    ({"type": "object", "properties": ["a"], "required": ["a"]}, "$.properties: an object of subschemas, got a list"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_PROPERTIES + 1)}},
     f"more than {MAX_PROPERTIES} properties"),
    (_nested(MAX_DEPTH + 1), f"nest {MAX_DEPTH + 1} deep; at most {MAX_DEPTH}"),
    ([1, 2], "$: a schema is a JSON object, got a list"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "$: requires a subschema `false`"),
]
ENDLESS = "holds this subschema again inside it"
# schemas every document of which would hold itself again: refused, naming where the loop closes
UNFINISHABLE = [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "$"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
      "$ref": "#/$defs/n"}, "$.$defs.n"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "$"),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2}, "$"),
    ({"anyOf": [{"$ref": "#"}, {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}]}, "$"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "$.$defs.a"),
    # without `type`, as xgrammar reads them: an object, an array
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "$"),
    ({"items": {"$ref": "#"}, "minItems": 1}, "$"),
    ({"anyOf": [False, {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}]}, "$"),
    # a minimum of properties that only the schema itself can give
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "minProperties": 1}, "$"),
]
# ... and recursive ones a document can finish (an optional or nullable recursion, a base
# case), each with a document that does
FINISHABLE = [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, '{"a": {}}'),
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, '{"a": {"a": null}}'),
    ({"anyOf": [{"type": "string"}, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}]},
     '{"a": {"a": "x"}}'),
    ({"type": "array", "items": {"$ref": "#"}}, "[[], [[]]]"),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 1}, '["x"]'),
    ({"type": "object", "additionalProperties": {"$ref": "#"}}, '{"a": {}}'),
    ({"type": "object", "properties": {"a": {"$ref": "#"}, "b": {"type": "null"}}, "minProperties": 1},
     '{"b": null}'),

    ({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"]}}, "$ref": "#/$defs/node"},
     '{"v": 1, "kids": [{"v": 2, "kids": []}]}'),
]


@pytest.mark.parametrize("schema,words", REFUSED, ids=[w[:30] for _, w in REFUSED])
def test_the_shape_check_refuses_by_name_and_place(schema, words):
    with pytest.raises(ConfigError) as e:
        check_shape(schema)
    assert words in str(e.value)


@pytest.mark.parametrize("schema,place", UNFINISHABLE)
def test_a_schema_no_document_of_which_can_end_is_refused(compiler, schema, place):
    """Where every branch requires the schema again inside itself, the grammar takes ever deeper
    prefixes and never the end (the greedy walk below, taking the first character allowed, is
    never offered it), and the check refuses the schema, naming the subschema that closes the
    loop; a recursion some document can leave is let through, and its grammar can end."""
    with pytest.raises(ConfigError) as e:
        check_shape(schema)
    assert str(e.value).startswith(f"{place}: every document the schema's grammar allows {ENDLESS}")
    try:  # (xgrammar refuses some loops itself, at compile)
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    except RuntimeError:
        return
    mask = xgrammar.allocate_token_bitmask(1, len(_CHARS) + 1)
    for _ in range(300):
        matcher.fill_next_token_bitmask(mask)
        bits = mask[0].tolist()
        allowed = [i for i in range(len(_CHARS) + 1) if bits[i // 32] >> (i % 32) & 1]
        assert allowed and 0 not in allowed  # something to take, never the end
        assert matcher.accept_token(allowed[0])


@pytest.mark.parametrize("schema,doc", FINISHABLE)
def test_a_recursion_a_document_can_leave_passes(compiler, schema, doc):
    check_shape(schema)
    assert _accepts(compiler, schema, doc)


@pytest.mark.parametrize("schema", [
    {"type": "object", "required": None}, {"type": "array", "minItems": None}, {"$ref": None},
    {"$ref": "#/$defs/u/anyOf/²", "$defs": {"u": {"anyOf": [{"type": "null"}]}}},
    {"$ref": "#/$defs/u/anyOf/01", "$defs": {"u": {"anyOf": [{"type": "null"}]}}},
    {"$ref": "#/$defs/u/anyOf/" + "9" * 5000, "$defs": {"u": {"anyOf": [{"type": "null"}]}}}, {"$ref": "#/required"}])
def test_odd_values_reach_the_grammar_compiler_not_a_crash(schema):
    """What the finiteness check cannot read (nulls, references to what is no subschema, odd
    indices) it leaves to xgrammar's compile, which says what is wrong: no exception of its own."""
    check_shape(schema)


def test_which_subschemas_can_end_is_found_reading_each_once(monkeypatch):
    """A chain of 20,000 references, its end last among the definitions, and the same chain
    closed into a loop: both decided, the loop refused at its first link, each subschema's
    needs read once (a pass over the schema per link would read them 20,000 times each)."""
    from metrale.runtime.spec import schema_check

    reads = []
    clauses = schema_check._clauses
    monkeypatch.setattr(schema_check, "_clauses", lambda node, schema: reads.append(1) or clauses(node, schema))
    n = 20_000
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}, "minItems": 1} for i in range(n)}
    defs[f"d{n}"] = {"type": "null"}
    check_shape({"$defs": defs, "$ref": "#/$defs/d0"})
    assert len(reads) == 2 * n + 2  # each link and its items, the end, the root
    defs[f"d{n}"] = {"$ref": "#/$defs/d0"}
    with pytest.raises(ConfigError, match=r"^\$\.\$defs\.d0: every document"):
        check_shape({"$defs": defs, "$ref": "#/$defs/d0"})
    assert len(reads) == 2 * (2 * n + 2)


def test_the_shape_check_passes_what_the_grammar_enforces():
    """A schema as pydantic or OpenAI's structured outputs write them, with what says nothing
    (`then` without `if`, `uniqueItems: false`, `nullable: false`) and annotation formats."""
    check_shape({"type": "object", "properties": {
        "name": {"type": "string", "pattern": f"^[a-z]{{1,{MAX_REPEAT}}}$"},
        "code": {"type": "string", "pattern": "^\\{1,999\\}[{1,999}]$"},  # literal braces, a class
        "when": {"type": "string", "format": "date"},
        "secret": {"type": "string", "format": "password", "maxLength": 64, "then": {"minLength": 3}},
        "n": {"type": ["integer", "null"], "multipleOf": 3, "minimum": -2 ** 63, "maximum": 99, "format": "int64"},
        "x": {"type": "number", "minimum": 1e300, "maximum": 10 ** 300},
        "any": {"description": "no keyword of one type: any value"},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3, "uniqueItems": False},
        "pick": {"anyOf": [{"type": "null"}, {"allOf": [{"enum": ["a", "b"]}]}], "nullable": False}},
        "required": ["name"], "additionalProperties": False,
        "$defs": {"tag": {"type": "string", "maxLength": 8, "description": "{1,999}"}}})
    check_shape(_nested(MAX_DEPTH))


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
    "dependentSchemas": ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": "x"}'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": "x"}'),
    "dependencies": ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                      "dependencies": {"a": ["b"]}}, '{"a": "x"}'),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]"),
    "minContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "minContains": 2},
                    "[3, 1]"),
    "maxContains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "maxContains": 1},
                    "[3, 3]"),
}
# the same for what is refused only in some forms (`nullable`: a document it allows is refused)
BROKEN_FORMS = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", True),
    ({"type": "string", "nullable": True}, "null", False),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"a"', True),
    ({"type": "string", "format": "date", "maxLength": 3}, '"2020-01-01"', True),
    ({"type": "string", "format": "date", "pattern": "^1"}, '"2020-01-01"', True),
    ({"type": "number", "multipleOf": 0.5}, "0.3", True),
]


# beside a reference, a union, an allOf or values the grammar keeps that keyword alone: per
# combination, a schema, a document that breaks the keyword beside it but not the kept one, and
# the refusal's place
_DEFS = {"$defs": {"s": {"type": "string"}, "o": {"type": "object", "properties": {"a": {"type": "string"}}}}}
BROKEN_BESIDE = [
    ({"$ref": "#/$defs/s", "type": "integer", **_DEFS}, '"x"', "$.type", "$ref"),
    ({"$ref": "#/$defs/s", "maxLength": 1, **_DEFS}, '"xyz"', "$.maxLength", "$ref"),
    ({"$ref": "#/$defs/o", "properties": {"a": {"type": "string"}}, "required": ["a"], **_DEFS}, "{}",
     "$.properties", "$ref"),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}], "type": "integer"}, '"x"', "$.type", "anyOf"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}], "type": "integer"}, '"x"', "$.type", "oneOf"),
    ({"anyOf": [{"type": "object"}], "properties": {"a": {"type": "string"}}, "required": ["a"]}, "{}",
     "$.properties", "anyOf"),
    ({"allOf": [{"type": "string"}], "maxLength": 1}, '"xyz"', "$.maxLength", "allOf"),
    ({"allOf": [{"type": "string"}], "oneOf": [{"type": "integer"}, {"type": "string"}]}, "1", "$.allOf", "oneOf"),
    ({"enum": ["a", 1], "type": "string"}, "1", "$.type", "enum"),
    ({"const": 1, "type": "string"}, "1", "$.type", "const"),
    ({"enum": ["abc"], "maxLength": 1}, '"abc"', "$.maxLength", "enum"),
]


# per keyword of one type (`TYPED`): a subschema without `type` using it, a document breaking
# it, and the type under which the grammar enforces it
BROKEN_UNTYPED = {
    "minLength": ({"minLength": 3}, '"a"', "string"), "maxLength": ({"maxLength": 1}, '"ab"', "string"),
    "pattern": ({"pattern": "^a$"}, '"b"', "string"), "minimum": ({"minimum": 5}, "1", "integer"),
    "maximum": ({"maximum": 1}, "5", "integer"), "exclusiveMinimum": ({"exclusiveMinimum": 1}, "1", "integer"),
    "exclusiveMaximum": ({"exclusiveMaximum": 1}, "1", "integer"),
    "multipleOf": ({"multipleOf": 3}, "4", "integer"), "minItems": ({"minItems": 1}, "[]", "array"),  # (with `items`: see below)
    "maxItems": ({"maxItems": 0}, "[1]", "array"), "minProperties": ({"minProperties": 1}, "{}", None),
    "maxProperties": ({"maxProperties": 0}, '{"a": 1}', "object"),
    "patternProperties": ({"patternProperties": {"^a": {"type": "integer"}}}, '{"a": "x"}', "object"),
    "propertyNames": ({"propertyNames": {"type": "string", "maxLength": 1}}, '{"ab": 1}', "object"),
}


def test_every_keyword_of_one_type_is_listed():
    from metrale.runtime.spec.schema_check import TYPED

    assert sorted(BROKEN_UNTYPED) == sorted(TYPED)


@pytest.mark.parametrize("key", list(BROKEN_UNTYPED))
def test_a_keyword_of_one_type_without_type_is_refused(compiler, key):
    """Without `type` (and without object or array keywords, or one the grammar keeps alone),
    xgrammar reads a subschema as any value and drops such a keyword: the document breaking it
    passes, so the check refuses it. With its type (where xgrammar compiles it) it is enforced."""
    schema, doc, kind = BROKEN_UNTYPED[key]
    assert _accepts(compiler, schema, doc)
    with pytest.raises(ConfigError) as e:
        check_shape({"type": "object", "properties": {"v": schema}})
    assert str(e.value).startswith(f"$.properties.v.{key}: not enforced in a subschema without `type`")
    if kind is not None:  # (xgrammar's strict arrays take items only where `items` allows them)
        typed = {**schema, "type": kind} | ({"items": True} if kind == "array" else {})
        check_shape(typed)
        assert not _accepts(compiler, typed, doc)


@pytest.mark.parametrize("schema,doc,place,kept", BROKEN_BESIDE)
def test_what_the_grammar_drops_beside_a_kept_keyword_is_refused(compiler, schema, doc, place, kept):
    """The document breaking the keyword passes the grammar (if xgrammar starts enforcing the
    pair, this fails and the pair can be let through), and the check refuses the keyword."""
    assert _accepts(compiler, schema, doc)
    with pytest.raises(ConfigError) as e:
        check_shape(schema)
    assert str(e.value).startswith(f"{place}: not enforced beside `{kept}`")


def test_annotations_and_values_own_types_pass_beside_a_kept_keyword():
    """What pydantic and OpenAI's structured outputs write beside a reference, a union or values:
    annotations (keywords JSON Schema does not know among them), and a `type` every listed value
    has."""
    check_shape({"type": "object", "properties": {
        "m": {"$ref": "#/$defs/m", "description": "a model", "default": {"a": 1}, "title": "M"},
        "o": {"anyOf": [{"$ref": "#/$defs/m"}, {"type": "null"}], "default": None, "title": "O"},
        "d": {"oneOf": [{"$ref": "#/$defs/m"}], "discriminator": {"propertyName": "a"}, "x-order": 2},
        "e": {"enum": ["a", "b"], "type": "string", "title": "E", "description": "an enum"},
        "n": {"enum": [1, 2.0, None], "type": ["integer", "null"]},
        "c": {"const": "x", "type": "string"},
        "w": {"allOf": [{"$ref": "#/$defs/m"}], "description": "wrapped", "format": "int64"}},
        "$defs": {"m": {"type": "object", "properties": {"a": {"type": "integer"}}}}})


@pytest.mark.parametrize("keyword", IGNORED)
def test_each_refused_keyword_is_one_the_grammar_drops(compiler, keyword):
    """A document that breaks the keyword still passes the grammar: refusing it is right (if
    xgrammar starts enforcing one, this fails and the keyword can be let through)."""
    schema, doc = BROKEN[keyword]
    assert _accepts(compiler, schema, doc)
    with pytest.raises(ConfigError):
        check_shape(schema)


@pytest.mark.parametrize("schema,doc,passes", BROKEN_FORMS)
def test_each_refused_form_is_one_the_grammar_drops(compiler, schema, doc, passes):
    assert _accepts(compiler, schema, doc) == passes
    with pytest.raises(ConfigError):
        check_shape(schema)


def test_what_passes_is_enforced(compiler):
    for fmt in FORMATS:
        assert not _accepts(compiler, {"type": "string", "format": fmt}, '"x y%"'), fmt
        assert _accepts(compiler, {"type": "string"}, '"x y%"')
    assert not _accepts(compiler, {"type": "integer", "multipleOf": 3}, "4")
    assert not _accepts(compiler, {"type": ["integer", "null"], "multipleOf": 3}, "4")
    assert not _accepts(compiler, {"type": "string", "pattern": "^[a-z]+$"}, '"A"')
    assert not _accepts(compiler, {"type": "string", "maxLength": 2}, '"abc"')
    assert not _accepts(compiler, {"type": "string", "format": "password", "maxLength": 2}, '"abc"')
    assert not _accepts(compiler, {"allOf": [{"type": "string", "minLength": 3}]}, '"a"')
    assert not _accepts(compiler, {"type": "string", "pattern": f"^a{{{MAX_REPEAT}}}$"}, '"a"')
    # as OpenAI's strict mode: listed properties or items, and no others unless the schema says so
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not _accepts(compiler, listed, '{"a": 1, "b": 1}')
    assert _accepts(compiler, {**listed, "additionalProperties": True}, '{"a": 1, "b": 1}')
    assert _accepts(compiler, {"type": "object"}, '{"b": 1}')
    assert not _accepts(compiler, {"type": "array", "prefixItems": [{"type": "integer"}]}, "[1, 2]")
    assert _accepts(compiler, {"type": "array", "prefixItems": [{"type": "integer"}], "items": True}, "[1, 2]")
    assert _accepts(compiler, {"type": "string", "pattern": f"^a{{{MAX_REPEAT}}}$"}, '"' + "a" * MAX_REPEAT + '"')


def test_xgrammars_refusals_lose_their_log_prefix():
    from metrale.runtime.spec.grammar import refusal

    logged = RuntimeError("[16:04:19] /project/cpp/json_schema_converter.cc:4944: Unsupported type \"foo\"\n")
    assert refusal(logged) == 'Unsupported type "foo"'
    failed = RuntimeError("[16:04:19] /project/cpp/grammar_functor.cc:3567: Check failed: (x.has_value()) is false:\n")
    assert refusal(failed) == "xgrammar could not compile it"
    assert len(refusal(RuntimeError("y" * 1000))) == 200


def test_a_schema_the_grammar_cannot_enforce_is_a_400_before_generation(tiny_engine):
    """Over HTTP, each kind of refusal is a 400 naming `response_format` in a few words of its
    own (xgrammar's log prefix, source file and failed check cut away), both endpoints; a good
    schema beside them is answered. Behind the shape check, a grammar that lets no token start
    a document (a union of only a reference to itself, which the shape check refuses first) is
    found by compiling it."""
    from metrale.runtime.spec.grammar import check_schema

    with pytest.raises(ConfigError, match="no token can start a document"):
        check_schema('{"anyOf": [{"$ref": "#"}]}')
    gen = EngineGenerator(tiny_engine, SpeculativeConfig.from_flags(dflash=True))
    cases = [({"type": "string", "pattern": "[a-z]{1,15000}"}, f"at most {MAX_REPEAT}"),
             ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, ENDLESS),
             ({"type": "integer", "minimum": 5, "maximum": 3}, "Invalid range"),
             ({"type": "objectx"}, "$.type: one of object, array"),
             ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is greater than maxLength 2"),
             ({"not": {"type": "string"}}, "$.not"),
             ({"type": "object", "properties": {"name": {"maxLength": 2}}}, "$.properties.name.maxLength"),
             ({"type": "string", "format": 5}, "$.format: a format's name"),
             ({"type": "integer", "minimum": 10 ** 400}, "$.minimum: a finite number")]
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


def _vocabulary_check(grammars, schema: str) -> str | None:
    """What the server refused before its check compiled over the bytes: the schema compiled
    over the model's vocabulary, and no token of it allowed first."""
    import torch

    try:
        if grammars.state(schema).masked(torch.zeros(grammars.vocab_size)).isinf().all():
            return "no token can start a document it allows"
    except ConfigError as e:
        return str(e)
    return None


def test_the_check_over_the_bytes_refuses_what_the_vocabulary_refuses(tiny_engine, monkeypatch):
    """Property: the server's check (`check_schema`, compiled over the 256 single bytes) refuses
    a schema, in the same words, exactly where compiling it over the model's vocabulary and
    finding no token to start a document refuses it: for seeded random patterned schemas (those
    the shape check passes) and schemas xgrammar refuses, or whose grammar lets nothing start,
    or whose automaton is past its limits. It compiles over 257 ids, not the vocabulary's."""
    import random

    from test_pattern_grammar import _random_pattern

    from metrale.runtime.spec import grammar as grammar_module
    from metrale.runtime.spec.grammar import Grammars, check_schema

    grammars = Grammars(tiny_engine.tokenizer, tiny_engine.target.config.vocab_size)
    r = random.Random(3)
    schemas = [{"type": "object", "properties": {"k": {"type": "string", "pattern": _random_pattern(r, 2)},
                                                 "n": {"type": "integer"}}, "required": ["k"]} for _ in range(60)]
    schemas = [s for s in schemas if not _refused_by_shape(s)]
    schemas += [{"anyOf": [{"$ref": "#"}]}, {"type": "integer", "minimum": 5, "maximum": 3},
                {"type": "string", "pattern": "^(.|..){1,1000}$"}, {"type": "object"}, {"enum": ["a", 1, None]}]
    outcomes, compiled_over = [], []
    real = grammar_module.compile_schema

    def recorded(compiler, text: str):
        compiled = real(compiler, text)
        compiled_over.append(compiled.tokenizer_info.vocab_size)
        return compiled

    for schema in schemas:
        text = json.dumps(schema)
        want = _vocabulary_check(grammars, text)
        with monkeypatch.context() as m:
            m.setattr(grammar_module, "compile_schema", recorded)
            try:
                check_schema(text)
                got = None
            except ConfigError as e:
                got = str(e)
        assert got == want, text
        outcomes.append(got)
    assert outcomes.count(None) >= 40, outcomes
    assert {"no token can start a document it allows", "Invalid range: minimum greater than maximum"} < set(outcomes)
    assert any("its automaton passes" in str(o) for o in outcomes)
    assert set(compiled_over) == {257}


def _refused_by_shape(schema: dict) -> bool:
    try:
        check_shape(schema)
    except ConfigError:
        return True
    return False
