"""Structured output: a request's JSON schema as a token mask on the rows speculation verifies.

`Grammars` compiles schemas for one tokenizer with xgrammar (its compiler caches them), and
`GrammarState` is one request's matcher: the tokens it has emitted so far decide which tokens may
come next. Under speculation the target verifies rows [pending, d_1..d_k]; row i's mask is the
state after the emitted tokens and d_1..d_i, so each row is masked as plain constrained decoding
masks the row at that position, and greedy constrained speculation emits plain constrained
decoding's tokens. Drafts are walked through the matcher before they are verified: the first
draft the grammar refuses and every draft after it are dropped (a draft that breaks the grammar
is never verified, let alone accepted), and the matcher is rolled back to the emitted tokens
after every walk over drafts, so rejected drafts leave no trace in its state. Beside the grammar,
no object takes a key twice (`json_keys`), which a schema's grammar cannot say. An emitted token
is one the matcher takes (`pick`): xgrammar's bitmask can allow a token its matcher refuses, and
the row's choice is then made again without it.

Documents are written without free whitespace (xgrammar's `any_whitespace=False`: one space
after `,` and `:`), so a model cannot run out its budget in blanks between tokens.

Vocabulary: the tokenizer's byte-level BPE strings by id; its added tokens (chat markers, the
drafters' mask token) are special, never text; its EOS ids are the tokens that end a complete
document, the only ones allowed once the schema is satisfied. Ids past the tokenizer's
vocabulary (a model's padded embedding rows) are never allowed.
"""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import torch

from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.json_keys import KeyTracker, KeyVocab, free_keys
from metrale.runtime.spec.pattern_grammar import schema_grammar

# xgrammar is imported where a grammar is first made: its import loads its compiler's runtime,
# and most processes never constrain a request

CACHE_BYTES = 256 << 20  # compiled grammars kept for schemas seen again, least recently used out

CHECK_CACHE_BYTES = 64 << 20  # the admission check's compiled grammars (over 257 ids, small)

# `response_format: {"type": "json_object"}`: any JSON object
JSON_OBJECT = json.dumps({"type": "object"})


def refusal(e: Exception) -> str:
    """xgrammar's reason for refusing a schema, in its own words without its log prefix (time,
    source file and line, the failed check's expression), cut to a readable length."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    text = lines[-1] if lines else type(e).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # [12:00:00]
    text = re.sub(r"^\S+\.(cc|h):\d+:\s*", "", text)  # json_schema_converter.cc:4944:
    text = re.sub(r"^Check failed: \(.*\) is false:\s*", "", text).strip()
    if not text:  # a failed check with no words of its own
        return "xgrammar could not compile it"
    return text if len(text) <= 200 else text[:197] + "..."


def compile_schema(compiler, schema: str):
    """JSON schema `schema` (text) compiled by xgrammar `compiler` without free whitespace, its
    patterns through xgrammar's regex converter (`pattern_grammar`); ConfigError, in xgrammar's
    words, where it cannot be."""
    try:
        grammar = schema_grammar(schema)
        if grammar is not None:
            return compiler.compile_grammar(grammar)
        return compiler.compile_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConfigError(refusal(e)) from None


def check_schema(schema: str) -> None:
    """`Grammars.compile`'s refusals of JSON schema `schema` (text, `schema_check.check_shape`
    passed), and a schema whose grammar lets no token start a document (a union of only a
    reference to itself): what the server refuses before admitting a request.

    The grammar is compiled over a vocabulary of the 256 single bytes and an end token, not the
    model's: what xgrammar refuses is the grammar, whatever the vocabulary, and a byte-level
    vocabulary holds every single byte, so some token of it can start a document exactly when
    some byte can. A vocabulary's compile works out which of its tokens each state allows, and
    its cost grows with the vocabulary (2,048 ids here, about 150,000 for a Qwen3 tokenizer);
    the engine pays it once, for the request's matcher."""
    import xgrammar

    compiled = compile_schema(_byte_compiler(), schema)
    bitmask = xgrammar.allocate_token_bitmask(1, 257)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not allowed_bits(bitmask, 256).any():
        raise ConfigError("no token can start a document it allows")


@functools.cache
def _byte_compiler():
    """`check_schema`'s compiler, made at its first call."""
    import xgrammar

    info = xgrammar.TokenizerInfo([bytes([b]) for b in range(256)] + [b""], xgrammar.VocabType.RAW,
                                  vocab_size=257, stop_token_ids=[256])
    return xgrammar.GrammarCompiler(info, cache_limit_bytes=CHECK_CACHE_BYTES)


class GrammarStall(RuntimeError):
    """A request's grammar state from which its matcher accepts no token the mask allows."""


class Grammars:
    """The compiler of one tokenizer's grammars, for a model whose logits have `vocab_size` ids."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar

        backend = tokenizer.backend
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        encoded = [""] * vocab_size  # an empty string: a special token, never text
        for text, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and text not in added:
                encoded[i] = text
        info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)
        self.vocab_size = vocab_size
        self.keys = KeyVocab(info.decoded_vocab)  # each id's bytes, b"" for a special token

    def compile(self, schema: str):
        """JSON schema `schema` (text, `schema_check.check_shape` passed) compiled for this
        tokenizer (cached by text), its patterns through xgrammar's regex converter
        (`pattern_grammar`); ConfigError, in xgrammar's words, where it cannot be."""
        return compile_schema(self.compiler, schema)

    def state(self, schema: str) -> GrammarState:
        """A fresh matcher for JSON schema `schema` (text; `compile`'s refusals)."""
        compiled = self.compile(schema)
        keys = KeyTracker(self.keys) if free_keys(json.loads(schema)) else None
        return GrammarState(compiled, self.vocab_size, keys)


class _Ahead:
    """A request's matcher as `KeyTracker.dead_ends` walks it ahead (`json_keys.Walker`), on a
    bitmask of its own."""

    def __init__(self, matcher, vocab_size: int):
        import xgrammar

        self.matcher, self.vocab_size = matcher, vocab_size
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def back(self) -> None:
        self.matcher.rollback(1)

    def allowed(self) -> list[int]:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return allowed_ids(self.bitmask, self.vocab_size)


def allowed_bits(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """[vocab_size] uint8, 1 where a filled bitmask allows the id (bit i of its little-endian
    words is id i; set: allowed)."""
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    """The ids a filled bitmask allows."""
    return np.flatnonzero(allowed_bits(bitmask, vocab_size)).tolist()


def first_max(row: torch.Tensor) -> int:
    """The first index of `row`'s greatest value, as `torch.argmax` gives it (in numpy for a
    host row, which a vocabulary's row costs less in)."""
    return int(row.numpy().argmax()) if row.device.type == "cpu" else int(row.argmax())


class GrammarState:
    """One request's grammar matcher and its token mask (see the module docstring), with the
    keys its document's objects hold (`json_keys`): a token that would close a key its object
    already holds is masked out, and so is one that begins or continues a key that can only end
    as one its object holds (`KeyTracker.dead_ends`), unless every token the grammar allows
    there would be (required properties past the keys a schema allows: the document repeats one
    rather than stall). `keys` None: the schema's objects hold only listed properties
    (`json_keys.free_keys`), which the grammar writes once each."""

    def __init__(self, compiled, vocab_size: int, keys: KeyTracker | None):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self._words = self.bitmask.numpy()  # (the bitmask's memory: bit i of word i // 32 is id i)
        self.vocab_size = vocab_size
        self.stop = min(self.matcher.stop_token_ids)
        self.keys = keys
        self._ahead = _Ahead(self.matcher, vocab_size)
        self._refusals: tuple[object, list[int]] | None = None  # (the state, its refusals)

    def masked(self, row: torch.Tensor) -> torch.Tensor:
        """`row` [V] (a copy, float32) with the tokens the current state refuses at -inf."""
        row = row.detach().float()
        if self.matcher.is_terminated():  # a row after the end (a draft's): the end again
            out = torch.full_like(row, float("-inf"))  # (the decode loop stops at the first end)
            out[self.stop] = 0.0
            return out
        bits = self._bits()
        if row.device.type == "cpu":  # (a vocabulary's row: numpy's one pass costs less than torch's call)
            return torch.from_numpy(np.where(bits != 0, row.numpy(), np.float32("-inf")))
        return row.masked_fill(torch.from_numpy(bits == 0).to(row.device), float("-inf"))

    def _bits(self) -> np.ndarray:
        """[V] uint8, 1 where the current state (not terminated) allows the token: its grammar's
        bitmask, less what its keys refuse (`_refused_keys`)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = allowed_bits(self.bitmask, self.vocab_size)  # (an array of its own)
        if self.keys is not None:
            bits[self._refused_keys(bits)] = 0
        return bits

    def _refused_keys(self, bits: np.ndarray) -> list[int]:
        """The tokens the keys refuse at the current state, `bits` what its bitmask allows
        (`allowed_bits`): those the grammar allows that would close a key their object holds or
        can only lead to one, unless it allows no other token. What the grammar allows decides
        it, not the row's values, so `push` refuses what `masked` masks. Kept for the state: a
        verify masks it more than once."""
        at = self.keys.history[-1]
        if self._refusals is not None and self._refusals[0] is at:
            return self._refusals[1]
        refused: list[int] = []
        if at.frames:  # (outside any container nothing is refused)
            allowed = np.flatnonzero(bits).tolist()
            refused = sorted(set(self.keys.repeating()).intersection(allowed).union(
                self.keys.dead_ends(allowed, self._ahead)))
            refused = refused if len(refused) < len(allowed) else []
        self._refusals = (at, refused)
        return refused

    def _refused(self, token: int) -> bool:
        """The grammar or the keys refuse `token` at the current state (`masked`'s rule)."""
        if self.matcher.is_terminated():
            return True
        if self.keys is None or not self.keys.may_refuse(token):
            return False
        return not self._bits()[token]

    @property
    def done(self) -> bool:
        """The document is complete and its end token taken: no token may follow."""
        return self.matcher.is_terminated()

    def push(self, token: int) -> bool:
        """A draft into the state (False: the grammar refuses it, and the state is unchanged);
        undo the drafts pushed with `rollback`."""
        token = int(token)
        if self._refused(token) or not self.matcher.accept_token(token):
            return False
        if self.keys is not None:
            self.keys.take(token)
        return True

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            if self.keys is not None:
                self.keys.drop(n)

    def redraft(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """A block's drafts under the grammar: at each position the drafter's own draft where
        the grammar allows it, else the allowed token of highest drafter logit (`logits` [k,
        V]); the block ends where no token is allowed. The state is left as it was."""
        out: list[int] = []
        for i, d in enumerate(drafts):
            if not self.push(d):
                row = self.masked(logits[i])
                d = int(row.argmax())
                if row[d] == float("-inf") or not self.push(d):
                    break
            out.append(d)
        self.rollback(len(out))
        return torch.tensor(out, dtype=torch.long)

    def accept(self, token: int) -> None:
        """An emitted token into the state (the decode loop picked it: `pick`)."""
        if not self.push(token):
            raise AssertionError(f"token {token} was emitted from a row its grammar masked out")

    def pick(self, row: torch.Tensor, draw=None, refused: tuple[int, ...] = ()) -> int:
        """The token `draw` (row [V] -> id; None: the argmax, `first_max`) chooses from logits
        `row` masked at the current state, `refused` at -inf too, taken into the state.
        xgrammar's bitmask can allow a multi-character token its matcher then refuses (one that
        ends a string inside some patterns' rules); such a token is masked at this row and `draw`
        chooses again, so the token taken is `draw`'s among the tokens the matcher accepts
        (greedy: the argmax of those; sampled: a draw from the row without the refused ones).
        GrammarStall where the matcher accepts none of the tokens the mask allows."""
        if draw is None and not refused and not self.matcher.is_terminated():
            # the row's own argmax where the state allows it is the masked row's (the first
            # of the greatest values either way): no mask to make
            token = first_max(row.detach().float())
            self.matcher.fill_next_token_bitmask(self.bitmask)
            if self._words[0, token >> 5] >> (token & 31) & 1 and self.push(token):
                return token
        row = self.masked(row)
        if refused:
            row[torch.tensor(refused, device=row.device)] = float("-inf")
        # (whether any token is left is read only after a refusal: reading the whole row costs
        # about what masking it does)
        draw = first_max if draw is None else draw
        while not refused or bool(torch.isfinite(row).any()):
            token = int(draw(row))
            if row[token] != float("-inf") and self.push(token):
                return token
            row[token] = float("-inf")
            refused = (token,)
        raise GrammarStall("the request's grammar allows no token its matcher accepts here")

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar allows after the emitted tokens; the state is
        left as it was."""
        n = 0
        for d in drafts:
            if not self.push(d):
                break
            n += 1
        self.rollback(n)
        return n

    def masked_rows(self, rows: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """rows [n, V] of a verify (row i after drafts d_1..d_i, n <= len(drafts) + 1, every
        draft allowed: `valid_drafts`) -> each row masked at its state; the state is left as
        it was."""
        out = []
        for i in range(rows.shape[0]):
            out.append(self.masked(rows[i]))
            if i < rows.shape[0] - 1:
                self.push(drafts[i])
        self.rollback(rows.shape[0] - 1)
        return torch.stack(out)

    def greedy(self, rows: torch.Tensor, drafts: list[int]) -> list[int]:
        """Greedy verify under the grammar: each row's argmax among the tokens its state allows
        (`pick`), up to the first row whose token rejects the next draft (or the last row); the
        state then holds the accepted drafts and that row's token, as the step emits them."""
        ids: list[int] = []
        for i in range(rows.shape[0]):
            token = self.pick(rows[i])
            ids.append(token)
            if i >= len(drafts) or token != drafts[i] or self.done:
                break
        return ids

    def take_drawn(self, tokens: list[int], row: torch.Tensor, draw, recovered: int | None = None) -> list[int]:
        """A sampled step's emitted tokens into the state, up to the end (the decode loop stops
        there): its accepted drafts (each allowed: `valid_drafts`), then the token drawn from
        logits `row` (the last one's, masked), drawn again by `draw` from `row` without it where
        the matcher refuses it (`pick`; for a recovered token, without the draft it replaces,
        `recovered`, too, where the matcher accepts another). Returns the tokens the step emits."""
        *drafts, last = tokens
        self.advance(drafts)
        if self.done or self.push(last):
            return tokens
        try:
            again = self.pick(row, draw, refused=(last,) if recovered is None else (last, recovered))
        except GrammarStall:
            if recovered is None:
                raise
            again = self.pick(row, draw, refused=(last,))
        return [*drafts, again]

    def advance(self, tokens: list[int]) -> None:
        """Emitted tokens into the state, up to the end (the decode loop stops there)."""
        for t in tokens:
            if self.done:
                return
            self.accept(t)
