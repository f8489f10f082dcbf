"""The keys each open JSON object of a constrained document holds, so that no object takes a key
twice.

A grammar compiled from a JSON schema cannot say "a key this object does not hold yet": where an
object's other properties are free (`additionalProperties`, `patternProperties`, a bare
`{"type": "object"}`, `json_object`), it lets a document write `{"a": 1, "a": 2}`, which parsers
read as its last value. `KeyTracker` reads the document's bytes token by token beside the
grammar's matcher and says which tokens would close a key its object already holds, or can only
lead to one (`KeyTracker.dead_ends`); the request's `GrammarState` masks them out and refuses them
as drafts. Schemas whose objects hold only the properties they list need none of it (`free_keys`).

The document is read as the grammar writes it (valid JSON, so a lexer suffices): `{` and `[` open
a container, `}` and `]` close it, a string opened where an object expects a key is a key, `,`
in an object expects the next one. Keys compare as JSON reads them (`"a"` and `"\\u0061"` are one
key). Every token taken leaves its state on a stack, so the matcher's rollbacks undo it exactly.
"""

from __future__ import annotations

import json
from typing import NamedTuple, Protocol

QUOTE, BACKSLASH, COLON, COMMA = b'"'[0], b"\\"[0], b":"[0], b","[0]
LOOK_TOKENS = 64  # a state allowing more tokens than this begins keys of any spelling: some are new
LOOK_STATES = 64  # the states one token's lookahead visits at most; past them a new key counts as reachable
LOOK_TOTAL = 128  # the states all of one state's lookaheads visit at most
LOOK_DEPTH = 24  # the tokens a lookahead follows a key for; a key not closed by then counts as new
OPENS = {b"{"[0]: True, b"["[0]: False}  # the byte that opens a container: is it an object?
CLOSES = frozenset(b"}]")
STRUCTURE = frozenset(b'"\\{}[],:')


class Frame(NamedTuple):
    """An open container: an object (its keys so far, and whether a key comes next) or an array."""

    is_object: bool
    keys: frozenset = frozenset()
    key_next: bool = False


class At(NamedTuple):
    """Where the document stands after some bytes: its open containers, innermost last, and the
    string it is inside, if any (a key's bytes so far, escapes as written)."""

    frames: tuple[Frame, ...] = ()
    in_string: bool = False
    in_key: bool = False
    escaped: bool = False
    key: bytes = b""


def key_name(raw: bytes) -> str:
    """A key as JSON reads it, from its bytes between the quotes."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:  # (not a grammar's key; compared as written)
        return raw.decode("utf-8", "replace")


def read(at: At, data: bytes) -> tuple[At, bool]:
    """-> (the state after `data` from `at`, whether a key closed in `data` is one its object
    already held)."""
    frames, in_string, in_key, escaped, key = at
    repeated = False
    for c in data:
        if in_string:
            if c == QUOTE and not escaped:
                in_string = False
                if in_key:
                    name, top = key_name(key), frames[-1]
                    repeated |= name in top.keys
                    frames = frames[:-1] + (Frame(True, top.keys | {name}, False),)
                in_key, key = False, b""
                continue
            escaped = c == BACKSLASH and not escaped
            if in_key:
                key += bytes((c,))
        elif c == QUOTE:
            in_string, escaped, key = True, False, b""
            in_key = bool(frames) and frames[-1].key_next
        elif c in OPENS:
            frames += (Frame(OPENS[c], key_next=OPENS[c]),)
        elif c in CLOSES:
            frames = frames[:-1]
        elif c == COMMA and frames and frames[-1].is_object:
            frames = frames[:-1] + (frames[-1]._replace(key_next=True),)
        elif c == COLON and frames and frames[-1].is_object:
            frames = frames[:-1] + (frames[-1]._replace(key_next=False),)
    return At(frames, in_string, in_key, escaped, key), repeated


def _before_quote(data: bytes) -> bytes | None:
    """`data`'s bytes before its first unescaped quote, read inside a string (None: no such quote)."""
    escaped = False
    for n, c in enumerate(data):
        if c == QUOTE and not escaped:
            return data[:n]
        escaped = c == BACKSLASH and not escaped
    return None


class KeyVocab:
    """A tokenizer's tokens as `KeyTracker` looks them up. `vocab`: each id's bytes (b"" for a
    special token). Inside a key, a token closes it at its first unescaped quote, so the ids
    holding one are grouped by the bytes before it (`closing`): one key name per group decides
    them all. A token holding two quotes or more may open and close a key of its own (`several`):
    each is read whole."""

    def __init__(self, vocab: list[bytes]):
        self.vocab = vocab
        self.closing: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            head = _before_quote(b)
            if head is not None:
                self.closing.setdefault(head, []).append(i)
        self.quoted = [i for i, b in enumerate(vocab) if b.count(b'"')]
        # the ids holding a byte the lexer reads as more than text: any other leaves its state's
        # containers, string and key as they were (`dead_ends` reads none of them)
        self.structural = frozenset(i for i, b in enumerate(vocab) if any(c in STRUCTURE for c in b))
        self.several = [i for i in self.quoted if vocab[i].count(b'"') > 1]


class Walker(Protocol):
    """The grammar's matcher as a lookahead walks it."""

    def accept(self, token: int) -> bool: ...

    def back(self) -> None: ...  # undo the last accept

    def allowed(self) -> list[int]: ...  # the tokens the grammar allows at its state


class KeyTracker:
    """One document's `At` after each token it has taken (see the module docstring).

    A key that has begun may have no ending but keys its object holds: where a schema's keys come
    from a short list (a `propertyNames` enum, a pattern of a few words), `"a` of `{"a": 1, "a`
    can only close as "a", and the `,` before it only opens keys that are held once all are.
    `dead_ends` walks the grammar ahead from such a state to find the tokens that lead only there.
    Where a state allows many tokens, keys of any spelling can follow and it does not look."""

    def __init__(self, vocab: KeyVocab):
        self.vocab = vocab
        self.history = [At()]
        self._nodes = [0]  # each state's place in the tree of the token paths taken
        # (a place, a token) -> the place and state after it: a path taken again (a draft walked
        # once for its drafts and once for its verify rows) finds the same state object, so what
        # is kept for a state (`repeating`, the grammar state's refusals) holds for it
        self._after: dict[tuple[int, int], tuple[int, At]] = {}
        self._repeating: tuple[At, list[int]] | None = None

    def take(self, token: int) -> None:
        node = self._after.get((self._nodes[-1], token))
        if node is None:
            node = (len(self._after) + 1, read(self.history[-1], self.vocab.vocab[token])[0])
            self._after[(self._nodes[-1], token)] = node
        self._nodes.append(node[0])
        self.history.append(node[1])

    def drop(self, n: int) -> None:
        del self.history[len(self.history) - n:], self._nodes[len(self._nodes) - n:]

    def repeating(self) -> list[int]:
        """The ids that would close a key its object already holds, at the current state
        (remembered for it: a verify masks the same state more than once)."""
        at = self.history[-1]
        if self._repeating is None or self._repeating[0] is not at:
            self._repeating = (at, sorted(self._find(at)))
        return self._repeating[1]

    def may_refuse(self, token: int) -> bool:
        """Whether the keys may refuse `token` at the current state (`repeating` or `dead_ends`
        may hold it): False for a token of text (no quote, bracket, brace, comma, colon or
        backslash) that goes on with a value."""
        at = self.history[-1]
        if not at.frames:
            return False
        return token in self.vocab.structural or (not _in_value(at) and bool(at.frames[-1].keys))

    def dead_ends(self, allowed: list[int], walker: Walker) -> list[int]:
        """Among `allowed` (the grammar's tokens at the current state), those that close a key
        their object holds, or that end within a key of an object holding keys (or before one)
        from where every way on closes a key it holds before any other key and before the
        object closes; only where another of `allowed` does reach a new key or an object's end
        (tokens that go on with a value are no way out: where only they are left, a key is
        repeated rather than the value run on), or, for a token that goes on with the value
        before it ends it, where a token of the value alone is allowed. Only where `allowed` is
        short (`LOOK_TOKENS`); each token's walk visits at most `LOOK_STATES` states, and all of
        them `LOOK_TOTAL` (a grammar slow to mask costs a bounded number of masks)."""
        at = self.history[-1]
        if not at.frames or len(allowed) > LOOK_TOKENS:
            return []
        text_goes_on, total = _in_value(at), [LOOK_TOTAL]
        dead, spanning, values = [], [], 0
        for t in allowed:
            if text_goes_on and t not in self.vocab.structural:
                values += 1
                continue
            after, repeated = read(at, self.vocab.vocab[t])
            if repeated or (_in_keys(after) and self._walked(after, t, walker, total)):
                # one that ends the value it goes on with (`1, "`): the value's own tokens defer
                # the choice of a key to the state after it, where its object's end is weighed
                first = self.vocab.vocab[t][:1]
                starts_with_text = text_goes_on and first != b"" and first[0] not in STRUCTURE
                (spanning if starts_with_text else dead).append(t)
            elif _goes_on(at, after):
                values += 1
        if len(dead) + len(spanning) + values < len(allowed):
            return dead + spanning
        return spanning if values else []

    def _walked(self, after: At, token: int, walker: Walker, total: list[int]) -> bool:
        """`_only_held` on a budget of `LOOK_STATES` states, within what is left of `total`."""
        budget = [min(LOOK_STATES, total[0])]
        spent = budget[0]
        held = self._only_held(after, token, walker, budget)
        total[0] -= spent - budget[0]
        return held

    def _only_held(self, after: At, token: int, walker: Walker, budget: list[int], deep: int = 0) -> bool:
        """Whether, after `token` (which took the state to `after`, within or before a key of the
        object open at its depth), every way on closes a key that object holds first. A way
        longer than `LOOK_DEPTH` tokens, or past the budget, counts as reaching a new key."""
        if budget[0] <= 0 or deep >= LOOK_DEPTH or not walker.accept(token):
            return False
        budget[0] -= 1
        try:
            ways = walker.allowed()
            if len(ways) > LOOK_TOKENS:
                return False
            for t in ways:
                nxt, repeated = read(after, self.vocab.vocab[t])
                if not repeated and (_way(after, nxt, len(after.frames)) != "key"
                                     or not self._only_held(nxt, t, walker, budget, deep + 1)):
                    return False
            return True
        finally:
            walker.back()

    def _find(self, at: At) -> set[int]:
        v = self.vocab
        if not at.frames:
            return set()
        if at.in_key and at.escaped:  # (a key's escape open: its next byte is the key's)
            return {t for t in v.quoted if read(at, v.vocab[t])[1]}
        found = {t for t in v.several if read(at, v.vocab[t])[1]}
        keys = at.frames[-1].keys
        if at.in_key and keys:
            for head, ids in v.closing.items():
                if key_name(at.key + head) in keys:
                    found.update(ids)
        return found


def _in_value(at: At) -> bool:
    """`at` is not within its innermost object's next key (nor before it)."""
    return not (at.in_key or (not at.in_string and at.frames[-1].key_next))


def _in_keys(at: At) -> bool:
    """`at` is within a key of its innermost object, or before one, and that object holds keys."""
    return bool(at.frames) and bool(at.frames[-1].keys) and not _in_value(at)


def _goes_on(at: At, after: At) -> bool:
    """A token taking `at` to `after` goes on with a value: no container of `at` closed, no key
    closed in any of them, and `after` not before or within a key of `at`'s innermost object."""
    n = len(at.frames)
    return (len(after.frames) >= n and all(after.frames[i].keys == at.frames[i].keys for i in range(n))
            and not (len(after.frames) == n and not _in_value(after)))


def _way(at: At, after: At, depth: int) -> str:
    """What a token taking `at` to `after` does for the object open at `depth`: "out" (it closes
    the object or a key the object did not hold), "key" (it is in a key, or before one, still
    to close) or "value" (neither: a value goes on)."""
    if len(after.frames) < depth or after.frames[depth - 1].keys != at.frames[depth - 1].keys:
        return "out"
    if len(after.frames) == depth and (after.in_key or after.frames[-1].key_next):
        return "key"
    return "value"


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [schema, ...]
SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "unevaluatedItems",
              "additionalProperties", "unevaluatedProperties", "propertyNames")  # a schema
NARROWED = ("properties", "enum", "const", "$ref", "anyOf", "oneOf", "allOf")  # a node that is not any object
# (past its first: one that is not any array, with `items` or `prefixItems`)


def free_keys(schema) -> bool:
    """Whether a document of JSON schema `schema` (parsed) may hold an object whose keys the schema
    does not list, where a grammar could repeat one: a subschema with other properties allowed
    (`additionalProperties`, `unevaluatedProperties`, `patternProperties`, `propertyNames`) or that
    allows any object (`{}`, `{"type": "object"}` without `properties`). Conservative: what it
    cannot read counts as free. Where none is, every object's keys are listed properties, each of
    which the grammar writes once, and the keys need no tracking."""
    if schema is True:
        return True
    if not isinstance(schema, dict):
        return schema is not False
    if any(schema.get(k, False) is not False for k in ("additionalProperties", "unevaluatedProperties")) or \
            "patternProperties" in schema or "propertyNames" in schema:
        return True
    types = schema.get("type")
    objects, arrays = ((types is None or types == kind or (isinstance(types, list) and kind in types))
                       for kind in ("object", "array"))
    if objects and not any(k in schema for k in NARROWED):
        return True
    if arrays and not any(k in schema for k in ("items", "prefixItems", *NARROWED[1:])):
        return True  # items of any kind
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict) and any(free_keys(s) for s in schema[key].values()):
            return True
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list) and any(free_keys(s) for s in schema[key]):
            return True
    items = schema.get("items")
    if isinstance(items, list) and any(free_keys(s) for s in items):
        return True
    return any(free_keys(schema[k]) for k in SCHEMA_ONE if k in schema and not isinstance(schema[k], list)
               and not (k in ("additionalProperties", "unevaluatedProperties") and schema[k] is False))
