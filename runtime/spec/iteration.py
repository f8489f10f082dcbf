"""One speculative iteration as one fixed-shape function of tensors it owns: what a CUDA graph
captures whole, draft -> verify -> accept -> advance, with acceptance on the device (as SGLang's
DFlash worker v2 and TensorRT-LLM's one-model MTP run theirs).

An iteration reads and writes only its `IterationState` and the static caches of the steps it
runs (`backends.aoti_steps`: every row placed by a position tensor, attention masked by
position), so its shapes never change and it never reads the device from the host
(`host_reads.forbid_host_reads` proves it on a CPU). Greedy decoding:

- verify: the target's argmax t_0..t_k of the rows [pending, d_1..d_k] at `pos`.., in one
  forward (chunkwise) or k+1 one-row forwards (`exact`: plain decoding's bits, so plain
  decoding's tokens);
- accept: n = the leading drafts equal to t (`accepted_count`), capped by what a draft stop lets
  count; the emitted tokens are t_0..t_n (the accepted drafts, then the bonus or recovered
  token); the new pending token is t_n and the cache's length pos + n + 1. Rows past n were
  written to the caches too: they lie at positions no later row sees before they are written
  again;
- emit: t_0..t_k go into a device ring (`tokens` [R]) from `count` on, and `count` grows by n+1,
  so the rows past n are overwritten by the next iteration.

Modes:
- `PlainIteration`: one row, its argmax.
- `DFlashIteration` (DFlash / DFlash2, k of the block's γ−1 drafts verified): feed the previous
  verify's kept rows' taps (all γ rows of `feats` are written, at the positions before `pos`:
  the `kept` valid ones land at their slots, the rest at slots from `pos` on, which the block
  overwrites before anything reads them), propose [pending, MASK×(γ−1)] and pick the drafts
  (argmax, or DFlash2's selector), verify, accept.
- `MTPIteration` (a chain of k): the chain's k links from the head's last real entry, argmax on
  the device; the confidence stop as a count of the drafts that count (the draft that trips it
  still counts), so what is accepted follows the seed's rule; verify, accept, then the kept
  rows' head entries in one head forward of k+1 entries (those past the kept rows are written
  over by the next chain before any entry reads them), its entry at the last kept row seeding
  the next chain.

`iteration_loop.IterationLoop` drives one over a request.
"""

from __future__ import annotations

import functools

import torch

from metrale.runtime.backends.aoti_steps import BatchedDFlashStep, BatchedMTPStep, TargetStep
from metrale.runtime.models.layers import MoE
from metrale.runtime.models.step_caches import PooledKV
from metrale.runtime.spec.config import DraftStop
from metrale.runtime.spec.sampling import SamplingParams, probs_on_device, sample_from_probs
from metrale.runtime.spec.verify import verify_sampling_on_device


def accepted_count(drafts: torch.Tensor, target_ids: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """drafts [k], the target's argmax of the k+1 rows [k+1] -> the leading drafts equal to it
    (a 0-dim int64 tensor), at most `counted` (0-dim) when given."""
    n = (drafts == target_ids[:-1]).long().cumprod(0).sum()
    return n if counted is None else torch.minimum(n, counted)


class IterationState:
    """What an iteration owns besides the caches, on its device: `pending` [1] (the last
    emitted token, not yet fed), `pos` [1] (its position: the target cache's length), the ring
    `tokens` [R] and `count` [1] (tokens emitted since the prompt)."""

    def __init__(self, device: torch.device, ring: int):
        def longs(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long, device=device)

        self.pending, self.pos, self.count, self.tokens = longs(1), longs(1), longs(1), longs(ring)
        self._ring_rows = torch.arange(ring, device=device)

    def emit(self, target_ids: torch.Tensor, n: torch.Tensor) -> None:
        """t_0..t_n emitted (t = `target_ids` [k+1], n 0-dim): into the ring, pending t_n, the
        position on by n+1."""
        ring = self.tokens.shape[0]
        slots = (self.count + self._ring_rows[: target_ids.shape[0]]) % ring
        self.tokens.index_copy_(0, slots, target_ids)
        self.count.add_(n + 1)
        self.pending.copy_(target_ids.index_select(0, n.view(1)))
        self.pos.add_(n + 1)

    def start(self, pending: int, pos: int) -> None:
        """A new request: its first token (from the prompt) pending at `pos`."""
        self.pending.fill_(pending)
        self.pos.fill_(pos)
        self.count.zero_()


def _static_kv(layers: int, slots: int, heads: int, head_dim: int, dtype, device) -> list[torch.Tensor]:
    """One sequence's target cache for `TargetStep`: per layer K and V [S, nkv, hd]."""
    return [torch.zeros(slots, heads, head_dim, dtype=dtype, device=device) for _ in range(2 * layers)]


def _pooled_kv(layers: int, slots: int, heads: int, head_dim: int, dtype, device) -> list[torch.Tensor]:
    """A pool of one cache for the batched drafter and head steps: per layer K [1, nkv, hd, S]
    and V [1, S, nkv, hd]."""
    out = []
    for _ in range(layers):
        out += [torch.zeros(1, heads, head_dim, slots, dtype=dtype, device=device),
                torch.zeros(1, slots, heads, head_dim, dtype=dtype, device=device)]
    return out


def capturable(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every MoE on its dense routed path, a fixed set of ops whatever the routing
    (on a CPU the eager path reads the routing to run each row's experts only; a GPU takes the
    dense path anyway), and returned."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.row_invariant = True
    return module


class _Verifying:
    """What every iteration shares: the target's step, its cache, the state, the verify."""

    k = 0
    exact = False

    def __init__(self, model, taps: tuple[int, ...], slots: int, ring: int, linear: str):
        c = model.config
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.target = TargetStep(capturable(model), taps, linear).to(self.device).eval()
        self.embed = model.model.embed_tokens
        self.slots, self.vocab_size = slots, c.vocab_size
        if ring < 4 * (self.k + 1):  # unread: up to two iterations' tokens, and the next's rows
            raise ValueError(f"a ring of {ring} tokens is too small for {self.k + 1} rows an iteration")
        self.kv = _static_kv(c.num_hidden_layers, slots, c.num_key_value_heads, c.head_dim, self.dtype, self.device)
        self.state = IterationState(self.device, ring)
        # a sampled request's temperature and top_p [1], and the generator of its draws
        self.temperature = torch.ones(1, dtype=torch.float32, device=self.device)
        self.top_p = torch.ones(1, dtype=torch.float32, device=self.device)
        self.generator = torch.Generator(device=self.device)

    def variants(self) -> dict:
        """{(count, sampled): the iteration verifying that many drafts, greedy or sampled}: what
        the loop captures, one graph each."""
        return {(k, sampled): functools.partial(self.step, k, sampled)
                for k in self.keys() for sampled in (False, True)}

    def keys(self) -> tuple:
        return (self.k,)

    def __call__(self) -> tuple:
        return self.step(self.k, False)

    def sampling(self, params: SamplingParams) -> None:
        """A sampled request's settings into the tensors its iterations read (its seed, or a
        fresh one, into their generator)."""
        self.temperature.fill_(params.temperature)
        self.top_p.fill_(params.top_p)
        seed = params.seed % 2**64 if params.seed is not None else int(torch.randint(2**62, ()))
        self.generator.manual_seed(seed)

    def select(self, logits: torch.Tensor, drafts: torch.Tensor, sampled: bool,
               counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits [1, k+1, V] of the rows [pending, drafts [k]] -> (tokens [k+1]
        whose first n+1 are emitted, n accepted): the argmax and its leading matches, or the
        rejection sampling of a sampled request."""
        if not sampled:
            target_ids = logits[0].argmax(-1)  # [k+1]
            return target_ids, accepted_count(drafts, target_ids, counted)
        probs = probs_on_device(logits[0], self.temperature, self.top_p)  # [k+1, V]
        n, ids = verify_sampling_on_device(drafts, probs, self.generator, counted)
        return ids, n

    def verify(self, ids: torch.Tensor):
        """ids [k+1] at `pos`.. -> the target step's outputs (logits [1, k+1, V], last hidden,
        taps when it has them): one forward, or one per row (`exact`)."""
        pos = self.state.pos
        if not self.exact:
            return self.target(ids[None], pos, *self.kv)
        outs = [self.target(ids[None, j:j + 1], pos + j, *self.kv) for j in range(ids.shape[0])]
        return tuple(torch.cat(parts, dim=1) for parts in zip(*outs))

    def check_room(self, prompt_len: int, max_tokens: int) -> None:
        """A request fits the caches: its positions, two iterations' rows past its budget (the
        one discarded, see `IterationLoop`) and a drafter's block beyond them."""
        need = prompt_len + max_tokens + 2 * (self.k + 1) + getattr(self, "gamma", 0)
        if need > self.slots:
            raise ValueError(f"a prompt of {prompt_len} tokens and {max_tokens} more need {need} "
                             f"cache slots; the iteration's caches hold {self.slots}")

    def prompt(self, prompt_ids: list[int], sampled: bool = False):
        """The prompt's rows at positions 0.. (eager, before the iterations) -> the step's
        outputs, its first token (the last row's argmax, or its draw) made pending."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        out = self.target(ids, torch.zeros(1, dtype=torch.long, device=self.device), *self.kv)
        last = out[0][0, -1:]  # [1, V]
        pending = (sample_from_probs(probs_on_device(last, self.temperature, self.top_p), self.generator)
                   if sampled else last[0].argmax(-1))
        self.state.start(0, len(prompt_ids))
        self.state.pending.copy_(pending.view(1))
        return out


class PlainIteration(_Verifying):
    """Plain decoding: the pending token's row, its argmax or its draw emitted."""

    def __init__(self, model, *, slots: int, ring: int = 64, linear: str = "gemm"):
        super().__init__(model, (), slots, ring, linear)
        self._no_drafts = torch.zeros(0, dtype=torch.long, device=self.device)

    def prefill(self, prompt_ids: list[int], sampled: bool = False) -> None:
        self.prompt(prompt_ids, sampled)

    def step(self, k: int, sampled: bool) -> tuple:
        logits = self.verify(self.state.pending)[0]  # [1, 1, V]
        self.state.emit(*self.select(logits, self._no_drafts, sampled))
        return ()


SETTLED = "settled"  # the variant of a stream whose drafter retired: plain steps, nothing fed


class DFlashIteration(_Verifying):
    """A DFlash / DFlash2 drafter's block, k of its γ−1 drafts verified (see the module
    docstring), for each k of `counts`: the variants share the state and the caches, so the
    host may pick any of them for the next iteration (`variants`, one graph each: a draft
    ladder's rungs, adaptive k's counts). k = 0 is a plain step that still keeps its row for the
    drafter (its kept rows fed, no block); `SETTLED` a plain step that keeps nothing (a stream
    whose adaptive k settled on plain decoding)."""

    def __init__(self, model, drafter, counts: int | tuple[int, ...], *, gamma: int | None = None,
                 exact: bool = False, settled: bool = False, slots: int, ring: int = 64, linear: str = "gemm"):
        cfg = drafter.config
        gamma = gamma or cfg.block_size
        counts = (counts,) if isinstance(counts, int) else tuple(sorted(set(counts)))
        if not counts or not all(0 <= k <= gamma - 1 for k in counts) or counts == (0,):
            raise ValueError(f"counts {counts}: a block of {gamma} verifies 0 to {gamma - 1} drafts, "
                             "and some count drafts")
        self.counts, self.settled = counts, settled
        self.k, self.gamma, self.exact = max(counts), gamma, exact
        super().__init__(model, tuple(cfg.target_layer_ids), slots, ring, linear)
        d = cfg.decoder
        self.draft = BatchedDFlashStep(capturable(drafter), self.embed, gamma).to(self.device).eval()
        self.draft_kv = _pooled_kv(d.num_hidden_layers, slots, d.num_key_value_heads, d.head_dim,
                                   self.dtype, self.device)
        device, width = self.device, cfg.num_context_features * cfg.target_hidden_size
        self.kept = torch.zeros(1, dtype=torch.long, device=device)  # valid rows of `feats`
        self.feats = torch.zeros(gamma, width, dtype=self.dtype, device=device)  # [γ, n·Ht]
        self._masks = torch.full((gamma - 1,), cfg.mask_token_id, dtype=torch.long, device=device)
        self._rows = torch.arange(gamma, device=device)
        self._seq = torch.zeros(gamma, dtype=torch.long, device=device)
        self._one_seq = torch.zeros(1, dtype=torch.long, device=device)
        self._gamma = torch.full((1,), gamma, dtype=torch.long, device=device)
        self._no_drafts = torch.zeros(0, dtype=torch.long, device=device)

    def keys(self) -> tuple:
        """Every count, and `SETTLED` where asked."""
        return self.counts + ((SETTLED,) if self.settled else ())

    def prefill(self, prompt_ids: list[int], sampled: bool = False) -> None:
        """The prompt's rows, and their taps into the drafter's cache."""
        taps = self.prompt(prompt_ids, sampled)[2]  # [1, n, n·Ht]
        n = taps.shape[1]
        positions = torch.arange(n, device=self.device)
        self.draft.drafter.add_context(taps, PooledKV(self.draft_kv, torch.zeros_like(positions), positions))
        self.kept.zero_()

    def step(self, k, sampled: bool) -> tuple:
        s = self.state
        if k is SETTLED:  # a plain step whose row the drafter never needs
            self.state.emit(*self.select(self.verify(s.pending)[0], self._no_drafts, sampled))
            return ()
        feed_pos = s.pos - self.kept + self._rows  # [γ]: the kept rows' positions, then slots from pos on
        if k:
            block = torch.cat([s.pending, self._masks])[None]  # [1, γ]
            drafts = self.draft(self.feats, feed_pos, self._seq, block, self._one_seq, s.pos, self._gamma,
                                *self.draft_kv)[0, :k]  # [k]
        else:  # the kept rows only (those past them land from pos on, written over before read)
            self.draft.drafter.add_context(self.feats[None], PooledKV(self.draft_kv, self._seq, feed_pos))
            drafts = self._no_drafts
        logits, _, taps = self.verify(torch.cat([s.pending, drafts]))
        ids, n = self.select(logits, drafts, sampled)
        self.feats[: k + 1].copy_(taps[0])
        self.kept.copy_(n.view(1) + 1)
        s.emit(ids, n)
        return ()


class MTPIteration(_Verifying):
    """An MTP head's chain of k, the confidence stop as a device mask (see the module
    docstring)."""

    def __init__(self, model, head, k: int, *, stop: DraftStop | None = None, exact: bool = False,
                 slots: int, ring: int = 64, linear: str = "gemm"):
        if k < 1:
            raise ValueError(f"k = {k}: a chain has at least one draft")
        self.k, self.stop, self.exact = k, stop, exact
        super().__init__(model, (), slots, ring, linear)
        d = head.config.decoder
        self.head = BatchedMTPStep(capturable(head)).to(self.device).eval()
        self.head_kv = _pooled_kv(d.num_hidden_layers, slots, d.num_key_value_heads, d.head_dim,
                                  self.dtype, self.device)
        device = self.device
        self.next_logits = torch.zeros(1, d.vocab_size, dtype=self.dtype, device=device)  # [1, V]
        self.next_h = torch.zeros(1, d.hidden_size, dtype=self.dtype, device=device)  # [1, H]
        self._rows = torch.arange(k + 1, device=device)
        self._seq = torch.zeros(1, dtype=torch.long, device=device)

    def _entries(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, last: torch.Tensor) -> None:
        """Head entries (token p+1, target hidden p) for tokens/hidden [T, ·] at positions `pos`
        [T]; the one at row `last` (0-dim) seeds the next chain."""
        logits, h = self.head(self.embed(tokens), hidden, pos, torch.zeros_like(pos), *self.head_kv)
        self.next_logits.copy_(logits.index_select(0, last.view(1)))
        self.next_h.copy_(h.index_select(0, last.view(1)))

    def prefill(self, prompt_ids: list[int], sampled: bool = False) -> None:
        """The prompt's rows, and its head entries (token p+1 for p < n−1, then the pending)."""
        out = self.prompt(prompt_ids, sampled)
        n = len(prompt_ids)
        tokens = torch.cat([torch.tensor(prompt_ids[1:], dtype=torch.long, device=self.device), self.state.pending])
        positions = torch.arange(n, device=self.device)
        self._entries(tokens, out[1][0], positions, torch.full((), n - 1, dtype=torch.long, device=self.device))

    def _counted(self, probs: torch.Tensor) -> torch.Tensor | None:
        """probs [k] (each draft's top-1 probability) -> the drafts the stop lets count: the
        chain goes on after draft i while p_i (or p_1·…·p_i) >= TAU, and the draft that trips
        it counts (0-dim); None without a stop."""
        if self.stop is None or self.k == 1:
            return None
        p = probs.cumprod(0) if self.stop.cumulative else probs
        return (p[:-1] >= self.stop.tau).long().cumprod(0).sum() + 1

    def step(self, k: int, sampled: bool) -> tuple:
        s = self.state
        logits, h = self.next_logits, self.next_h
        drafts, probs = [], []
        for j in range(k):
            if j:  # a speculative entry: the last draft with the head's own output, at pos + j − 1
                logits, h = self.head(self.embed(drafts[-1]), h, s.pos + (j - 1), self._seq, *self.head_kv)
            p, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)  # [1] each
            drafts.append(tok)
            probs.append(p)
        d = torch.cat(drafts)  # [k]
        target_logits, hidden = self.verify(torch.cat([s.pending, d]))[:2]
        ids, n = self.select(target_logits, d, sampled, self._counted(torch.cat(probs)))
        self._entries(ids, hidden[0], s.pos + self._rows, n)
        s.emit(ids, n)
        return ()
