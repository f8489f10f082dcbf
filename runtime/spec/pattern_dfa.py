"""A string pattern's rules as a deterministic automaton, one rule per state.

xgrammar's regex converter writes a pattern's groups, alternatives and repeats as rules as they
stand (`(X)+` as `r ::= X r | X`), and its parser follows every way the text read so far splits
over them. Under `(a|\\S+.)+` each character may end an alternative, continue `\\S+` or start a
new repeat, and under `(\\w+\\s?)+` a word may be one repeat or several; the ways the parser
keeps open are paid at each of the vocabulary's tokens, at every mask. The language a pattern
matches has a deterministic automaton, and written as right-linear rules (`s ::= "" | [class] t
| ...`, one rule per state) it leaves the parser one way through every text.

`dfa_rules` builds it from a pattern as `schema_patterns.for_grammar` writes it (its classes
explicit, its groups plain, anchors only at its ends, which a grammar's full match makes moot):
- parsed to alternatives, sequences, repeats and classes;
- each class occurrence a position of the pattern's Glushkov automaton, with a bounded repeat
  written out (`x{2,4}` as `x x (x (x)?)?`);
- the subset construction over the classes' disjoint pieces (two pieces are one where every
  class holds both or neither), with the pieces that lead to the same state merged back into
  one class;
- the states no accepting state can be reached from are dropped (a text the pattern cannot
  complete is never started).

A pattern that parses past the limits here (positions, states, nesting) gets no rules (None) and
keeps the converter's."""

from __future__ import annotations

import bisect

from metrale.runtime.spec.schema_patterns import Ranges, _merged, _u

MAX_POSITIONS = 4096  # class occurrences with every bounded repeat written out
MAX_STATES = 1024  # states of the deterministic automaton
MAX_NESTING = 64  # groups within groups
HEX = frozenset("0123456789abcdefABCDEF")


class _Unwritten(Exception):
    """The pattern passes a limit here, or holds a form `for_grammar` does not write."""


def dfa_rules(name: str, pattern: str, prefix: str) -> list[str] | None:
    """EBNF rules matching `pattern` (`for_grammar`'s) as a deterministic automaton: rule `name`
    its start state, the others `prefix_1`, `prefix_2`, ...; None where it passes a limit here
    (the module docstring)."""
    try:
        tree = _Parser(pattern).parse()
        classes, follow, first, last, nullable = _glushkov(tree)
        moves, accepting = _determinized(classes, follow, first, last, nullable)
    except _Unwritten:
        return None
    live = _live(moves, accepting)
    if 0 not in live:  # (no text matches: the converter's rules say so its own way)
        return None
    names = {s: name if s == 0 else f"{prefix}_{k}" for k, s in enumerate(sorted(live))}
    rules = []
    for s in sorted(live):
        alts = ['""'] if accepting[s] else []
        for target, chars in sorted(moves[s].items()):
            if target in live:
                alts.append(f"{_written(chars)} {names[target]}")
        rules.append(f"{names[s]} ::= {' | '.join(alts)}")
    return rules


# The pattern's tree: ("chars", ranges) | ("cat", [node, ...]) | ("alt", [node, ...]) |
# ("rep", node, lo, hi or None)
EMPTY = ("cat", [])


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
                raise _Unwritten
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
        while True:
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
            node = ("rep", node, lo, hi)

    def _bounds(self) -> tuple[int, int | None]:
        end = self.text.find("}", self.i)
        parts = self.text[self.i + 1:end].split(",") if end > 0 else []
        if not 1 <= len(parts) <= 2 or not parts[0].isdigit() or not all(p.isdigit() for p in parts[1:] if p):
            raise _Unwritten
        self.i = end + 1
        lo = int(parts[0])
        return lo, lo if len(parts) == 1 else int(parts[1]) if parts[1] else None

    def _class(self) -> Ranges:
        self.i += 1
        if self._peek() == "^":  # (`for_grammar` writes none; read as the regex would)
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

    def build(node, depth: int):
        """(nullable, first, last) of `node` with fresh positions."""
        if depth > 2 * MAX_NESTING + 2:
            raise _Unwritten
        kind = node[0]
        if kind == "chars":
            if len(classes) >= MAX_POSITIONS:
                raise _Unwritten
            classes.append(node[1])
            follow.append(set())
            p = len(classes) - 1
            return False, {p}, {p}
        if kind == "alt":
            parts = [build(b, depth + 1) for b in node[1]]
            return (any(n for n, _, _ in parts), set().union(*(f for _, f, _ in parts)),
                    set().union(*(v for _, _, v in parts)))
        if kind == "cat":
            out = (True, set(), set())
            for child in node[1]:
                out = then(out, build(child, depth + 1))
            return out
        _, child, lo, hi = node
        out = (True, set(), set())
        for _ in range(lo):
            out = then(out, build(child, depth + 1))
        if hi is None:  # a loop over one more copy, optional
            n, f, v = build(child, depth + 1)
            for p in v:
                follow[p] |= f
            return then(out, (True, f, v))
        tail = (True, set(), set())  # (x (x (...)?)?)?, innermost first: one way to match k copies
        for _ in range(hi - lo):
            tail = then(build(child, depth + 1), tail)
            tail = (True, tail[1], tail[2])
        return then(out, tail)

    def then(a, b):
        """Sequence a then b: a's last positions are followed by b's first."""
        an, af, av = a
        bn, bf, bv = b
        for p in av:
            follow[p] |= bf
        return an and bn, af | bf if an else af, av | bv if bn else bv

    nullable, first, last = build(tree, 0)
    return classes, follow, first, last, nullable


def _determinized(classes, follow, first, last, nullable):
    """The subset construction: a state is the set of positions the last character may have
    matched (state 0, the start, none read yet). Returns each state's moves as {target: ranges}
    and whether each accepts."""
    cuts = sorted({b for ranges in classes for lo, hi in ranges for b in (lo, hi + 1)})
    pieces = [[k for lo, hi in ranges for k in range(bisect.bisect_left(cuts, lo), bisect.bisect_left(cuts, hi + 1))]
              for ranges in classes]  # each position's pieces (piece k: [cuts[k], cuts[k + 1]))
    states: list[frozenset[int] | None] = [None]
    index: dict[frozenset[int], int] = {}
    moves: list[dict[int, Ranges]] = []
    accepting: list[bool] = []
    for state in states:  # (the list grows as states are found)
        accepting.append(nullable if state is None else bool(state & last))
        after = first if state is None else set().union(*(follow[p] for p in state))
        by_piece: dict[int, set[int]] = {}
        for q in after:
            for k in pieces[q]:
                by_piece.setdefault(k, set()).add(q)
        out: dict[int, list[tuple[int, int]]] = {}
        for k, positions in by_piece.items():
            key = frozenset(positions)
            t = index.get(key)
            if t is None:
                if len(states) >= MAX_STATES:
                    raise _Unwritten
                t = index[key] = len(states)
                states.append(key)
            out.setdefault(t, []).append((cuts[k], cuts[k + 1] - 1))
        moves.append({t: _merged(r) for t, r in out.items()})
    return moves, accepting


def _live(moves, accepting) -> set[int]:
    """The states from which an accepting state can be reached."""
    back: dict[int, set[int]] = {}
    for s, out in enumerate(moves):
        for t in out:
            back.setdefault(t, set()).add(s)
    live = {s for s, a in enumerate(accepting) if a}
    todo = list(live)
    while todo:
        for s in back.get(todo.pop(), ()):
            if s not in live:
                live.add(s)
                todo.append(s)
    return live


def _written(chars: Ranges) -> str:
    return "[" + "".join(_u(lo) if lo == hi else f"{_u(lo)}-{_u(hi)}" for lo, hi in chars) + "]"
