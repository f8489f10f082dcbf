"""The keys each open JSON object of a constrained document holds, so that no object takes a key
twice.

A grammar compiled from a JSON schema cannot say "a key this object does not hold yet": where an
object's other properties are free (`additionalProperties`, `patternProperties`, a bare
`{"type": "object"}`, `json_object`), it lets a document write `{"a": 1, "a": 2}`, which parsers
read as its last value. `KeyTracker` reads the document's bytes token by token beside the
grammar's matcher and says which tokens would close a key its object already holds; the request's
`GrammarState` masks them out and refuses them as drafts.

The document is read as the grammar writes it (valid JSON, so a lexer suffices): `{` and `[` open
a container, `}` and `]` close it, a string opened where an object expects a key is a key, `,`
in an object expects the next one. Keys compare as JSON reads them (`"a"` and `"\\u0061"` are one
key). Every token taken leaves its state on a stack, so the matcher's rollbacks undo it exactly.
"""

from __future__ import annotations

import json
from typing import NamedTuple

QUOTE, BACKSLASH, COLON, COMMA = b'"'[0], b"\\"[0], b":"[0], b","[0]
OPENS = {b"{"[0]: True, b"["[0]: False}  # the byte that opens a container: is it an object?
CLOSES = frozenset(b"}]")


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
        self.several = [i for i in self.quoted if vocab[i].count(b'"') > 1]


class KeyTracker:
    """One document's `At` after each token it has taken (see the module docstring)."""

    def __init__(self, vocab: KeyVocab):
        self.vocab = vocab
        self.history = [At()]
        self._repeating: tuple[At, list[int]] | None = None

    def take(self, token: int) -> None:
        self.history.append(read(self.history[-1], self.vocab.vocab[token])[0])

    def drop(self, n: int) -> None:
        del self.history[len(self.history) - n:]

    def repeats(self, token: int) -> bool:
        """Would `token` close a key its object already holds?"""
        at = self.history[-1]
        return bool(at.frames) and read(at, self.vocab.vocab[token])[1]

    def repeating(self) -> list[int]:
        """The ids that would close a key its object already holds, at the current state
        (remembered for it: a verify masks the same state more than once)."""
        at = self.history[-1]
        if self._repeating is None or self._repeating[0] is not at:
            self._repeating = (at, sorted(self._find(at)))
        return self._repeating[1]

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
