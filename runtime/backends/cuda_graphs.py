"""The `cuda-graphs` backend: the target's decode and verify steps replayed as CUDA graphs.

What `--backend auto` runs on a CUDA device (`--backend torch` there stays plain eager). The
step is `aoti_steps.TargetStep`: the packed target's own forward over a `step_caches.SlotKV`
cache, run as eager torch modules on the GPU and captured, as gpt-fast does with its decode step, once per row count of
`ROWS` and slot bucket of `slot_buckets(...)` into a `torch.cuda.CUDAGraph`:

- `GraphRunner` owns every input the graphs read: one static ids tensor [1, T] per row count,
  one position tensor [1], and one static KV set (per layer K and V [S_max, nkv, hd]) whose
  prefixes `[:S]` are the slot buckets' caches (a prefix of a slot-major buffer is contiguous,
  see `step_caches`), so every bucket shares the same memory. Each graph is warmed up on a side
  stream before its capture (as PyTorch's docs require); all graphs share one memory pool,
  which is safe because they replay one after another on one stream and every output is cloned
  before the next replay.
- `run(ids, pos, *kv)` of a (rows, slots) package copies ids and pos into the static inputs,
  refuses kv tensors that are not the bucket's static ones (`ForeignCache`), replays, and
  returns clones of the outputs. The packages plug into `aoti.CompiledTarget` as
  `GraphPackage` callables: padding, chunking of long prompts and the per-request slot bucket
  are its own; its `new_cache` asks `GraphRunner.new_cache` for the bucket's static views.
- One sequence at a time, as the decode loop runs (the server decodes one request at a time):
  handing out a cache retires the one handed out before it, whose later use is refused instead
  of silently sharing the buffers. A handed-out cache starts zeroed.

Exact verify (one row per forward) replays the one-row graph exactly as plain decoding does, so
greedy output is plain decoding's token for token; chunkwise verify replays a multi-row graph,
whose rows may differ from one-row steps in the last bits (cuBLAS picks kernels by M).

`graphs` abstracts capture and replay: `CudaGraphs` on a GPU; `EagerGraphs` runs the captured
function again at each replay, writing into the captured outputs as a replay does, so the
runner's bookkeeping is testable without a GPU, and checks that the replay dispatched what the
capture did (`graph_trace`), which a graph would replay. Only tests and `scripts/lane_costs.py`
pass `EagerGraphs`. `load_graph_target` raises on any failure; `use_cuda_graphs` falls back to
eager torch and records why.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from metrale.runtime.backend_registry import BACKENDS
from metrale.runtime.backends import TreeRows
from metrale.runtime.backends.aoti import CompiledTarget, StaticKVCache
from metrale.runtime.backends.graph_trace import OpTrace, check_capture, check_replay
from metrale.runtime.backends.host_reads import forbid_host_reads
from metrale.runtime.models.layers import capturable
from metrale.runtime.models.qwen3 import TargetOutput
from metrale.runtime.models.step_caches import BASE_SLOTS, buckets_to
from metrale.runtime.artifact.engine import LoadedEngine

log = logging.getLogger(__name__)

ROWS = (1, 8, 16)  # one-row decode steps; verify steps of up to 8 / 16 rows, prompt chunks
WARMUP = 3  # eager runs on a side stream before each capture


class ForeignCache(ValueError):
    """kv tensors a graph cannot read: not the runner's static buffers, or a retired cache's."""


def slot_buckets(max_positions: int, rows: int = ROWS[-1]) -> tuple[int, ...]:
    """The base buckets below the top one, ×4 steps above them while under half the top, then
    the top: `max_positions` plus room for a padded step and the decode loop's margin (64
    slots, at least `rows` + 17)."""
    return buckets_to(max_positions + max(64, rows + 17))


class CudaGraphs:
    """Capture and replay with `torch.cuda.CUDAGraph`, all graphs in one memory pool."""

    name = "cuda-graphs"

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def warmup(self, fn) -> None:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()

    def capture(self, fn, generators=()):
        """-> (graph, outputs): the outputs are the graph's static output tensors. `generators`:
        the random generators `fn` draws from besides the default one, registered so each
        replay draws afresh from their state."""
        graph = torch.cuda.CUDAGraph()
        for g in generators:
            if g.device.type == "cuda":
                graph.register_generator_state(g)
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool):
            outs = fn()
        torch.cuda.synchronize(self.device)
        return graph, outs

    def replay(self, graph) -> None:
        graph.replay()


class _Recorded:
    def __init__(self, fn, outs, trace: OpTrace, what: str):
        self.fn, self.outs, self.trace, self.what = fn, outs, trace, what
        self.replays = 0


def _traced(fn, generators, what: str):
    """fn() under the host-read guard and an op trace -> (its results, the trace)."""
    with forbid_host_reads(what), OpTrace(generators) as trace:
        outs = tuple(fn())
        trace.returned(outs)
    return outs, trace


class EagerGraphs:
    """A stand-in with `CudaGraphs`' face for machines without CUDA (tests, CPU measurements):
    `capture` runs the function once and keeps it with its outputs and the ops it dispatched;
    `replay` runs it again and copies its results into those outputs, which is what a replay
    leaves in a graph's static outputs. Replays are checked against the capture
    (`graph_trace.check_replay`: what a graph would run instead): a graph's first `CHECK_FIRST` replays and every `CHECK_EVERY`-th after them (a
    host value that changes every iteration differs at the first; one that changes per
    request, within the request's first few iterations), since a checked replay costs several
    times an unchecked one. `check=False` checks none (`scripts/lane_costs.py` times the
    stand-in's own cost)."""

    name = "eager-graphs"
    CHECK_FIRST, CHECK_EVERY = 4, 8

    def __init__(self, device: torch.device | None = None, check: bool = True):
        self.captured = 0
        self.replays = 0
        self.check = check

    def warmup(self, fn) -> None:
        for _ in range(WARMUP):
            fn()

    def capture(self, fn, generators=()):
        self.captured += 1
        what = f"captured {fn!r}"
        outs, trace = _traced(fn, generators, what)
        check_capture(trace, what)
        return _Recorded(fn, outs, trace, what), outs

    def replay(self, graph: _Recorded) -> None:
        self.replays += 1
        graph.replays += 1
        if self.check and (graph.replays <= self.CHECK_FIRST or graph.replays % self.CHECK_EVERY == 0):
            now, trace = _traced(graph.fn, graph.trace.generators, graph.what)
            check_replay(graph.trace, trace, graph.what)
        else:
            now = tuple(graph.fn())
        for out, value in zip(graph.outs, now):
            out.copy_(value)


class GraphKVCache(StaticKVCache):
    """A cache over a runner's static KV views; `retired` once a later cache is handed out."""

    def __init__(self, kv: list[torch.Tensor], slots: int, device: torch.device):
        self.kv, self.length = kv, 0
        self.slots, self._device = slots, device
        self.retired = False

    @property
    def max_len(self) -> int:
        return self.slots

    @property
    def device(self) -> torch.device:
        return self._device


class GraphRunner:
    """Static inputs, static KV, one captured graph per (rows, slots); see the module docstring."""

    def __init__(self, step: torch.nn.Module, *, layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, rows: tuple[int, ...] = ROWS,
                 slots: tuple[int, ...] = BASE_SLOTS, graphs=None):
        self.step, self.device = step, torch.device(device)
        self.graphs = graphs if graphs is not None else CudaGraphs(self.device)
        self.rows, self.slots = tuple(sorted(set(rows))), tuple(sorted(set(slots)))
        if 1 not in self.rows:
            raise ValueError(f"rows {self.rows}: the one-row decode step is needed")
        with torch.inference_mode():
            shape = (self.slots[-1], kv_heads, head_dim)
            self.kv = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2 * layers)]
            self.views = {s: [t[:s] for t in self.kv] for s in self.slots}
            self.ids = {r: torch.zeros(1, r, dtype=torch.long, device=self.device) for r in self.rows}
            self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
            # each row's hidden drafts (`TargetStep`'s `hide`): zeros but for a draft tree's rows
            self.hide = {r: torch.zeros(r, dtype=torch.long, device=self.device) for r in self.rows}
        self.captured: dict[tuple[int, int], tuple[object, tuple[torch.Tensor, ...]]] = {}
        self.replays = 0
        self._current = None  # weakref to the cache handed out last

    def capture_all(self) -> "GraphRunner":
        """Warm up and capture every (rows, slots) graph; raises on the first failure."""
        with torch.inference_mode():
            for s in self.slots:
                for r in self.rows:
                    fn = self._step_fn(r, s)
                    self.graphs.warmup(fn)
                    graph, outs = self.graphs.capture(fn)
                    self.captured[(r, s)] = (graph, tuple(outs))
            for t in self.kv:  # warm-up and capture wrote K/V of dummy tokens
                t.zero_()
        log.info("%s: captured %d target step graphs (rows %s, slots %s)", self.graphs.name,
                 len(self.captured), self.rows, self.slots)
        return self

    def _step_fn(self, rows: int, slots: int):
        ids, pos, kv, step, hide = self.ids[rows], self.pos, self.views[slots], self.step, self.hide[rows]
        return lambda: step(ids, pos, *kv, hide=hide)

    def new_cache(self, slots: int) -> GraphKVCache:
        """The bucket's static views, zeroed, as a fresh cache; the previous cache is retired."""
        if slots not in self.views:
            raise ValueError(f"no CUDA graphs over {slots} slots (buckets: {self.slots})")
        old = self._current() if self._current is not None else None
        if old is not None:
            old.retired, old.kv = True, []
        with torch.inference_mode():
            for t in self.views[slots]:
                t.zero_()
        cache = GraphKVCache(list(self.views[slots]), slots, self.device)
        self._current = weakref.ref(cache)
        return cache

    def package(self, rows: int, slots: int) -> "GraphPackage":
        return GraphPackage(rows, slots, lambda *inputs, hide=None: self.run(rows, slots, *inputs, hide=hide))

    def packages(self) -> list["GraphPackage"]:
        return [self.package(r, s) for (r, s) in sorted(self.captured)]

    def run(self, rows: int, slots: int, ids: torch.Tensor, pos: torch.Tensor,
            *kv: torch.Tensor, hide: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """One replay: ids [1, rows] from slot pos on; `hide` [rows], a draft tree's rows'
        hidden drafts (`TargetStep`)."""
        graph, outs = self.captured[(rows, slots)]
        mine = self.views[slots]
        if len(kv) != len(mine) or any(a is not b for a, b in zip(kv, mine)):
            what = ("a retired cache: a later new_cache took the buffers (this target decodes "
                    "one sequence at a time)") if not kv else \
                f"{len(kv)} tensors that are not them (a cache not made by this target's new_cache)"
            raise ForeignCache(f"the CUDA-graph target reads only its own static KV buffers of "
                               f"{slots} slots; got {what}")
        if tuple(ids.shape) != (1, rows):
            raise ValueError(f"ids {tuple(ids.shape)}: the {rows}-row graph takes [1, {rows}]")
        with torch.inference_mode():
            self.ids[rows].copy_(ids, non_blocking=True)
            self.pos.copy_(pos.reshape(1), non_blocking=True)
            if hide is not None:
                self.hide[rows].copy_(hide, non_blocking=True)
            self.graphs.replay(graph)
            if hide is not None:  # the next replay's rows hide nothing unless told
                self.hide[rows].zero_()
            self.replays += 1
            return tuple(o.clone() for o in outs)

    def stats(self) -> dict:
        return {"graphs": len(self.captured), "replays": self.replays, "rows": list(self.rows),
                "slots": list(self.slots), "kind": self.graphs.name}


@dataclass(frozen=True)
class GraphPackage:
    """One captured (rows, slots) step as `CompiledTarget` calls a package."""

    rows: int
    slots: int
    fn: object

    def __call__(self, *inputs: torch.Tensor, hide: torch.Tensor | None = None):
        return self.fn(*inputs, hide=hide)


class GraphTarget(CompiledTarget, TreeRows):
    """`CompiledTarget` over a `GraphRunner`'s packages, its caches the runner's static views:
    a request's cache is the smallest slot bucket it fits, and each step replays the graph of
    its rows over that bucket. A draft tree's rows replay the same graphs with their hidden
    drafts (`forward_tree`)."""

    tree_rows = True

    def __init__(self, model, runner: GraphRunner, taps: tuple[int, ...]):
        packages = runner.packages()
        super().__init__(model, packages, taps, max_slots=runner.slots[-1])
        self.runner = runner
        self.slot_buckets = list(runner.slots)
        self.by_shape = {(p.rows, p.slots): p for p in packages}

    def _package(self, rows: int, cache: StaticKVCache):
        return self.by_shape[(self.rows.pick(rows).rows, cache.max_len)]

    def forward_tree(self, f) -> TargetOutput:
        """A draft tree's rows (`Forward.tree`) in one forward, chunked by the graphs' rows as a
        prompt is (a later chunk reads what an earlier wrote): node i at slot length + i, its
        hidden drafts (`Tree.hidden_bits`) in the graphs' `hide`; the padding rows hide nothing
        and are dropped. The cache's length stays, for `keep_path`."""
        device = f.cache.device
        return self._chunks(torch.tensor([list(f.tree.tokens)], device=device), f.cache, f.cache.length,
                            f.taps, torch.tensor(f.tree.hidden_bits(), device=device))

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        if batch != 1:
            raise ValueError("the cuda-graphs backend decodes one sequence per cache")
        need = max_len + self.max_rows
        fits = [s for s in self.slot_buckets if s >= need]
        if not fits:
            raise ValueError(f"a sequence of {max_len} positions needs {need} slots; the CUDA "
                             f"graphs hold at most {self.slot_buckets[-1]}")
        return self.runner.new_cache(fits[0])


def load_graph_target(model, taps: tuple[int, ...], *, rows: tuple[int, ...] = ROWS,
                      slots: tuple[int, ...] | None = None, graphs=None) -> GraphTarget:
    """Capture the packed `model`'s steps (see the module docstring); raises on any failure."""
    from metrale.runtime.backends.aoti_steps import TargetStep

    c = model.config
    device = model.model.embed_tokens.weight.device
    step = TargetStep(capturable(model), taps, "gemm").to(device).eval()
    runner = GraphRunner(step, layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads,
                         head_dim=c.head_dim, dtype=model.dtype, device=device, rows=rows,
                         slots=slots or slot_buckets(c.max_position_embeddings, max(rows)),
                         graphs=graphs)
    return GraphTarget(model, runner.capture_all(), taps)


# -- the swap --------------------------------------------------------------------------------


def graph_taps(engine: LoadedEngine) -> tuple[int, ...]:
    """Every target layer a loaded drafter reads, in first-seen order."""
    return tuple(dict.fromkeys(i for d in engine.drafters.values() for i in d.config.target_layer_ids))


def use_cuda_graphs(engine: LoadedEngine, graphs=None) -> None:
    """Swap the target's decode face for its steps captured as CUDA graphs (see this module);
    on any failure keep eager torch, logging and recording why (`engine.backend_note`).
    `graphs` replaces the CUDA capture (tests pass `cuda_graphs.EagerGraphs`)."""
    model, why = engine.target, None
    try:
        # every model packed now, once: a graph replays the weights' addresses at capture, so a
        # later pack that fused them again would leave it reading freed memory
        engine.pack()
        target = load_graph_target(model, graph_taps(engine), graphs=graphs)
    except Exception as exc:  # noqa: BLE001 - any capture failure leaves the eager target
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:  # out of the handler: the traceback's frames (and their buffers) are gone
        engine.target, engine.backend = model, BACKENDS["torch"]
        engine.backend_note = f"CUDA graphs failed, running eager torch: {why}"
        log.warning("engine directory %s: %s", engine.path, engine.backend_note)
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()
        return
    engine.target, engine.backend = target, BACKENDS[target.runner.graphs.name]
    engine.backend_note = ""
