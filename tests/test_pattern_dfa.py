"""A string pattern's rules as its smallest deterministic automaton (`spec.pattern_dfa`): the
language the pattern matches, one way through every text, and a mask that allows only what the
matcher takes."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import torch
import xgrammar

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.grammar import compile_schema
from metrale.runtime.spec.pattern_dfa import _automaton, _PastLimit
from metrale.runtime.spec.schema_check import check_shape
from metrale.runtime.spec.schema_patterns import for_grammar

from conftest import char_grammar_state
from test_pattern_grammar import _random_pattern


def _run(automaton, text: str) -> bool:
    """Whether `automaton` (`_automaton`'s list) accepts `text`."""
    states = {s: (accepting, moves) for s, accepting, moves in automaton}
    state = automaton[0][0]
    for c in text:
        code = ord(c)
        state = next((t for t, ranges in states[state][1] if any(lo <= code <= hi for lo, hi in ranges)), None)
        if state is None:
            return False
    return states[state][0]


def test_the_automaton_matches_exactly_what_the_pattern_matches():
    """Property: for seeded random patterns (groups, alternatives, every quantifier, lazy ones,
    classes and class escapes, nested repeats), the strings of up to 4 characters over an
    alphabet both regex dialects read alike that the automaton accepts are exactly those the
    pattern matches whole."""
    r = random.Random(1)
    strings = ["".join(t) for n in range(5) for t in itertools.product("ab0z -", repeat=n)]
    built = 0
    for _ in range(150):
        pattern = _random_pattern(r, 2)
        automaton = _automaton(for_grammar(pattern, "x"))
        if not isinstance(automaton, list):  # past a limit (the converter's rules stand)
            continue
        compiled = re.compile(pattern)
        for s in strings:
            assert _run(automaton, s) == bool(compiled.fullmatch(s)), (pattern, s)
        built += 1
    assert built >= 135


@pytest.mark.parametrize("pattern,states", [
    (r"^(a|\S+)+$", 2),  # \S+: the start and one state after any run
    (r"^(\w+\s?)+$", 3),  # the start, after a word character, after a space
    (r"^[a-z]{1,3}$", 4),
    (r"^(ab|a)(b|)$", 4),  # a, ab, abb: the start, after a, after ab, after abb
    (r"^((a+)+)+$", 2),
    (r"^(a*)*$", 1),  # a*: one state, accepting, looping on a
])
def test_the_automaton_is_the_smallest(pattern, states):
    automaton = _automaton(for_grammar(pattern, "x"))
    assert len(automaton) == states
    for _, _, moves in automaton:  # deterministic: no character leads two ways
        ranges = sorted(r for _, rs in moves for r in rs)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges))


def _distinguishable(automaton, p: int, q: int) -> bool:
    """Whether some text takes states `p` and `q` to states of which one accepts and the other
    does not (a missing move: to a dead state that accepts nothing)."""
    states = {s: (accepting, moves) for s, accepting, moves in automaton}
    points = sorted({lo for _, _, moves in automaton for _, ranges in moves for lo, hi in ranges} |
                    {hi + 1 for _, _, moves in automaton for _, ranges in moves for lo, hi in ranges})

    def step(s, code):
        if s is None:
            return None
        return next((t for t, ranges in states[s][1] if any(lo <= code <= hi for lo, hi in ranges)), None)

    seen, todo = {(p, q)}, [(p, q)]
    while todo:
        a, b = todo.pop()
        if (a is not None and states[a][0]) != (b is not None and states[b][0]):
            return True
        for code in points:
            pair = (step(a, code), step(b, code))
            if pair not in seen:
                seen.add(pair)
                todo.append(pair)
    return False


def test_random_automata_are_the_smallest():
    """Property: in the automata of seeded random patterns (those of up to 40 states), every
    two states are told apart by some text, so no smaller automaton has the same language."""
    r = random.Random(3)
    checked = 0
    for _ in range(120):
        automaton = _automaton(for_grammar(_random_pattern(r, 2), "x"))
        if not isinstance(automaton, list) or len(automaton) > 40:
            continue
        ids = [s for s, _, _ in automaton]
        assert all(_distinguishable(automaton, a, b) for a, b in itertools.combinations(ids, 2))
        checked += 1
    assert checked >= 60


def test_a_pattern_met_again_is_written_once():
    """Three properties of one pattern: its automaton's rules once, the others naming them."""
    from metrale.runtime.spec.pattern_grammar import schema_grammar

    one = {"type": "string", "pattern": "^[a-z]{1,50}$"}
    text = schema_grammar(json.dumps({"type": "object", "properties": {k: one for k in "abc"}, "required": ["a", "b", "c"]}))
    alone = schema_grammar(json.dumps({"type": "object", "properties": {"a": one}, "required": ["a"]}))
    automaton = [line for line in alone.splitlines() if "[\\u0061-\\u007a]" in line]
    assert len(automaton) == 50 and [line for line in text.splitlines() if "[\\u0061-\\u007a]" in line] == automaton
    assert text.count(" ::= root_prop_0_1\n") == 2


# a vocabulary's multi-character tokens as a BPE one holds them: some end a string
EXTRA = ['ab', 'a"', '0"', 'b0', 'zz', '"}', 'a b', ' "', '00', 'ba"', '61"', '- ']


def test_the_mask_allows_only_what_the_matcher_takes():
    """Property: along seeded random walks under random patterns, at every state, every token
    the grammar's bitmask allows is one its matcher accepts, and the other way round
    (xgrammar's mask over the regex converter's rules for `^b\\d+[\\U0002fa1e-\\U0002ffff]x|b$`
    allows `61"` after `"b`, and its matcher refuses it)."""
    r = random.Random(2)
    walked = 0
    for n in range(40):
        pattern = _random_pattern(r, 2) if n else "^b\\d+[\U0002fa1e-\U0002ffff]x|b$"
        schema = {"type": "string", "pattern": pattern}
        check_shape(schema)
        try:
            state, ids = char_grammar_state(schema, EXTRA)
        except ConfigError:  # past the automaton's limits: refused
            continue
        for _ in range(8):
            if state.done:
                break
            bits = state.masked(torch.zeros(state.vocab_size)) == 0
            taken = []
            for token in range(1, state.vocab_size):
                ok = state.matcher.accept_token(token)
                if ok:
                    state.matcher.rollback(1)
                    taken.append(token)
                assert ok == bool(bits[token]), (pattern, token)
            if not taken:
                break
            state.advance([r.choice(taken)])
            walked += 1
    assert walked >= 150


def _compiled(pattern: str):
    info = xgrammar.TokenizerInfo(["<end>", *[chr(i) for i in range(32, 127)]], xgrammar.VocabType.RAW,
                                  vocab_size=96, stop_token_ids=[0])
    schema = {"type": "string", "pattern": pattern}
    check_shape(schema)
    return compile_schema(xgrammar.GrammarCompiler(info, max_threads=1), json.dumps(schema))


PAST = "its automaton passes 8,192 states or 1,000,000 steps to build"


@pytest.mark.parametrize("pattern,words", [
    ("^(.{1,8}){1,500}$", PAST),
    ("^(.|..){1,1000}$", PAST),
    ("^.{0,1000}.{0,1000}$", PAST),
    ("^((a?){1,1000}){1,4}$", PAST),
    ("^(a|b)*a(a|b){13}$", PAST),  # the 14th character from the end is `a`: 2^14 states
    ("(" * 65 + "a" + ")" * 65, "groups nest more than 64 deep"),
])
def test_a_pattern_past_the_limits_is_refused_by_pattern(pattern, words):
    """Past the automaton's limits the rules would be the regex converter's, which keep its
    parser tracking many ways through a text under such patterns: refused, naming the pattern."""
    with pytest.raises(ConfigError, match=re.escape(f"pattern {pattern!r}: {words}")):
        _compiled(pattern)


def test_the_steps_to_build_count_every_symbol():
    """A `.` position holds every symbol of the pattern, and 200 distinct characters before it
    make 200 symbols: each state's symbols count toward the step limit, where the construction
    stops."""
    pattern = "^(?:" + "|".join(chr(0x4E00 + i) for i in range(200)) + ")?.*x.{11}$"
    assert isinstance(_automaton(for_grammar(pattern, "x")), _PastLimit)


def test_a_form_no_regex_reads_is_refused_by_the_converter():
    for pattern in ("a**", "a{2}{3}"):
        with pytest.raises(ConfigError):
            _compiled(pattern)
