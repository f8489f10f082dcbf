"""A string pattern's rules as its smallest deterministic automaton, one rule per state.

xgrammar's regex converter writes a pattern's groups, alternatives and repeats as rules as they
stand (`(X)+` as `r ::= X r | X`), and its parser follows every way the text read so far splits
over them. Under `(a|\\S+.)+` each character may end an alternative, continue `\\S+` or start a
new repeat, and under `(\\w+\\s?)+` a word may be one repeat or several; the ways the parser
keeps open are paid at each of the vocabulary's tokens, at every mask. The language a pattern
matches has a deterministic automaton, and written as right-linear rules (`s ::= "" | [class] t
| ...`, one rule per state) it leaves the parser one way through every text.

`dfa_rules` builds it from a pattern as `schema_patterns.for_grammar` writes it (its classes
explicit, its groups plain, anchors only at its ends and around its top-level `|`, which a
grammar's full match makes moot):
- parsed to alternatives, sequences, repeats and classes;
- each class occurrence a position of the pattern's Glushkov automaton, with a bounded repeat
  written out (`x{2,4}` as `x x (x (x)?)?`);
- the subset construction over the pattern's symbols (the code points every class holds alike
  are one symbol);
- made the smallest by Hopcroft's refinement, without the states from which no text can be
  completed (a text the pattern cannot complete is never started), the symbols that lead from
  one state to the same state merged back into one class.

A pattern past the limits here (positions, states, the steps to build them) is refused: the
converter's rules are no way out, since under many such patterns (`.{0,1000}.{0,1000}`,
`(.|..){1,1000}`) they keep its parser tracking many ways through a text, and no shape of a
pattern tells those from the few it runs fast (`(a|b)*a(a|b){13}`).
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.schema_patterns import Ranges, _digits, _merged, class_text

MAX_POSITIONS = 4096  # class occurrences with every bounded repeat written out
MAX_STATES = 8192  # states of the deterministic automaton, before it is made the smallest
MAX_WORK = 1_000_000  # steps building the automaton: follow-set entries, then each state's positions and symbols
MAX_NESTING = 64  # groups within groups
HEX = frozenset("0123456789abcdefABCDEF")


class _Unwritten(Exception):
    """The pattern passes a limit here, or holds a form no regular expression reads (`a**`)."""


class _TooDeep(Exception):
    """The pattern's groups nest past MAX_NESTING."""


class _PastLimit(NamedTuple):
    """A pattern past the automaton's limits: its tree (None: its groups nest too deep to read)."""
    tree: tuple | None


def dfa_rules(name: str, pattern: str, prefix: str, where: str) -> list[str] | None:
    """EBNF rules matching `pattern` (`for_grammar`'s) as its smallest deterministic automaton:
    rule `name` its start state, the others `prefix_1`, `prefix_2`, ...; None where it holds a
    form no regular expression reads (`a**`) or matches no text, which the regex converter then
    refuses or writes its own way. ConfigError, naming `where`, where the automaton passes a
    limit here (the converter's rules for such a pattern can cost seconds a token)."""
    built = _automaton(pattern)
    if isinstance(built, _PastLimit):
        if built.tree is None:
            raise ConfigError(f"{where}: groups nest more than {MAX_NESTING} deep")
        raise ConfigError(f"{where}: its automaton passes {MAX_STATES:,} states or {MAX_WORK:,} steps "
                          "to build (as `(.|..){1,1000}` or `(a|b)*a(a|b){13}` do); bound its repeats "
                          "more tightly")
    if built is None:
        return None
    names = {s: name if k == 0 else f"{prefix}_{k}" for k, (s, _, _) in enumerate(built)}
    rules = []
    for s, accepting, moves in built:
        alts = ['""'] if accepting else []
        alts += [f"{class_text(chars)} {names[target]}" for target, chars in moves]
        rules.append(f"{names[s]} ::= {' | '.join(alts)}")
    return rules


@functools.lru_cache(maxsize=32)
def _automaton(pattern: str):
    """`pattern`'s (`for_grammar`'s) deterministic automaton, the states from which a text can
    be completed, start first: [(state, accepting, [(target, ranges), ...]), ...]; _PastLimit
    where it passes a limit; None where it holds a form not read here, or matches no text (the
    converter's rules then say so their own way)."""
    try:
        tree = _Parser(pattern).parse()
    except _Unwritten:
        return None
    except _TooDeep:
        return _PastLimit(None)
    try:
        built = _determinized(*_glushkov(tree))
    except _Unwritten:
        return _PastLimit(tree)
    return _minimized(*built) or None


# The pattern's tree: ("chars", ranges) | ("cat", [node, ...]) | ("alt", [node, ...]) |
# ("rep", node, lo, hi or None)


class _Parser:
    """`for_grammar`'s pattern text to its tree."""

    def __init__(self, text: str):
        self.text, self.i, self.depth = text, 0, 0

    def parse(self):
        tree = self._alternatives()
        if self.i != len(self.text):
            raise _Unwritten
        return tree

    def _alternatives(self):
        branches = [self._sequence()]
        while self._peek() == "|":
            self.i += 1
            branches.append(self._sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _sequence(self):
        items = []
        while self._peek() not in ("", "|", ")"):
            c = self._peek()
            if c in "^$":  # an anchor at an end (`for_grammar` allows no other)
                self.i += 1
                continue
            items.append(self._quantified(self._atom()))
        return ("cat", items)

    def _atom(self):
        c = self.text[self.i]
        if c == "(":
            self.i, self.depth = self.i + 1, self.depth + 1
            if self.depth > MAX_NESTING:
                raise _TooDeep
            inner = self._alternatives()
            if self._peek() != ")":
                raise _Unwritten
            self.i, self.depth = self.i + 1, self.depth - 1
            return inner
        if c == "[":
            return ("chars", self._class())
        if c in "*+?{}).":
            raise _Unwritten
        code = self._char()
        return ("chars", ((code, code),))

    def _quantified(self, node):
        c = self._peek()
        if c in ("*", "+", "?"):
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            self.i += 1
        elif c == "{":
            lo, hi = self._bounds()
        else:
            return node
        if self._peek() == "?":  # lazy: the same language
            self.i += 1
        if self._peek() in ("*", "+", "?", "{"):  # (a repeated quantifier: no regex reads it)
            raise _Unwritten
        return ("rep", node, lo, hi)

    def _bounds(self) -> tuple[int, int | None]:
        end = self.text.find("}", self.i)
        parts = self.text[self.i + 1:end].split(",") if end > 0 else []
        if not 1 <= len(parts) <= 2 or not _digits(parts[0]) or not all(_digits(p) for p in parts[1:] if p):
            raise _Unwritten
        self.i = end + 1
        lo = int(parts[0])
        return lo, lo if len(parts) == 1 else int(parts[1]) if parts[1] else None

    def _class(self) -> Ranges:
        self.i += 1
        if self._peek() == "^":  # (`for_grammar` writes no negated class)
            raise _Unwritten
        items = []
        while self._peek() not in ("]", ""):
            lo = hi = self._char()
            if self._peek() == "-" and self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._char()
            items.append((lo, hi))
        if self._peek() != "]" or not items:
            raise _Unwritten
        self.i += 1
        return _merged(items)

    def _char(self) -> int:
        """The code point at the cursor (a character, `\\uXXXX` or an escaped character)."""
        c = self.text[self.i]
        if c != "\\":
            self.i += 1
            return ord(c)
        digits = self.text[self.i + 2:self.i + 6]
        if self.text[self.i + 1:self.i + 2] == "u" and len(digits) == 4 and set(digits) <= HEX:
            self.i += 6
            return int(digits, 16)
        e = self.text[self.i + 1:self.i + 2]
        if not e or e.isalnum():
            raise _Unwritten
        self.i += 2
        return ord(e)

    def _peek(self) -> str:
        return self.text[self.i:self.i + 1]


def _glushkov(tree):
    """The tree's positions (each class occurrence, bounded repeats written out): their classes,
    each one's followers, the first and last positions and whether the empty text matches."""
    classes: list[Ranges] = []
    follow: list[set[int]] = []
    work = [0]  # positions added to follow sets

    def build(node):
        """(nullable, first, last) of `node` with fresh positions."""
        kind = node[0]
        if kind == "chars":
            if len(classes) >= MAX_POSITIONS:
                raise _Unwritten
            classes.append(node[1])
            follow.append(set())
            p = len(classes) - 1
            return False, {p}, {p}
        if kind == "alt":
            parts = [build(b) for b in node[1]]
            return (any(n for n, _, _ in parts), set().union(*(f for _, f, _ in parts)),
                    set().union(*(v for _, _, v in parts)))
        if kind == "cat":
            out = (True, set(), set())
            for child in node[1]:
                out = then(out, build(child))
            return out
        _, child, lo, hi = node
        out = (True, set(), set())
        for _ in range(lo):
            out = then(out, build(child))
        if hi is None:  # a loop over one more copy, optional
            n, f, v = build(child)
            link(v, f)
            return then(out, (True, f, v))
        first_tail, last_tail = set(), set()  # (x (x (...)?)?)?, built innermost first: one way to match k copies
        for _ in range(hi - lo):
            n, f, v = build(child)
            link(v, first_tail)
            first_tail = f | first_tail if n else f
            last_tail |= v
        return then(out, (True, first_tail, last_tail))

    def then(a, b):
        """Sequence a then b: a's last positions are followed by b's first."""
        an, af, av = a
        bn, bf, bv = b
        link(av, bf)
        return an and bn, af | bf if an else af, av | bv if bn else bv

    def link(last, first):
        work[0] += len(last) * len(first)
        if work[0] > MAX_WORK:
            raise _Unwritten
        for p in last:
            follow[p] |= first

    nullable, first, last = build(tree)
    return classes, follow, first, last, nullable


def _determinized(classes, follow, first, last, nullable):
    """The subset construction over the pattern's symbols (`_symbols`): a state is the set of
    positions the last character may have matched (state 0, the start, none read yet). Returns
    (each symbol's ranges, each state's target by symbol, -1 where none, whether each state
    accepts)."""
    symbol_ranges, symbols = _symbols(classes)
    states: list[frozenset[int] | None] = [None]
    index: dict[frozenset[int], int] = {}
    table: list[list[int]] = []
    accepting: list[bool] = []
    work = 0
    for state in states:  # (the list grows as states are found)
        accepting.append(nullable if state is None else bool(state & last))
        after = first if state is None else set().union(*(follow[p] for p in state))
        work += len(symbol_ranges) + sum(len(symbols[q]) for q in after) + (0 if state is None else len(state))
        if work > MAX_WORK:
            raise _Unwritten
        by_symbol: dict[int, set[int]] = {}
        for q in after:
            for k in symbols[q]:
                by_symbol.setdefault(k, set()).add(q)
        row = [-1] * len(symbol_ranges)
        for k, positions in by_symbol.items():
            key = frozenset(positions)
            t = index.get(key)
            if t is None:
                if len(states) >= MAX_STATES:
                    raise _Unwritten
                t = index[key] = len(states)
                states.append(key)
            row[k] = t
        table.append(row)
    return symbol_ranges, table, accepting


def _symbols(classes: list[Ranges]) -> tuple[list[Ranges], list[list[int]]]:
    """The pattern's alphabet as symbols: code points every class holds alike (all of them or
    none) are one symbol. Returns each symbol's ranges and each position's symbols."""
    distinct = sorted(set(classes))
    cuts = sorted({b for ranges in distinct for lo, hi in ranges for b in (lo, hi + 1)})
    members: list[list[int]] = [[] for _ in range(len(cuts))]  # the classes holding each piece
    for c, ranges in enumerate(distinct):  # (piece k: code points [cuts[k], cuts[k + 1]))
        for lo, hi in ranges:
            for k in range(bisect.bisect_left(cuts, lo), bisect.bisect_left(cuts, hi + 1)):
                members[k].append(c)
    symbol_of: dict[tuple[int, ...], int] = {}
    ranges_of: list[list[tuple[int, int]]] = []
    holds: list[list[int]] = [[] for _ in distinct]  # each class's symbols
    for k, held in enumerate(members[:-1]):
        if not held:
            continue
        key = tuple(held)
        if key not in symbol_of:
            symbol_of[key] = len(ranges_of)
            ranges_of.append([])
            for c in held:
                holds[c].append(symbol_of[key])
        ranges_of[symbol_of[key]].append((cuts[k], cuts[k + 1] - 1))
    which = {ranges: c for c, ranges in enumerate(distinct)}
    return [_merged(r) for r in ranges_of], [holds[which[ranges]] for ranges in classes]


def _minimized(symbol_ranges, table, accepting):
    """The smallest automaton of the same language, without the states no text can be completed
    from: [(block, accepting, [(target block, ranges), ...]), ...], the start's first; [] where
    no text matches. Hopcroft's refinement: the states (and a dead one, where a move is
    missing) are split by acceptance, then each block by whether a symbol leads into a block
    split off before, the smaller half of each split queued to split others."""
    n, k = len(table), len(symbol_ranges)
    moves = [[n if t < 0 else t for t in row] for row in table] + [[n] * k]  # state n: the dead one
    into = [[[] for _ in range(n + 1)] for _ in range(k)]  # into[a][t]: the states symbol a leads to t from
    for s, row in enumerate(moves):
        for a, t in enumerate(row):
            into[a][t].append(s)
    accepts = {s for s in range(n) if accepting[s]}
    blocks = [b for b in (accepts, set(range(n + 1)) - accepts) if b]
    block_of = [0] * (n + 1)
    for i, members in enumerate(blocks):
        for s in members:
            block_of[s] = i
    queue = {(i, a) for i in range(len(blocks)) for a in range(k)}
    while queue:
        splitter, a = queue.pop()
        leading = {s for t in blocks[splitter] for s in into[a][t]}
        touched: dict[int, set[int]] = {}
        for s in leading:
            touched.setdefault(block_of[s], set()).add(s)
        for i, part in touched.items():
            if len(part) == len(blocks[i]):
                continue
            rest = blocks[i] - part
            small, large = (part, rest) if len(part) <= len(rest) else (rest, part)
            blocks[i] = large
            blocks.append(small)
            for s in small:
                block_of[s] = len(blocks) - 1
            queue.update((len(blocks) - 1, b) for b in range(k))  # (the smaller half: enough either way)
    dead = block_of[n]
    if block_of[0] == dead:
        return []
    first_state: dict[int, int] = {}
    for s in range(n):
        first_state.setdefault(block_of[s], s)
    order = [block_of[0]] + sorted(set(first_state) - {block_of[0], dead})
    out = []
    for b in order:
        s = first_state[b]
        targets: dict[int, list[tuple[int, int]]] = {}
        for a, t in enumerate(moves[s]):
            if block_of[t] != dead:
                targets.setdefault(block_of[t], []).extend(symbol_ranges[a])
        out.append((b, accepting[s], [(t, _merged(r)) for t, r in sorted(targets.items())]))
    return out
