"""A schema's `pattern`s as the grammar enforces them (`spec.pattern_grammar`,
`schema_patterns.for_grammar`): through xgrammar's regex converter, not the automaton its JSON
schema compiler builds (which mistranslates quantifiers and alternatives over groups), with
classes holding only what a JSON string holds unescaped and what both regex dialects match."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import xgrammar

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.grammar import Grammars, compile_schema
from metrale.runtime.spec.schema_check import check_shape

# one token per character: printable ASCII and a few the dialects read differently
_CHARS = [chr(i) for i in range(32, 127)] + ["é", "٣", "\u00a0", "\ufeff", "\x85", "\u2028"]


@pytest.fixture(scope="module")
def compiler():
    info = xgrammar.TokenizerInfo(["<end>", *_CHARS], xgrammar.VocabType.RAW, vocab_size=len(_CHARS) + 1,
                                  stop_token_ids=[0])
    return xgrammar.GrammarCompiler(info)


def _accepts(compiled, doc: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiled)
    return all(matcher.accept_token(1 + _CHARS.index(c)) for c in doc) and matcher.accept_token(0)


def _ours(compiler, schema: dict):
    check_shape(schema)
    return compile_schema(compiler, json.dumps(schema))


def _string(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


# a pattern, a string xgrammar's automaton accepts though the pattern does not match it, and one
# the pattern matches
MISREAD = [
    (r"^(ab*)?$", "b", "abb"),
    (r"^(0|[1-9][0-9]*)(\.[0-9]+)?$", "01", "10.5"),
    (r"^(?:ab{0,2}|a)$", "abbb", "abb"),
    (r"^(a{2,}|b){1,}$", "bba", "baab"),
    (r"^(b(a|)|b){2}$", "bbaa", "bab"),
    (r"^((ab*)?c)?d$", "bcd", "abcd"),
]


@pytest.mark.parametrize("pattern,wrong,right", MISREAD)
def test_patterns_the_automaton_misreads_are_enforced(compiler, pattern, wrong, right):
    """xgrammar's own JSON schema grammar accepts a string the pattern does not match (if a
    version stops doing so, the first assertion fails and the detour can be reconsidered); the
    grammar metrale compiles refuses it and accepts a matching one, as a value and as a key."""
    assert not re.search(pattern, wrong) and re.search(pattern, right)
    theirs = compiler.compile_json_schema(json.dumps(_string(pattern)), any_whitespace=False)
    assert _accepts(theirs, json.dumps(wrong))
    ours = _ours(compiler, _string(pattern))
    assert not _accepts(ours, json.dumps(wrong))
    assert _accepts(ours, json.dumps(right))
    keyed = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}
    assert not _accepts(_ours(compiler, keyed), json.dumps({wrong: 1}))
    assert _accepts(_ours(compiler, keyed), json.dumps({right: 1}))


def _random_pattern(r: random.Random, depth: int) -> str:
    def atom(d: int) -> str:
        if d <= 0 or r.random() < 0.5:
            return r.choice(["a", "b", "0", "[ab]", "[^a]", "[a-b]", r"\d", ".", r"\w", r"\D", r"\S"])
        return r.choice(["(", "(?:"]) + alternation(d - 1) + ")"

    def quantifier() -> str:
        q = r.choice(["", "", "", "?", "*", "+", "{2}", "{0,1}", "{1,}", "{0,2}", "{1,3}", "{0,}", "{2,}"])
        return q + ("?" if q and r.random() < 0.15 else "")

    def alternation(d: int) -> str:
        return "|".join("".join(atom(d) + quantifier() for _ in range(r.randint(1, 3)))
                        for _ in range(r.choice([1, 1, 2])))
    body = alternation(depth)
    return f"^({body})$" if r.random() < 0.7 else body


def test_random_patterns_accept_exactly_their_matches(compiler):
    """Property: for seeded random patterns (groups, alternatives, every quantifier, lazy ones,
    classes and class escapes), the strings of up to 3 characters over a small alphabet that
    the grammar accepts are exactly those the pattern matches whole (xgrammar reads a pattern
    as a whole-string match, which implies JSON Schema's search)."""
    r = random.Random(0)
    strings = ["".join(t) for n in range(4) for t in itertools.product("ab0z", repeat=n)]
    checked = 0
    for _ in range(200):
        pattern = _random_pattern(r, 2)
        schema = {"type": "object", "properties": {"k": _string(pattern)}, "required": ["k"]}
        try:
            grammar = _ours(compiler, schema)
        except ConfigError as e:  # past the automaton's limits
            assert "its automaton passes" in str(e), (pattern, e)
            continue
        accepted = {s for s in strings if _accepts(grammar, '{"k": ' + json.dumps(s) + "}")}
        assert accepted == {s for s in strings if re.fullmatch(pattern, s)}, pattern
        checked += 1
    assert checked >= 180


# a pattern, strings its grammar accepts, and JSON texts of strings it refuses
CLASSES = [
    ("^.$", ["x", "é", "\u00a0"], ['"\\""', '"\\\\"', '"\\n"', '"\\u0041"', '"\u2028"']),
    ("^[^a]$", ["x", "é"], ['"a"', '"\\""', '"\\\\"']),
    ("^[ -~]$", [" ", "~", "x"], ['"\\""', '"\\\\"']),
    (r"^\d$", ["5"], ['"٣"', '"x"']),  # Python's \d matches the Arabic-Indic three; ECMA's does not
    (r"^\D$", ["x", "é"], ['"٣"', '"5"']),  # so neither \d nor \D is allowed to give it
    (r"^\w$", ["a", "_", "9"], ['"é"', '"-"']),
    (r"^\W$", ["-", " "], ['"é"', '"a"', '"\\""']),
    (r"^\s$", [" ", "\u00a0"], ['"\ufeff"', '"\x85"', '"\\t"']),  # one dialect's spaces each
    (r"^\S$", ["x", "é"], ['"\ufeff"', '"\x85"', '" "']),
    (r"^[^\d\s]$", ["x", "é"], ['"٣"', '"\x85"', '"5"', '" "']),
    (r"^[\w-]+$", ["a-b"], ['"a b"', '"é"']),
]


CLASSES += [
    ("^é.$", ["éx"], ['"é\\""', '"é٣x"']),  # characters past ASCII in the pattern
    (r"^é\D$", ["éx"], ['"é٣"']),
    (r"^[\^]$", ["^"], ['"\\""', '"a"']),  # a class whose first character is `^`
    (r"^[a-z^_]+$", ["a^_"], ['"A"']),
    (r"^[\u00e0-\u00ff]+$", ["é"], ['"a"']),  # code escapes, in a class and out of it
    (r"^\x41\u00e9$", ["Aé"], ['"a\u00e9"']),
    (r'^[^\n"]*$', ["a b"], ['"\\n"', '"\\""']),  # a negated class naming what JSON escapes anyway
]


@pytest.mark.parametrize("pattern,accepted,refused", CLASSES)
def test_classes_hold_what_a_json_string_holds_in_both_dialects(compiler, pattern, accepted, refused):
    grammar = _ours(compiler, _string(pattern))
    for s in accepted:
        assert re.search(pattern, s) and _accepts(grammar, json.dumps(s, ensure_ascii=False)), s
    for doc in refused:
        assert not _accepts(grammar, doc), doc


@pytest.mark.parametrize("pattern,words", [
    ("a^b", "an anchor (`^`) inside the pattern"),
    ("^a$b", "an anchor (`$`) inside the pattern"),
    ("(^a|b)", "an anchor (`^`) inside the pattern"),
    ("a++", "a possessive quantifier (`++`)"),
    (r"^(a)\1$", r"`\1` is not enforced"),
    (r"\bword", r"`\b` is not enforced"),
    (r"\p{L}", r"`\p` is not enforced"),
    ("[]a]", "a class opening with `]`"),
    (r"[\d-z]", r"a range from a class escape (`\d-z`)"),
    (r"[a-\w]", r"a range to a class escape (`a-\w`)"),
    ("[z-a]", "a range out of order (`z-a`)"),
    ("^a{3,2}$", "a quantifier's bounds out of order (`{3,2}`)"),
    ("^a{²}$", "a lone `{` is not enforced"),  # (a superscript two: no regex counts with it)
    ("[ab", "a class that is not closed"),
    (r"[^\S\s]", "a class no character of a JSON string matches"),
    (r"[\b]", "a class no character of a JSON string matches"),
    ("a\tb", "a pattern matching `\"`, `\\` or a control character (here U+0009)"),
    ("^(?<n>a)$", "`(?<` is not enforced: a group is `(...)` or `(?:...)`"),
    ("^(?P<n>a)$", "`(?P` is not enforced"),
    ("^(?i)a$", "`(?i` is not enforced"),
    ("^{{x}}$", "a lone `{` is not enforced"),
    ("^a)$", "a lone `)` is not enforced"),
    (r"^[\cJ]$", r"`\c` is not enforced"),
    ("a\\\tb", "a pattern matching `\"`, `\\` or a control character (here U+0009)"),  # an escaped TAB
    (r"^a\nb$", "a pattern matching `\"`, `\\` or a control character (here U+000A)"),
    (r'^a"$', "a pattern matching `\"`, `\\` or a control character (here U+0022)"),
])
def test_patterns_the_grammar_cannot_enforce_are_refused_by_place(pattern, words):
    with pytest.raises(ConfigError, match=re.escape(f"$.properties.p.pattern: {words}")):
        check_shape({"type": "object", "properties": {"p": _string(pattern)}})


def test_what_the_converter_reads_passes(compiler):
    """Top-level alternatives may anchor each branch; `(?:...)` is a group; an escaped
    punctuation character is itself; a code escape in a class is its character."""
    for pattern, s in [("^a|^b$", "b"), (r"^(?:\d+)-(\d+)$", "2026-12"), (r"^\$\.\/\{\}$", "$./{}"),
                       (r"^[\t0-9]$", "5"), (r"^(\w+\s?)+$", "ab cd")]:
        assert _accepts(_ours(compiler, _string(pattern)), json.dumps(s)), pattern


def test_a_class_of_many_ranges_keeps_a_part_of_them(compiler):
    """`\\W` written out is some 700 ranges, and a grammar's compile time grows with the ranges
    times the repetitions (`\\W{100}` took seconds): a class keeps at most MAX_CLASS_RANGES, those
    below U+0100 first, so it still allows ASCII's punctuation and nothing `\\W` does not match."""
    from metrale.runtime.spec.schema_patterns import MAX_CLASS_RANGES, for_grammar

    written = for_grammar(r"\W", "x")
    assert written.count("\\u") + sum(ord(c) > 0xFFFF for c in written) <= 2 * MAX_CLASS_RANGES
    grammar = _ours(compiler, _string(r"^\W{100}$"))
    assert _accepts(grammar, json.dumps("-" * 50 + " " * 50))
    assert not _accepts(grammar, json.dumps("-" * 99 + "a"))


def test_a_latin1_character_before_a_hex_digit_is_read_back_as_written(compiler):
    """A schema with a pattern is compiled from xgrammar's printed grammar, which writes "é1"
    as `\\xe91`; read back, that was U+0E91, so the grammar enforced another value."""
    schema = {"type": "object", "properties": {"k": {"enum": ["é1"]}, "p": {"type": "string", "pattern": "^x$"}},
              "required": ["k", "p"], "additionalProperties": False}
    grammar = _ours(compiler, schema)
    assert _accepts(grammar, '{"k": "é1", "p": "x"}') and not _accepts(grammar, '{"k": "é", "p": "x"}')


def test_characters_past_the_basic_plane_compile_without_xgrammar_warnings(compiler, capfd):
    """Past U+FFFF a class holds the characters themselves: xgrammar's reading of a schema's
    pattern (the rule `schema_grammar` replaces) warns at a `\\U` escape, once per compile."""
    grammar = _ours(compiler, _string("^[\U0001F600-\U0001F64F]+x$"))
    for text, ok in [("\U0001F600\U0001F64Fx", True), ("\U0001F650x", False), ("Ux", False)]:
        assert xgrammar.GrammarMatcher(grammar).accept_string(json.dumps(text, ensure_ascii=False)) == ok, text
    assert "not recognized" not in capfd.readouterr().err


def test_the_server_compiles_patterns_through_the_converter(tiny_engine):
    """`Grammars` (what a request's schema is compiled by) refuses the string xgrammar's own
    grammar would let the model write, and allows the one the pattern matches."""
    tok = tiny_engine.tokenizer
    schema = json.dumps({"type": "object", "properties": {"v": _string(MISREAD[1][0])}, "required": ["v"]})
    state = Grammars(tok, tiny_engine.target.config.vocab_size).state(schema)
    end = min(tok.eos_token_ids)
    for text, whole in [('{"v": "01"}', False), ('{"v": "10.5"}', True)]:
        ids = tok.encode(text) + [end]
        assert (state.valid_drafts(ids) == len(ids)) == whole, text


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}, "^x": {"type": "boolean"}}},
     "$.patternProperties: patterns with different subschemas are not enforced"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"(?<n>a)": {"type": "string"}}},
     "$.patternProperties: '(?<n>a)' matches property 'a'"),
    ({"type": "object", "properties": {"b": {"type": "boolean"}}, "patternProperties": {"^a": {"type": "integer"}},
      "additionalProperties": {"type": "string"}}, "$.patternProperties: not enforced beside `properties` where"),
    ({"type": "object", "properties": {"b": {"type": "boolean"}}, "patternProperties": {"^a": {"type": "integer"}},
      "additionalProperties": True}, "$.patternProperties: not enforced beside `properties` where"),
])
def test_pattern_properties_the_grammar_applies_its_own_way_are_refused(compiler, schema, words):
    """Each of these schemas' grammar accepts a document that breaks it (one pattern's subschema
    for a key several match; a listed property given a pattern's; a matching key given the
    additional properties' subschema)."""
    doc = '{"xy": 1}' if "different" in words else '{"a": 1}' if "(?<n>" in words else '{"a": "x"}'
    theirs = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    assert _accepts(theirs, doc)
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_shape(schema)


def test_pattern_properties_the_grammar_applies_as_written_pass(compiler):
    same = {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "^b": {"type": "integer"}}}
    assert _accepts(_ours(compiler, same), '{"a": 1, "b": 2}')
    closed = {"type": "object", "properties": {"b": {"type": "boolean"}}, "patternProperties": {"^a": {"type": "integer"}},
              "additionalProperties": False}
    assert _accepts(_ours(compiler, closed), '{"b": true, "a": 1}')
    assert not _accepts(_ours(compiler, closed), '{"a": "x"}')
