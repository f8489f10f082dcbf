"""The decode loop's faces over exported step graphs: what the onnxruntime and tensorrt
backends run (see `backends`), each through its own `GraphRunner`.

`GraphTarget(ids, cache, start=None, taps=())` -> `TargetOutput` with `new_cache`, `.config`,
`.model.embed_tokens` (the one torch module kept: the MTP head and the drafters embed with it);
`GraphMTP(embeds, hidden, cache, start=None)` -> (logits, h) with `new_cache`;
`GraphDrafter.add_context(features, cache)` and `.propose(anchor, embed, cache, gamma)` ->
`Proposal`, with `new_cache` and `.config`. The decode loop and the proposers run unchanged.

The graphs' interface is `builder.onnx_export`'s: each step takes the whole preallocated KV cache
as `past_key`/`past_value` with `position` (the first new position = the number of valid past
entries; slots at or after it are masked), and returns only the new K/V, which the caller writes
at `position`. Caches (`graph_cache.EngineCache`) are torch tensors [L, 1, nkv, S, hd] on the
runner's device in the sizes the runner offers for the profile's past range (`past_sizes`;
default the opt past, the shape TensorRT tuned for, and the max); a cache starts at the smallest
and moves up (its valid positions copied) only when a call would write past it, so short
requests attend over few slots. The target's `config.max_position_embeddings` is capped
(`position_limit`) at the smallest max past of all components less the rows one speculative step
may write beyond the budget, so the decode loop outgrows no component's cache.

A step of more new rows than the profile's `tokens` max runs in chunks of it (a prompt). The
drafter graph adds context and proposes in one call (new context features C ≥ 1, then the block):
`add_context` only queues features on the cache, and `propose` sends them with the block.
Context K/V of a position depend on that position alone, so where the queue outgrows the
profile's context range the surplus is sent ahead with a one-slot dummy block.

A `GraphRunner` has `run(feeds: {input: tensor}, graph_key=None, persistent=()) -> {output:
tensor}` (`graph_key` names a call shape a runner may capture and replay, `persistent` the
inputs that stay the same buffers across those calls), `dtypes` ({name: torch dtype} of every
input and output), `device`, and optionally `past_sizes(opt, top) -> [S, ...]`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Protocol

import torch
from torch import nn

from metrale.runtime.artifact.engine_check import component_config
from metrale.runtime.backends.graph_cache import CacheSizes, EngineCache, position_limit
from metrale.runtime.backend_registry import BackendEntry
from metrale.runtime.backends import TreeRows
from metrale.runtime.components import KINDS, StepShape
from metrale.runtime.models.configs import DecoderConfig, DFlashConfig
from metrale.runtime.models.kv_cache import causal_mask
from metrale.runtime.models.dflash import CandidateSelector, Proposal, candidate_drafts
from metrale.runtime.artifact.engine import LoadedEngine
from metrale.runtime.errors import EngineDirError, MetraleError
from metrale.runtime.models.qwen3 import TargetOutput
from metrale.runtime.models.tp import local_decoder, shard_range
from metrale.runtime.steps import MAX_TREE_NODES

KV = ("past_key", "past_value")


class GraphRunner(Protocol):
    dtypes: dict[str, torch.dtype]
    device: torch.device

    def run(self, feeds: dict[str, torch.Tensor], graph_key=None,
            persistent: tuple[str, ...] = ()) -> dict[str, torch.Tensor]: ...


# -- caches ----------------------------------------------------------------------------------


class _Component:
    """What the three stand-ins share: the runner, the profile ranges and the cache sizes."""

    def __init__(self, runner: GraphRunner, profile: dict, layers: int, cfg: DecoderConfig):
        self.runner, self.profile = runner, profile
        self.max_new = int(profile.get("tokens", profile.get("context", (1, 1, 1)))[2])
        _, opt, top = (int(v) for v in profile["past"])
        self.kv_dtype = runner.dtypes["past_key"]
        sizes = getattr(runner, "past_sizes", None)
        self.sizes = CacheSizes(layers, cfg.num_key_value_heads, cfg.head_dim,
                                sizes(opt, top) if sizes else [opt, top], self.kv_dtype, runner.device)

    def _cache(self, batch: int) -> EngineCache:
        if batch != 1:
            raise ValueError(f"a graph backend decodes one sequence per cache, got batch {batch}")
        return self.sizes.cache()

    def _position(self, pos: int) -> torch.Tensor:
        return torch.full((1,), pos, dtype=torch.int64, device=self.runner.device)


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# -- the stand-ins ---------------------------------------------------------------------------


class GraphTarget(_Component, TreeRows):
    """The target over its step graph. A graph with a `tree_mask` input (`onnx_export.TargetStep`)
    runs a draft tree's rows in one call where its profile takes the largest tree's rows
    (`tree_rows`); every other call feeds it the causal mask."""

    @classmethod
    def from_graph(cls, runner: GraphRunner, name: str, info: dict, cfg: DecoderConfig,
                   ctx) -> "GraphTarget":
        """The target over its graph, with the embedding and the usable context (`ctx`)."""
        return cls(runner, info.profile, cfg, ctx.embed, ctx.engine_taps, ctx.limit)

    def __init__(self, runner: GraphRunner, profile: dict, cfg: DecoderConfig,
                 embed: nn.Embedding, engine_taps: tuple[int, ...], max_positions: int | None = None):
        """`max_positions`: the usable context (`position_limit` over every component's
        profile; default: this engine's own)."""
        super().__init__(runner, profile, cfg.num_hidden_layers, cfg)
        if max_positions is None:
            max_positions = position_limit(cfg.max_position_embeddings, [int(profile["past"][2])])
        self.config = replace(cfg, max_position_embeddings=min(cfg.max_position_embeddings,
                                                               max_positions))
        self.model = SimpleNamespace(embed_tokens=embed)
        self.engine_taps = engine_taps
        self.masked = "tree_mask" in runner.dtypes  # a graph exported before trees has none
        self.tree_rows = self.masked and self.max_new >= MAX_TREE_NODES + 1
        self._causal: dict[int, torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> EngineCache:
        return self._cache(batch)

    def __call__(self, ids: torch.Tensor, cache: EngineCache | None = None, start: int | None = None,
                 taps: tuple[int, ...] = ()) -> TargetOutput:
        """ids [1, T] at positions start.. (default cache.length); the cache length becomes start+T."""
        if cache is None:
            if start:
                raise ValueError("a target step after position 0 needs the cache of the positions before it")
            cache = self.new_cache(1, ids.shape[1])
        start = cache.length if start is None else start
        cache.reserve(start + ids.shape[1])  # before any call: graph keys name the final buffer
        parts = [self._step(ids[:, lo:lo + self.max_new], cache, start + lo)  # [1, t] each
                 for lo in range(0, ids.shape[1], self.max_new)]  # the profile's most rows per call
        cache.length = start + ids.shape[1]
        return self._output(parts, taps)

    forward = __call__

    def forward_tree(self, f) -> TargetOutput:
        """A draft tree's rows (`Forward.tree`) in one call: node i written at slot length + i, at
        position length + its depth, seeing the cache before the root and its own ancestors
        (`Tree.mask` as the graph's `tree_mask`). The cache's length stays, for `keep_path`."""
        cache, tree, device = f.cache, f.tree, self.runner.device
        rows = len(tree.tokens)
        if not self.tree_rows:
            raise ValueError(f"a draft tree of {rows} rows: the target graph takes no tree_mask or "
                             f"its profile takes {self.max_new} rows a call")
        cache.reserve(cache.length + rows)
        out = self._step(torch.tensor([list(tree.tokens)], device=device), cache, cache.length,
                         tree.mask().to(device))
        return self._output([out], f.taps)

    def _step(self, ids: torch.Tensor, cache: EngineCache, start: int,
              mask: torch.Tensor | None = None) -> dict:
        """One graph call: rows ids [1, t] from position `start`, their new K/V written at slots
        start.. ; `mask` [t, t] (a tree's; default the causal one) where the graph takes one."""
        t = ids.shape[1]
        feeds = {"input_ids": ids, "past_key": cache.k, "past_value": cache.v,
                 "position": self._position(start)}
        persistent = KV
        if self.masked:  # a chain's causal mask is one buffer per row count: a graph reads it in place
            feeds["tree_mask"] = self._causal_mask(t) if mask is None else mask
            persistent = KV if mask is not None else (*KV, "tree_mask")
        key = ("step", cache.slot_id) if t == 1 else None
        out = self.runner.run(feeds, graph_key=key, persistent=persistent)
        cache.write_new(start, out["new_key"], out["new_value"])
        return out

    def _causal_mask(self, t: int) -> torch.Tensor:
        mask = self._causal.get(t)
        if mask is None:
            mask = causal_mask(t, 0, self.runner.device)
            self._causal[t] = mask
        return mask

    def _output(self, parts: list[dict], taps: tuple[int, ...]) -> TargetOutput:
        tapped = _cat([p.get("taps") for p in parts]) if taps else None
        return TargetOutput(logits=_cat([p["logits"] for p in parts]),
                            last_hidden=_cat([p["last_hidden"] for p in parts]),
                            taps=self.select_taps(tapped, taps))

    def select_taps(self, tapped: torch.Tensor | None, wanted: tuple[int, ...]) -> torch.Tensor | None:
        """The engine's `taps` [1, T, n·H] (layers `engine_taps`) -> the `wanted` layers' [1, T, m·H]."""
        if not wanted:
            return None
        missing = [i for i in wanted if i not in self.engine_taps]
        if tapped is None or missing:
            raise EngineDirError(f"the target engine taps layers {list(self.engine_taps)}, not "
                                 f"{missing or list(wanted)}; rebuild the engine directory")
        h = self.config.hidden_size
        idx = [self.engine_taps.index(i) for i in wanted]
        if idx == list(range(len(self.engine_taps))):
            return tapped
        return torch.cat([tapped[..., i * h:(i + 1) * h] for i in idx], dim=-1)


class GraphMTP(_Component):
    def __init__(self, runner: GraphRunner, profile: dict, cfg: DecoderConfig):
        super().__init__(runner, profile, 1, cfg)
        self.config = SimpleNamespace(decoder=cfg)

    @classmethod
    def from_graph(cls, runner: GraphRunner, name: str, info: dict, cfg, ctx) -> "GraphMTP":
        return cls(runner, info.profile, cfg.decoder)

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None) -> EngineCache:
        return self._cache(batch)

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: EngineCache,
                 start: int | None = None):
        """Entries start.. : embeds, hidden [1, T, H] -> (logits [1, T, V], h [1, T, H] pre-norm)."""
        start = cache.length if start is None else start
        cache.reserve(start + embeds.shape[1])
        logits, hs = [], []
        for lo in range(0, embeds.shape[1], self.max_new):
            e, h = embeds[:, lo:lo + self.max_new], hidden[:, lo:lo + self.max_new]
            feeds = {"embeds": e, "hidden": h, "past_key": cache.k, "past_value": cache.v,
                     "position": self._position(start + lo)}
            key = ("step", cache.slot_id) if e.shape[1] == 1 else None
            out = self.runner.run(feeds, graph_key=key, persistent=KV)
            cache.write_new(start + lo, out["new_key"], out["new_value"])
            logits.append(out["logits"])
            hs.append(out["hidden_out"])
        cache.length = start + embeds.shape[1]
        return _cat(logits), _cat(hs)

    forward = __call__


def propose_graph_key(slot_id: int, context: int, gamma: int, block_size: int):
    """The CUDA-graph key of a drafter call, or None (eager): a block of γ ≤ block_size slots
    (`--dflash-gamma` may lower γ) with at most γ new context positions — what every step after
    the first brings (accepted drafts + the bonus token), so the keys per buffer stay ≤ γ. A
    longer context (the prompt's) or a one-slot flush block runs eagerly."""
    if 1 < gamma <= block_size and 1 <= context <= gamma:
        return ("propose", slot_id, context, gamma)
    return None


class GraphDrafter(_Component):
    """A drafter over its propose graph. A tensor-parallel rank's graph (`builder.tp_export`:
    `rank` of `size`) holds the drafter's collectives itself, so every rank's graph runs at
    once (one call per rank, in lockstep) and each returns the same global top candidates:
    the drafts come from those, its cache holds the rank's KV heads and its logits are the
    rank's vocab slice."""

    def __init__(self, runner: GraphRunner, profile: dict, cfg: DFlashConfig,
                 codebooks: tuple[torch.Tensor, torch.Tensor] | None, rank: int = 0, size: int = 1):
        d = cfg.decoder if size == 1 else local_decoder(cfg.decoder, rank, size)
        super().__init__(runner, profile, d.num_hidden_layers, d)
        self.config = cfg
        self.vocab_start = shard_range(cfg.decoder.vocab_size, rank, size)[0]
        self.max_context = int(profile["context"][2])
        # a rank graph exported before draft trees gathers no normalizer: its candidates' values
        # are not log-probabilities (`LoadedEngine.block_distributions`)
        self.distributions = size == 1 or "log_normalizer" in runner.dtypes
        self.without_distributions = "rank graphs gather no normalizer (built before draft trees)"
        self.selector = None
        if cfg.version == 2:
            d = cfg.decoder
            sel = CandidateSelector(d.hidden_size, d.vocab_size, cfg.selector_dim, cfg.num_candidates)
            # the engine's `selector_query` is hidden_projection(hidden) already
            sel.hidden_projection = nn.Identity()
            dtype = runner.dtypes["selector_query"]
            sel.predecessor_codebook = nn.Parameter(codebooks[0].to(runner.device, dtype), False)
            sel.successor_codebook = nn.Parameter(codebooks[1].to(runner.device, dtype), False)
            self.selector = sel

    @classmethod
    def from_graph(cls, runner: GraphRunner, name: str, info: dict, cfg: DFlashConfig,
                   ctx) -> "GraphDrafter":
        """Drafter `name` of manifest entry `info` (DFlash2's codebooks read from its safetensors)."""
        if any(i not in ctx.engine_taps for i in cfg.target_layer_ids):
            raise EngineDirError(f"{ctx.where}: drafter {name} reads target layers "
                                 f"{list(cfg.target_layer_ids)}, the target graph taps "
                                 f"{list(ctx.engine_taps)}; rebuild the directory")
        rank = ctx.rank if info.tp_size > 1 else 0
        books = None
        if cfg.version == 2:
            books = tuple(_tensors(ctx.path / name / f"rank{rank}.safetensors",
                                   ("candidate_selector.predecessor_codebook",
                                    "candidate_selector.successor_codebook"), ctx.where))
        return cls(runner, info.profile, cfg, books, rank, info.tp_size)

    def new_cache(self, batch: int, max_len: int, dtype=None, device=None) -> EngineCache:
        return self._cache(batch)

    def add_context(self, features: torch.Tensor, cache: EngineCache) -> None:
        """Queue the features [1, C, n·Ht] of the next C accepted positions (sent with the next
        propose; a queue longer than the profile allows is sent ahead in profile-sized chunks)."""
        cache.pending = features if cache.pending is None else torch.cat([cache.pending, features], 1)
        while cache.pending.shape[1] > self.max_context:
            ahead, cache.pending = cache.pending[:, :self.max_context], cache.pending[:, self.max_context:]
            dummy = torch.zeros(1, 1, self.config.decoder.hidden_size,
                                dtype=self.runner.dtypes["block_embeds"], device=self.runner.device)
            self._run(ahead, dummy, cache)

    def _run(self, context: torch.Tensor, block: torch.Tensor, cache: EngineCache) -> dict:
        c, g = context.shape[1], block.shape[1]
        cache.reserve(cache.length + c)
        feeds = {"context_features": context, "past_key": cache.k, "past_value": cache.v,
                 "position": self._position(cache.length), "block_embeds": block}
        out = self.runner.run(feeds, graph_key=propose_graph_key(cache.slot_id, c, g,
                                                                 self.config.block_size),
                              persistent=KV)
        cache.write_new(cache.length, out["new_key"], out["new_value"])
        cache.length += c
        return out

    def propose(self, anchor: torch.Tensor, embed: nn.Embedding, cache: EngineCache, gamma: int,
                tree_nodes: int = 0) -> Proposal:
        """anchor [1] (the last accepted token, at position cache.length + queued) -> γ−1 drafts,
        with the logits a tree reads; a rank graph's proposal for a tree (`tree_nodes`) carries
        the gathered candidates as log-probabilities (`Proposal.top`)."""
        if cache.pending is None or cache.pending.shape[1] == 0:
            raise RuntimeError("propose needs the context of at least one accepted position first")
        block = torch.full((anchor.shape[0], gamma), self.config.mask_token_id, dtype=torch.long,
                           device=anchor.device)
        block[:, 0] = anchor
        out = self._run(cache.pending, embed(block), cache)
        cache.pending = None
        logits = out["logits"][:, 1:]  # [1, γ−1, V]: slot j predicts position anchor+j
        if "top_ids" in out:  # a tensor-parallel rank: the global candidates, every rank's alike
            top = None
            if tree_nodes:
                if not self.distributions:
                    raise ValueError(f"a draft tree of {tree_nodes} nodes needs the candidates' "
                                     f"log-probabilities, which these {self.without_distributions}")
                top = (out["top_values"][:, 1:] - out["log_normalizer"][:, 1:, None],
                       out["top_ids"][:, 1:])
            return Proposal(tokens=self._tp_drafts(out, anchor), logits=logits,
                            vocab_start=self.vocab_start, hidden=self._query(out), top=top)
        query = self._query(out)
        if self.selector is not None:
            tokens = self.selector.select(query, logits, anchor)
        else:
            tokens = logits.argmax(-1)
        return Proposal(tokens=tokens, logits=logits, hidden=query)

    def _query(self, out: dict) -> torch.Tensor | None:
        """DFlash2's draft slots' `selector_query` [1, γ−1, dim] (None for DFlash)."""
        return out["selector_query"][:, 1:] if self.selector is not None else None

    @property
    def candidate_selector(self):
        """DFlash2's candidate selector over the graph's `selector_query` (a draft tree scores a
        node's children with it, `spec.ddtree.SelectorChildren`)."""
        return self.selector

    def _tp_drafts(self, out: dict, anchor: torch.Tensor) -> torch.Tensor:
        """The drafts of a rank graph's global top candidates (sorted by value: the first is
        the argmax; DFlash2 rescores its first `num_candidates`), after the lockstep check."""
        positions = out["rank_positions"].flatten()
        if not bool((positions == positions[0]).all()):
            raise MetraleError(f"drafter ranks diverged: their cache positions differ "
                               f"({positions.tolist()}); every rank must decode the same sequence")
        return candidate_drafts(self.selector, self.config.num_candidates, self._query(out),
                                out["top_values"][:, 1:], out["top_ids"][:, 1:], anchor)


# -- loading ---------------------------------------------------------------------------------


def _tensors(path: Path, names: tuple[str, ...], where: str) -> list[torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing = [n for n in names if n not in keys]
        if missing:
            raise EngineDirError(f"{where}: {path.name} has no tensor {missing[0]}")
        return [f.get_tensor(n) for n in names]


def load_graph_engine(path: Path, manifest, tokenizer, runner: Callable[[str], GraphRunner],
                      device: torch.device, backend: BackendEntry, rank: int = 0) -> LoadedEngine:
    """Every component's face of `backend` over `runner(name)` (the component's graph: this
    `rank`'s for a tensor-parallel drafter), with the target's embedding and DFlash2's codebooks read from the
    safetensors; the profiles and taps come from the manifest (`trt_build.write_engines`
    records them with each graph)."""
    comps = manifest.components
    where = f"engine directory {path}"
    missing = [n for n, c in comps.items() if c.profile is None]
    if missing:
        raise EngineDirError(f"{where}: component {missing[0]} has no exported graph (built with "
                             "onnx = false); rebuild it with metrale build")

    def config(name: str, info):
        return component_config(path, str(path), name, info)

    tcfg = config("target", comps["target"])
    # the usable context: every component's cache must hold it (plus one step's rows)
    limit = position_limit(tcfg.max_position_embeddings,
                           [c.profile["past"][2] for c in comps.values()])
    tgt = runner("target")
    (weight,) = _tensors(path / "target" / "rank0.safetensors", ("model.embed_tokens.weight",), where)
    embed = nn.Embedding.from_pretrained(weight.to(device, tgt.dtypes["last_hidden"]), freeze=True)
    engine_taps = tuple(comps["target"].taps or ())
    ctx = SimpleNamespace(path=path, where=where, engine_taps=engine_taps, embed=embed, limit=limit,
                          rank=rank)
    target = backend.face(StepShape.TARGET).from_graph(tgt, "target", comps["target"], tcfg, ctx)
    loaded = LoadedEngine(path, manifest, tokenizer, target, dtype=embed.weight.dtype,
                          device=device, packed=True, backend=backend)  # the graphs hold their own weights
    for name, info in comps.items():
        if name == "target":
            continue
        kind = KINDS[info.kind]
        face = backend.face(kind.shape).from_graph(runner(name), name, info, config(name, info), ctx)
        loaded.place(name, kind.role, face)
    return loaded


def runner_stats(engine: LoadedEngine) -> dict:
    """Per component: its runner's counters (eager runs, graph captures and replays, the graph
    mode), what `bench` reports for a graph backend."""
    parts = {"target": engine.target, "mtp": engine.mtp, **engine.drafters}
    return {name: vars(part.runner.stats) for name, part in parts.items() if part is not None}
