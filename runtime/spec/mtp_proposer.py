"""MTP draft chains as a `decode.Proposer`, with the confidence stop of `--draft-confidence-stop`.

Alignment (see `mtp`): head entry p = (token p+1, hidden p) predicts token p+2. With the target
cache holding positions 0..q and the pending token at q+1, the head holds real entries 0..q
(`base` = q+1) and entry q's output is the first draft (token q+2). Chain drafts write
speculative entries from `base` on, feeding the head's own output back; they are rolled back
(`length = base`) and overwritten by the real entries once the target has verified the step.

Confidence stop: after draft d_i with top-1 probability p_i the chain continues only while
p_i >= TAU (per-draft) or p_1·…·p_i >= TAU (`cum:`). The draft that trips the stop is still
verified, so the stop changes which drafts are verified, never the emitted tokens.
"""

from __future__ import annotations

import torch

from metrale.runtime.models.mtp import MTPHead
from metrale.runtime.spec import decode
from metrale.runtime.spec.config import DraftStop
from metrale.runtime.spec.proposer import NO_DRAFTS, Proposer
from metrale.runtime.steps import HeadForward


class MTPProposer(Proposer):
    """A chain's length is its own each step: it does not depend on the batch, and no step is
    known plain in advance."""

    follows = True

    def __init__(self, head: MTPHead, embed: torch.nn.Embedding, num_drafts: int,
                 stop: DraftStop | None, max_len: int):
        self.head, self.embed, self.num_drafts, self.stop = head, embed, num_drafts, stop
        self.max_len = max_len

    @classmethod
    def for_spec(cls, head, embed, spec, settings, max_len: int) -> "MTPProposer":
        """The proposer `--speculative` runs (`components`' factory): K drafts, the stop."""
        return cls(head, embed, spec.num_drafts, spec.draft_stop, max_len)

    def _entries(self, tokens: torch.Tensor, hidden: torch.Tensor):
        """Append real entries: tokens [T] (token p+1), hidden [1, T, H] (target hidden p)."""
        logits, h = yield HeadForward(self.head, self.embed(tokens[None]), hidden, self.cache, self.base)
        self.base = self.cache.length
        self.next_logits, self.next_h = logits[0, -1], h[:, -1:]

    def prefill(self, prompt_ids: list[int], out, pending: int) -> None:
        w = self.embed.weight
        self.cache = self.head.new_cache(1, self.max_len, w.dtype, w.device)
        self.base = 0
        tokens = [*prompt_ids[1:], pending]
        # (token ids [r], the target output whose first r hidden rows go with them) the head has
        # not seen: the prompt's, until the first chain; ids as lists, made one tensor, and the
        # hidden rows read, when they enter the head (a plain step of a busy batch costs no
        # tensor op; `kept` holds the hidden states only)
        self.unfed: list[tuple[list[int], object]] = [(tokens, out.kept("hidden"))]

    def _feed(self):
        """The rows kept since the last chain (the prompt's before the first) enter the head in
        one call, or in calls of `decode.CATCH_UP_ROWS` where more wait (a sequence resuming
        after a busy spell: each call is a head forward of the whole batch): a request that
        never drafts (a busy batch) never runs the head."""
        if self.unfed:
            tokens = torch.tensor([t for ids, _ in self.unfed for t in ids], dtype=torch.long,
                                  device=self.embed.weight.device)
            hidden = torch.cat([out.last_hidden[:, :len(ids)] for ids, out in self.unfed], dim=1)
            self.unfed = []
            step = decode.CATCH_UP_ROWS
            for i in range(0, tokens.numel(), step):
                yield from self._entries(tokens[i:i + step], hidden[:, i:i + step])

    def _continues(self, prob: float, running: float) -> bool:
        if self.stop is None:
            return True
        return (running if self.stop.cumulative else prob) >= self.stop.tau

    def propose_steps(self, pending: int, max_drafts: int):
        """The draft chain as a coroutine: it yields each `HeadForward` it needs (send back its
        output), so a scheduler can run the chains of many sequences in one head forward per
        link; returns (drafts [k], k)."""
        k = min(self.num_drafts, max_drafts)
        if k == 0:  # a plain step: the kept rows wait in `unfed`
            return NO_DRAFTS, 0
        yield from self._feed()
        drafts: list[int] = []
        logits, h, running = self.next_logits, self.next_h, 1.0
        grammar = self.grammar  # each link drafts within the request's grammar, where it has one
        while len(drafts) < k:
            if grammar is not None:
                if grammar.done:
                    break
                logits = grammar.masked(logits)
            probs = torch.softmax(logits.float(), dim=-1)
            tok = probs.argmax()  # the first most probable, as max would pick
            draft = int(tok)
            prob = float(probs[draft])
            if grammar is not None and not grammar.push(draft):
                break  # nothing the grammar allows (the document is complete)
            drafts.append(draft)
            running *= prob
            if len(drafts) == k or not self._continues(prob, running):
                break
            logits, h = yield HeadForward(self.head, self.embed(tok.view(1, 1)), h, self.cache)  # speculative entry
            logits = logits[0, -1]
        if grammar is not None:
            grammar.rollback(len(drafts))
        self.cache.length = self.base
        return torch.tensor(drafts, dtype=torch.long), len(drafts)

    def follow(self, out, emitted_ids: list[int]) -> None:
        """Plain steps of a busy batch (one, or the rows `Decoder._catch_up` ran again, each
        followed by its token in `emitted_ids`): their rows wait in `unfed` like accepted ones."""
        self.unfed.append((emitted_ids, out.kept("hidden")))

    def accept(self, out, rows: int, emitted: torch.Tensor) -> None:
        """The head's entries for the kept rows are computed at the next chain (`_feed`), so a
        run of plain steps (a busy batch) costs the head nothing until drafting resumes."""
        self.unfed.append((emitted.tolist(), out.kept("hidden")))  # its first `rows` rows
