"""One speculative iteration as one fixed-shape function of tensors it owns: what a CUDA graph
captures whole, draft -> verify -> accept -> advance, with acceptance on the device (as SGLang's
DFlash worker v2 and TensorRT-LLM's one-model MTP run theirs).

An iteration runs `lanes` sequences at once (B of them: a bucket, the first B lanes), each with
its own caches in a pool, its own position and its own accepted length (ragged acceptance, on
the device). It reads and writes only its `IterationState` and the caches of the batched steps
it runs (`backends.aoti_steps`, every row placed by its lane and a position tensor), so its
shapes never change and it never reads the device from the host (`host_reads.forbid_host_reads`
proves it on a CPU). A lane that is not `active` moves nothing (its position, count and kept
rows stay; what it writes lies at positions it writes again before reading).

The steps attend through `step_caches.LaneKV`: a lane's rows (as many for every lane) read its
cache once, two matrix products over views of the pool, masked by position. Each variant is
captured per slot bucket S (`slot_buckets`), its steps seeing every lane's first S slots only.
A request's bucket is the smallest that holds its positions and `room` past them
(`check_room`); lanes run in the bucket of the longest request among them. Greedy decoding,
per lane:

- verify: the target's argmax t_0..t_k of the rows [pending, d_1..d_k] at `pos`.., in one
  forward (chunkwise) or k+1 one-row forwards (`exact`: plain decoding's bits, so plain
  decoding's tokens);
- accept: n = the leading drafts equal to t (`accepted_count`), capped by what a draft stop lets
  count; the emitted tokens are t_0..t_n (the accepted drafts, then the bonus or recovered
  token); the new pending token is t_n and the cache's length pos + n + 1. Rows past n were
  written too, at positions no later row sees before they are written again;
- emit: t_0..t_k go into the lane's device ring (`tokens` [L, R]) from `count` on, and `count`
  grows by n+1, so the rows past n are overwritten by the next iteration.

A sampled lane (`sampled`) draws instead (temperature, top-p, `verify.verify_sampling_lanes`'s
rejection sampling); a variant that samples computes both and picks per lane.

Modes:
- `PlainIteration`: one row, its argmax.
- `DFlashIteration` (DFlash / DFlash2, k of the block's γ−1 drafts verified): feed the previous
  verify's kept rows' taps (all γ rows of `feats` are written, at the positions before `pos`:
  the `kept` valid ones land at their slots, the rest at slots from `pos` on, which the block
  overwrites before anything reads them), propose [pending, MASK×(γ−1)] and pick the drafts
  (argmax, or DFlash2's selector), verify, accept; a draft tree's: `tree_iteration`.
- `MTPIteration` (a chain of k): the chain's k links from the head's last real entry, argmax on
  the device; the confidence stop as a count of the drafts that count (the draft that trips it
  still counts: the seed's rule); verify, accept, then the kept rows' head entries in one head
  forward of k+1 (those past the kept rows are overwritten before being read), its entry at the
  last kept row seeding the next chain.

`iteration_loop.IterationLoop` drives one lane; `iteration_loop.IterationLanes` many (serving).
"""

from __future__ import annotations

import functools

import torch

from metrale.runtime.backends.aoti_steps import BatchedDFlashStep, BatchedMTPStep, BatchedTargetStep
from metrale.runtime.models.layers import capturable
from metrale.runtime.models.step_caches import LaneKV, buckets_to
from metrale.runtime.spec.config import DraftStop
from metrale.runtime.spec.sampling import NO_CAP, SamplingParams, probs_on_device, sample_from_probs
from metrale.runtime.spec.verify import verify_sampling_lanes

PROMPT_ROWS = 256  # a prompt's rows per forward (its attention's scores are rows x slots)
ROOM = 64  # the slots a request's cache holds past its last position, at least (`room`)


def room(k: int, gamma: int = 0) -> int:
    """The slots a request needs past its last position in iterations of k drafts (a drafter's
    block of γ): two iterations' rows (the one discarded, see `IterationLoop`) and the block
    beyond them, at least `ROOM`. Every mode of the usual sizes needs `ROOM`, so a request's
    slot bucket, and with it its attention's shapes, is the same in every mode: a request alone
    (`IterationLoop`) gets plain decoding's bits from exact verify. Lanes attend over the bucket
    of their longest request, so there, as with the batch bucket, a row's last bits may change
    with what it runs beside."""
    return max(ROOM, 2 * (k + 1) + gamma)


def accepted_count(drafts: torch.Tensor, target_ids: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """drafts [..., k], the target's argmax of the k+1 rows [..., k+1] -> the leading drafts equal
    to it ([...] int64), at most `counted` ([...]) when given."""
    n = (drafts == target_ids[..., :-1]).long().cumprod(-1).sum(-1)
    return n if counted is None else torch.minimum(n, counted)


class IterationState:
    """What an iteration owns besides the caches, per lane, on its device: `pending` [L] (the
    last emitted token, not yet fed), `pos` [L] (its position: the lane's target cache length),
    the ring `tokens` [L, R] and `count` [L] (tokens emitted since the prompt), `active` [L]
    (1: the lane advances), `cap` [L] (the most drafts the lane's request lets an iteration
    accept: its `max_drafts`, 0 with speculation off), and a sampled lane's `sampled` [L]
    (bool), `temperature` and `top_p` [L]."""

    def __init__(self, device: torch.device, lanes: int, ring: int):
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.pending, self.pos, self.count, self.active = longs(lanes), longs(lanes), longs(lanes), longs(lanes)
        self.tokens = longs(lanes, ring)
        self.cap = longs(lanes) + NO_CAP
        self.sampled = torch.zeros(lanes, dtype=torch.bool, device=device)
        self.temperature = torch.ones(lanes, dtype=torch.float32, device=device)
        self.top_p = torch.ones(lanes, dtype=torch.float32, device=device)
        self._ring_rows = torch.arange(ring, device=device)

    def emit(self, target_ids: torch.Tensor, n: torch.Tensor) -> None:
        """Each of the first B lanes emits t_0..t_n (t = `target_ids` [B, k+1], n [B]): into its
        ring, pending t_n, its position on by n+1 (an inactive lane: nothing moves)."""
        b, rows = target_ids.shape
        ring = self.tokens.shape[1]
        slots = (self.count[:b, None] + self._ring_rows[:rows]) % ring  # [B, k+1]
        self.tokens[:b].scatter_(1, slots, target_ids)
        active = self.active[:b]
        step = (n + 1) * active
        self.count[:b].add_(step)
        self.pos[:b].add_(step)
        self.pending[:b].copy_(torch.where(active.bool(), target_ids.gather(1, n[:, None])[:, 0], self.pending[:b]))

    def start(self, lane: int, pending: torch.Tensor, pos: int) -> None:
        """A new request in `lane`: its first token (from the prompt) pending at `pos`."""
        self.pending[lane:lane + 1].copy_(pending.view(1))
        self.pos[lane] = pos
        self.count[lane] = 0
        self.active[lane] = 1

    def sampling(self, lane: int, params: SamplingParams | None) -> None:
        """The lane's request samples with `params`, or is greedy (None, or temperature 0), and
        accepts at most the drafts it allows (`max_drafts`; none with speculation off)."""
        self.cap[lane] = NO_CAP if params is None else params.lane_cap
        sampled = params is not None and not params.greedy
        self.sampled[lane] = sampled
        self.temperature[lane] = params.temperature if sampled else 1.0
        self.top_p[lane] = params.top_p if sampled else 1.0


def _pooled_kv(layers: int, lanes: int, slots: int, heads: int, head_dim: int, dtype, device) -> list[torch.Tensor]:
    """A pool of one cache per lane for the batched steps' `LaneKV`: per layer K
    [L, nkv, hd, S] and V [L, nkv, S, hd]."""
    out = []
    for _ in range(layers):
        out += [torch.zeros(lanes, heads, head_dim, slots, dtype=dtype, device=device),
                torch.zeros(lanes, heads, slots, head_dim, dtype=dtype, device=device)]
    return out


def lanes_of(pool: list[torch.Tensor], first: int, b: int, s: int) -> list[torch.Tensor]:
    """Views of lanes first..first+b−1 and slots :s of a pool (`_pooled_kv`): the pool of those
    lanes' caches in slot bucket s, the memory the whole pool's."""
    return [t[first:first + b, :, :, :s] if i % 2 == 0 else t[first:first + b, :, :s] for i, t in enumerate(pool)]


class _Verifying:
    """What every iteration shares: the target's step, its caches, the state, the verify."""

    k = 0
    exact = False
    gamma = 0  # a drafter's block written past the verified rows (DFlash's)
    stats: tuple[torch.Tensor, ...] = ()  # what an iteration leaves per lane for a count policy to read

    def __init__(self, model, taps: tuple[int, ...], slots: int, ring: int, linear: str, lanes: int):
        c = model.config
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        self.target = BatchedTargetStep(capturable(model), taps, linear, cache=LaneKV).to(self.device).eval()
        self.embed = model.model.embed_tokens
        self.slots, self.vocab_size, self.lanes = slots, c.vocab_size, lanes
        # the slot buckets a request's iterations attend over: the caches' first S slots
        self.slot_buckets = buckets_to(slots)
        if ring < 4 * self.emitted_rows():  # unread: up to two iterations' tokens, and the next's rows
            raise ValueError(f"a ring of {ring} tokens is too small for {self.emitted_rows()} tokens an iteration")
        self.kv = _pooled_kv(c.num_hidden_layers, lanes, slots, c.num_key_value_heads, c.head_dim,
                             self.dtype, self.device)
        self.state = IterationState(self.device, lanes, ring)
        self.generator = torch.Generator(device=self.device)  # a sampled lane's draws
        self._index: dict = {}

    def index(self, b: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's lane [B·rows], the rows' offsets in a lane [rows]) for B lanes of `rows`
        rows each: made once per shape (before a capture, by its warm-up)."""
        key = (b, rows)
        if key not in self._index:
            lanes = torch.arange(b, device=self.device)
            self._index[key] = (lanes[:, None].expand(b, rows).reshape(-1), torch.arange(rows, device=self.device))
        return self._index[key]

    def variants(self, buckets: tuple[int, ...] = (1,)) -> dict:
        """{(B, count, sampled, S): the iteration of the first B lanes verifying that many
        drafts, greedy or with its sampled lanes drawing, over their caches' first S slots (a
        slot bucket)}: what a loop captures, one graph each."""
        return {(b, k, sampled, s): functools.partial(self.step, b, k, sampled, s)
                for b in buckets for k in self.keys() for sampled in (False, True) for s in self.slot_buckets}

    def keys(self) -> tuple:
        return (self.k,)

    def rows(self, k) -> int:  # the target rows an iteration of count k runs (`SETTLED`'s: one)
        return 1 if k is SETTLED else k + 1

    def accepts(self, k) -> int:  # the most drafts an iteration of count k may accept
        return 0 if k is SETTLED else k

    def emitted_rows(self) -> int:  # the most tokens an iteration emits (its verified rows)
        return self.k + 1

    def room(self) -> int:  # the slots a request needs past its last position
        return room(self.k, self.gamma)

    @property
    def proposed(self) -> int:
        """The drafts a drafting step proposes (a chain's k; a block's γ−1)."""
        return self.k

    def __call__(self) -> tuple:
        return self.step(1, self.k, False, self.slots)

    def select(self, logits: torch.Tensor, drafts: torch.Tensor, sampled: bool,
               counted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits [B, k+1, V] of the rows [pending, drafts [B, k]] -> (tokens
        [B, k+1] whose first n+1 are emitted, n [B] accepted): each lane's argmax and its leading
        matches or, where `sampled` and the lane samples, the rejection sampling's."""
        target_ids = logits.argmax(-1)  # [B, k+1]
        cap = self.state.cap[:logits.shape[0]]  # each lane's request's cap on its drafts
        counted = cap if counted is None else torch.minimum(counted, cap)
        n = accepted_count(drafts, target_ids, counted)
        if not sampled:
            return target_ids, n
        b = logits.shape[0]
        st = self.state
        probs = probs_on_device(logits, st.temperature[:b, None, None], st.top_p[:b, None, None])
        m, drawn = verify_sampling_lanes(drafts, probs, self.generator, counted)
        lanes = st.sampled[:b]
        return torch.where(lanes[:, None], drawn, target_ids), torch.where(lanes, m, n)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, kv: list[torch.Tensor]):
        """Rows ids, pos, seq [N] over `kv` (`lanes_of` the pool: seq counts from its first
        lane) -> (logits [N, V], last hidden [N, H], taps [N, n·H] when taken)."""
        return self.target(ids, pos, seq, self.index(1, ids.shape[0])[1], *kv)

    def verify(self, ids: torch.Tensor, s: int):
        """ids [B, k+1]: each lane's rows at its `pos`.. over its cache's first `s` slots -> the
        outputs per lane (logits [B, k+1, V], last hidden, taps when taken): one forward, or
        one per row (`exact`)."""
        b, rows = ids.shape
        pos = self.state.pos[:b]
        kv = lanes_of(self.kv, 0, b, s)
        if not self.exact:
            seq, offset = self.index(b, rows)
            outs = self.forward(ids.reshape(-1), (pos[:, None] + offset).reshape(-1), seq, kv)
            return tuple(o.view(b, rows, -1) for o in outs)
        seq = self.index(b, 1)[0]
        outs = [self.forward(ids[:, j], pos + j, seq, kv) for j in range(rows)]
        return tuple(torch.stack(parts, dim=1) for parts in zip(*outs))

    def check_room(self, prompt_len: int, max_tokens: int) -> int:
        """A request's slot bucket: the smallest that holds its positions and `room` past them
        (refused where none does)."""
        need = prompt_len + max_tokens + self.room()
        fits = [s for s in self.slot_buckets if s >= need]
        if not fits:
            raise ValueError(f"a prompt of {prompt_len} tokens and {max_tokens} more need {need} "
                             f"cache slots; the iteration's caches hold {self.slots}")
        return fits[0]

    def prompt(self, lane: int, prompt_ids: list[int], params: SamplingParams | None = None,
               slots: int | None = None):
        """The prompt's rows in `lane` at positions 0.. (eager, before its iterations, in pieces
        of `PROMPT_ROWS`, over the first `slots` slots: the request's bucket, default all) ->
        (last hidden [n, H], taps [n, n·H] or None), its first token (the last row's argmax, or
        its draw) made pending."""
        kv = lanes_of(self.kv, lane, 1, slots or self.slots)
        st = self.state
        st.sampling(lane, params)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        n = ids.shape[0]
        hidden, taps = [], []
        for start in range(0, n, PROMPT_ROWS):
            rows = ids[start:start + PROMPT_ROWS]
            pos = torch.arange(start, start + rows.shape[0], device=self.device)
            out = self.target(rows, pos, torch.zeros_like(pos), pos[-1:] - start, *kv)
            hidden.append(out[1])
            taps.append(out[2] if len(out) > 2 else None)
        last = out[0]  # [1, V]: the prompt's last row
        if params is not None and not params.greedy:
            pending = sample_from_probs(probs_on_device(last, st.temperature[lane:lane + 1, None],
                                                        st.top_p[lane:lane + 1, None]), self.generator)
        else:
            pending = last[0].argmax(-1)
        st.start(lane, pending, n)
        return torch.cat(hidden), (torch.cat(taps) if taps[0] is not None else None)

    def vacate(self, lane: int) -> None:
        """A lane whose request left: inactive, at position 0, so the rows it still writes while
        others run (an inactive lane moves nothing but writes at its position) lie in the
        smallest slot bucket."""
        self.state.active[lane] = 0
        self.state.pos[lane] = 0

    def seed(self, params: SamplingParams) -> None:
        """A sampled request's seed (or a fresh one) into the generator its lanes draw from."""
        seed = params.seed % 2**64 if params.seed is not None else int(torch.randint(2**62, ()))
        self.generator.manual_seed(seed)


class PlainIteration(_Verifying):
    """Plain decoding: each lane's pending token's row, its argmax or its draw emitted."""

    def __init__(self, model, *, slots: int, lanes: int = 1, ring: int = 64, linear: str = "gemm"):
        super().__init__(model, (), slots, ring, linear, lanes)
        self._no_drafts = torch.zeros(lanes, 0, dtype=torch.long, device=self.device)

    def prefill(self, lane: int, prompt_ids: list[int], params: SamplingParams | None = None,
                slots: int | None = None) -> None:
        self.prompt(lane, prompt_ids, params, slots)

    def step(self, b: int, k: int, sampled: bool, slots: int) -> tuple:
        logits = self.verify(self.state.pending[:b, None], slots)[0]  # [B, 1, V]
        self.state.emit(*self.select(logits, self._no_drafts[:b], sampled))
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
                 exact: bool = False, settled: bool = False, slots: int, lanes: int = 1, ring: int = 64,
                 linear: str = "gemm", distributions: bool = False):
        cfg = drafter.config
        gamma = gamma or cfg.block_size
        counts = (counts,) if isinstance(counts, int) else tuple(sorted(set(counts)))
        if not counts or not all(0 <= k <= self.most_drafts(gamma) for k in counts) or counts == (0,):
            raise ValueError(f"counts {counts}: a block of {gamma} verifies 0 to {self.most_drafts(gamma)} "
                             "drafts, and some count drafts")
        self.counts, self.settled = counts, settled
        self.k, self.gamma, self.exact = max(counts), gamma, exact
        super().__init__(model, tuple(cfg.target_layer_ids), slots, ring, linear, lanes)
        d = cfg.decoder
        # with `distributions`, the block's slots' logits and hidden states instead (`tree_iteration`)
        self.draft = BatchedDFlashStep(capturable(drafter), self.embed, gamma, cache=LaneKV,
                                       distributions=distributions, picks=not distributions).to(self.device).eval()
        self.draft_kv = _pooled_kv(d.num_hidden_layers, lanes, slots, d.num_key_value_heads, d.head_dim,
                                   self.dtype, self.device)
        device, width = self.device, cfg.num_context_features * cfg.target_hidden_size
        self.kept = torch.zeros(lanes, dtype=torch.long, device=device)  # valid rows of `feats`
        self.feats = torch.zeros(lanes, gamma, width, dtype=self.dtype, device=device)  # [L, γ, n·Ht]
        self._masks = torch.full((lanes, gamma - 1), cfg.mask_token_id, dtype=torch.long, device=device)
        self._gamma = torch.full((lanes,), gamma, dtype=torch.long, device=device)
        self._no_drafts = torch.zeros(lanes, 0, dtype=torch.long, device=device)

    @property
    def proposed(self) -> int:
        return self.gamma - 1

    def most_drafts(self, gamma: int) -> int:
        """The most drafts an iteration of a block of `gamma` verifies."""
        return gamma - 1

    def vacate(self, lane: int) -> None:
        super().vacate(lane)
        self.kept[lane] = 0  # its feed's rows from position 0 on

    def keys(self) -> tuple:
        """Every count, and `SETTLED` where asked."""
        return self.counts + ((SETTLED,) if self.settled else ())

    def prefill(self, lane: int, prompt_ids: list[int], params: SamplingParams | None = None,
                slots: int | None = None) -> None:
        """The prompt's rows, and their taps into the lane's drafter cache."""
        taps = self.prompt(lane, prompt_ids, params, slots)[1]  # [n, n·Ht]
        positions = torch.arange(taps.shape[0], device=self.device)
        self.draft.drafter.add_context(taps[None], LaneKV(lanes_of(self.draft_kv, lane, 1, slots or self.slots),
                                                          torch.zeros_like(positions), positions))
        self.kept[lane] = 0

    def step(self, b: int, k, sampled: bool, slots: int) -> tuple:
        s = self.state
        pending = s.pending[:b]
        if k is SETTLED:  # a plain step whose row the drafter never needs
            logits = self.verify(pending[:, None], slots)[0]
            s.emit(*self.select(logits, self._no_drafts[:b], sampled))
            return ()
        drafts = self._propose(b, slots)[:, :k] if k else self._no_drafts[:b]  # [B, k]
        if not k:  # the kept rows only
            self._propose(b, slots, block=False)
        logits, _, taps = self.verify(torch.cat([pending[:, None], drafts], dim=1), slots)
        ids, n = self.select(logits, drafts, sampled)
        self._keep(b, taps, n)
        s.emit(ids, n)
        return ()

    def _propose(self, b: int, slots: int, block: bool = True):
        """The first B lanes' kept rows fed to the drafter and, with `block`, their blocks
        proposed (see the module docstring) -> the draft step's output."""
        s = self.state
        seq, offset = self.index(b, self.gamma)
        feed_pos = (s.pos[:b, None] - self.kept[:b, None] + offset).reshape(-1)
        feats = self.feats[:b].reshape(b * self.gamma, -1)
        draft_kv = lanes_of(self.draft_kv, 0, b, slots)
        if not block:
            self.draft.drafter.add_context(feats[None], LaneKV(draft_kv, seq, feed_pos))
            return None
        lanes_block = torch.cat([s.pending[:b, None], self._masks[:b]], dim=1)  # [B, γ]
        return self.draft(feats, feed_pos, seq, lanes_block, self.index(b, 1)[0], s.pos[:b], self._gamma[:b],
                          *draft_kv)

    def _keep(self, b: int, taps: torch.Tensor, n: torch.Tensor) -> None:
        """The active lanes keep taps [B, r, n·Ht] (their first n+1 rows count) for the next feed."""
        active, r = self.state.active[:b].bool(), taps.shape[1]
        self.feats[:b, :r].copy_(torch.where(active[:, None, None], taps, self.feats[:b, :r]))
        self.kept[:b].copy_(torch.where(active, n + 1, self.kept[:b]))


class MTPIteration(_Verifying):
    """An MTP head's chain of k, the confidence stop as a device mask (see the module
    docstring)."""

    def __init__(self, model, head, k: int, *, stop: DraftStop | None = None, exact: bool = False,
                 plain: bool = False, slots: int, lanes: int = 1, ring: int = 64, linear: str = "gemm"):
        if k < 1:
            raise ValueError(f"k = {k}: a chain has at least one draft")
        self.k, self.stop, self.exact, self.plain = k, stop, exact, plain
        super().__init__(model, (), slots, ring, linear, lanes)
        d = head.config.decoder
        self.head = BatchedMTPStep(capturable(head), cache=LaneKV).to(self.device).eval()
        self.head_kv = _pooled_kv(d.num_hidden_layers, lanes, slots, d.num_key_value_heads, d.head_dim,
                                  self.dtype, self.device)
        self.next_logits = torch.zeros(lanes, d.vocab_size, dtype=self.dtype, device=self.device)  # [L, V]
        self.next_h = torch.zeros(lanes, d.hidden_size, dtype=self.dtype, device=self.device)  # [L, H]
        self._no_drafts = torch.zeros(lanes, 0, dtype=torch.long, device=self.device)

    def _entries(self, tokens, hidden, pos, seq, last, lanes: slice, active, slots: int) -> None:
        """Head entries (token p+1, target hidden p) for rows tokens/hidden/pos/seq [N] of the
        lanes `lanes` (seq counting from its start) over their caches' first `slots` slots; row
        `last` [B] of each lane seeds its next chain (an inactive lane's seed stays)."""
        kv = lanes_of(self.head_kv, lanes.start, lanes.stop - lanes.start, slots)
        logits, h = self.head(self.embed(tokens), hidden, pos, seq, *kv)
        self.next_logits[lanes].copy_(torch.where(active[:, None], logits.index_select(0, last), self.next_logits[lanes]))
        self.next_h[lanes].copy_(torch.where(active[:, None], h.index_select(0, last), self.next_h[lanes]))

    def prefill(self, lane: int, prompt_ids: list[int], params: SamplingParams | None = None,
                slots: int | None = None) -> None:
        """The prompt's rows, and its head entries in the lane (token p+1 for p < n−1, then the
        pending), in pieces of `PROMPT_ROWS`; the last piece's last entry seeds the chain."""
        hidden = self.prompt(lane, prompt_ids, params, slots)[0]
        n = len(prompt_ids)
        tokens = torch.cat([torch.tensor(prompt_ids[1:], dtype=torch.long, device=self.device),
                            self.state.pending[lane:lane + 1]])
        one = torch.ones(1, dtype=torch.bool, device=self.device)
        for start in range(0, n, PROMPT_ROWS):
            pos = torch.arange(start, min(n, start + PROMPT_ROWS), device=self.device)
            self._entries(tokens[pos], hidden[pos], pos, torch.zeros_like(pos), pos[-1:] - start,
                          slice(lane, lane + 1), one, slots or self.slots)

    def _counted(self, probs: torch.Tensor) -> torch.Tensor | None:
        """probs [B, k] (each draft's top-1 probability) -> the drafts the stop lets count: the
        chain goes on after draft i while p_i (or p_1·…·p_i) >= TAU, and the draft that trips
        it counts ([B]); None without a stop."""
        if self.stop is None or self.k == 1:
            return None
        p = probs.cumprod(1) if self.stop.cumulative else probs
        return (p[:, :-1] >= self.stop.tau).long().cumprod(1).sum(1) + 1

    def keys(self) -> tuple:
        """k, and with `plain` 0: a plain step whose row the head still takes."""
        return ((0,) if self.plain else ()) + (self.k,)

    def step(self, b: int, k: int, sampled: bool, slots: int) -> tuple:
        s = self.state
        seq1 = self.index(b, 1)[0]
        if not k:  # a plain step: its row's head entry, no chain
            target_logits, hidden = self.verify(s.pending[:b, None], slots)[:2]
            ids, n = self.select(target_logits, self._no_drafts[:b], sampled)
            self._entries(ids.reshape(-1), hidden.reshape(b, -1), s.pos[:b], seq1, seq1, slice(0, b),
                          s.active[:b].bool(), slots)
            s.emit(ids, n)
            return ()
        logits, h = self.next_logits[:b], self.next_h[:b]
        head_kv = lanes_of(self.head_kv, 0, b, slots)
        drafts, probs = [], []
        for j in range(k):
            if j:  # a speculative entry: the last draft with the head's own output, at pos + j − 1
                logits, h = self.head(self.embed(drafts[-1]), h, s.pos[:b] + (j - 1), seq1, *head_kv)
            p, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)  # [B] each
            drafts.append(tok)
            probs.append(p)
        d = torch.stack(drafts, dim=1)  # [B, k]
        target_logits, hidden = self.verify(torch.cat([s.pending[:b, None], d], dim=1), slots)[:2]
        ids, n = self.select(target_logits, d, sampled, self._counted(torch.stack(probs, dim=1)))
        seq, offset = self.index(b, k + 1)
        rows = seq1 * (k + 1) + n  # each lane's last kept row
        self._entries(ids.reshape(-1), hidden.reshape(b * (k + 1), -1), (s.pos[:b, None] + offset).reshape(-1),
                      seq, rows, slice(0, b), s.active[:b].bool(), slots)
        s.emit(ids, n)
        return ()
