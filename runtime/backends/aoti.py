"""The `aoti` backend: the decode loop's steps as AOTInductor packages compiled by `metrale build`.

An engine directory built with CPU engines holds, under `<component>/cpu/`, the packages of
`aoti_steps`' steps, and each component's manifest entry a `cpu` entry::

    target: {"packages": [{"file": "target/cpu/steps.pt2", "rows": 64, "dynamic_rows": true,
                           "batched": true}],
             "taps": [0, 1, 3], "max_slots": 1216, "torch": "2.13.0", "isa": "AVX2",
             "machine": "x86_64", "dtype": "float32", "threads": 1, "check": {...}}
    mtp:    {"packages": [{"file": "mtp/cpu/steps.pt2", "rows": 8, "dynamic_rows": true}], ...}
    dflash: {"packages": [{"file": "dflash/cpu/propose.pt2", "feed": 8, "block": 8}], ...}

Every package takes its K/V caches with a dynamic slot count S (at most `max_slots`): a request
sizes its caches once, to its own length rounded up to 64 slots, and every step runs over them.
The target's and the MTP head's packages also take their row count as a dynamic dimension
(1..rows): one package serves decode steps, verifies of any draft count and prompt chunks,
with no padding rows. (Packages of fixed row counts, which earlier builds wrote, still load: a
step runs the smallest with at least its rows, padded.)

The target's package of current builds is batched: one call runs the rows of many sequences,
each over its own cache in a pool (`aoti_batched.BatchedTarget`, the target's face). Packages
of one sequence per call, which earlier builds wrote, run on `CompiledTarget`.

`CompiledTarget` has the target model's decode face (`__call__(ids, cache, start, taps)` ->
`TargetOutput`, `new_cache`, `config`, `model.embed_tokens`), `CompiledMTP` the MTP head's and
`CompiledDFlash` the drafter's (`new_cache`, `add_context`, `propose`), so the decode loop and
the proposers run on them unchanged. A row's bits depend on its position and context only,
never on how many rows its step had (see `aoti_steps`; the build checks it), so chunkwise verify
emits plain greedy decoding's tokens exactly. Prompts longer than the package's rows are fed in
chunks of them. (Padding rows of a fixed-row package write K/V into slots the next step
overwrites before any query sees them.)
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.runtime.backend_registry import BACKENDS
from metrale.runtime.artifact.engine import LoadedEngine
from metrale.runtime.artifact.entries import ComponentEntry, CpuPackage, CpuPackages
from metrale.runtime.components import KINDS
from metrale.runtime.models.kv_cache import move_path
from metrale.runtime.errors import EngineDirError
from metrale.runtime.models.layers import pack_for_inference
from metrale.runtime.models.qwen3 import Qwen3ForCausalLM, TargetOutput

log = logging.getLogger(__name__)

SLOT_ALIGN = 64  # a request's cache slots are its length rounded up to this


def cpu_isa() -> str:
    """The vector ISA torch's CPU kernels dispatch to here (what compiled code was tuned for)."""
    return torch.backends.cpu.get_cpu_capability()


def build_fingerprint(dtype: torch.dtype, threads: int) -> dict:
    """What a package is built for; a package runs only where all of it matches."""
    return {"torch": torch.__version__.split("+")[0], "isa": cpu_isa(), "machine": platform.machine(),
            "dtype": str(dtype).removeprefix("torch."), "threads": threads}


class StaticKVCache:
    """One sequence's K/V as the packages take them: per layer K and V [S, nkv, hd], slot-major.
    `length` counts the valid positions."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, dtype, device="cpu"):
        shape = (slots, kv_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * layers)]
        self.length = 0
        self.pending: list[torch.Tensor] = []  # drafter context rows not yet fed (CompiledDFlash)

    @property
    def max_len(self) -> int:
        return self.kv[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.kv[0].device

    def keep_path(self, base: int, path: list[int]) -> None:
        """After a draft tree's verify written from slot `base` (node i at slot base+i): the
        accepted path's nodes `path` move to base+1.., as a chain verify of the path writes
        them (`kv_cache.KVCache.keep_path`); the length becomes base+1+len(path)."""
        with torch.inference_mode():  # (a graph target's static buffers are inference tensors)
            move_path([(t, 0) for t in self.kv], base, path)  # [S, nkv, hd]
        self.length = base + 1 + len(path)


@dataclass(frozen=True)
class Package:
    rows: int  # its row count, or with `dynamic` the most rows it takes
    run: object  # the loaded model: a list of inputs -> outputs (`aoti_native.load_runner`)
    dynamic: bool = False  # compiled with the row count as a dynamic dimension (1..rows)
    batched: bool = False  # a step over many sequences at once, over cache pools (`aoti_batched`)

    @property
    def lanes(self) -> int:
        """Calls it can run at once, on as many threads (`aoti_native.Lanes`)."""
        return getattr(self.run, "lanes", 1)

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self.run(list(inputs))


def slots_for(length: int, max_slots: int, what: str) -> int:
    slots = -(-length // SLOT_ALIGN) * SLOT_ALIGN
    if slots > max_slots:
        raise ValueError(f"{what}: a sequence of {length} positions needs {slots} cache slots; the "
                         f"CPU packages hold at most {max_slots}")
    return slots


def _width(pkg, n: int) -> int:
    """The rows a call of `pkg` for n real rows runs: n, or its static row count (padding)."""
    return n if getattr(pkg, "dynamic", False) else pkg.rows


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [1, n, ...] -> [1, rows, ...] with zero rows after the n real ones."""
    n = x.shape[1]
    return x if n == rows else torch.cat([x, x.new_zeros(1, rows - n, *x.shape[2:])], dim=1)


class _Rows:
    """Packages of one step by row count: `pick(n)` is the smallest with at least n rows."""

    def __init__(self, packages: list[Package], where: str):
        if not packages or not any(p.rows == 1 or getattr(p, "dynamic", False) for p in packages):
            raise EngineDirError(f"{where}: no one-row CPU package")
        self.packages = sorted(packages, key=lambda p: p.rows)
        self.max_rows = self.packages[-1].rows

    def pick(self, n: int) -> Package:
        return next(p for p in self.packages if p.rows >= n)


class TargetFace:
    """What a compiled target's face keeps of the eager model (the drafters embed with its
    embedding; config, dtype) and how it cuts the packages' taps to the layers asked for."""

    def __init__(self, model: Qwen3ForCausalLM, taps: tuple[int, ...], max_slots: int):
        self.model_ref = model
        self.config = model.config
        self.model = model.model
        self.lm_head = model.lm_head
        self.taps = tuple(taps)
        self.max_slots = max_slots

    @property
    def dtype(self) -> torch.dtype:
        return self.model_ref.dtype

    def select_taps(self, every: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
        """The columns of layers `taps` from the packages' taps (in `self.taps`' order)."""
        if tuple(taps) == self.taps:
            return every
        h = self.config.hidden_size
        cols = [every[..., self.taps.index(i) * h:(self.taps.index(i) + 1) * h] for i in taps]
        return cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)


class CompiledTarget(TargetFace):
    """The target's decode face over AOTInductor packages (see the module docstring)."""

    @classmethod
    def from_packages(cls, model, loaded: list[tuple[CpuPackage, Package]], cpu: CpuPackages, where: str):
        return cls(model, [p for _, p in loaded], tuple(cpu.taps), cpu.max_slots)

    def __init__(self, model: Qwen3ForCausalLM, packages: list[Package], taps: tuple[int, ...],
                 max_slots: int):
        super().__init__(model, taps, max_slots)
        self.rows = _Rows(packages, "target")
        self.packages = self.rows.packages
        self.max_rows = self.rows.max_rows

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A cache of `max_len` positions plus one padded step, rounded up to 64 slots."""
        if batch != 1:
            raise ValueError("the aoti backend decodes one sequence per cache")
        c = self.config
        slots = slots_for(max_len + self.max_rows, self.max_slots, "target")
        return StaticKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, slots,
                             self.dtype, self.model.embed_tokens.weight.device)

    def _package(self, rows: int, cache: StaticKVCache):
        return self.rows.pick(rows)

    def __call__(self, ids: torch.Tensor, cache: StaticKVCache, start: int | None = None,
                 taps: tuple[int, ...] = ()) -> TargetOutput:
        """ids [1, T] at positions start.. (default cache.length); cache.length becomes start+T."""
        start = cache.length if start is None else start
        out = self._chunks(ids, cache, start, taps)
        cache.length = start + ids.shape[1]
        return out

    def _chunks(self, ids: torch.Tensor, cache: StaticKVCache, start: int, taps: tuple[int, ...],
                hide: torch.Tensor | None = None) -> TargetOutput:
        """ids [1, T] from slot `start` on, in package calls of at most `max_rows` rows (a later
        chunk reads what an earlier wrote), the padding rows dropped; `hide` [T]: a draft tree's
        rows' hidden drafts (`TargetStep`), passed to packages that take them (the padding rows
        hide nothing)."""
        t = ids.shape[1]
        logits, hidden, tapped = [], [], []
        for c0 in range(0, t, self.max_rows):
            chunk = ids[:, c0:c0 + self.max_rows]  # [1, n]
            n = chunk.shape[1]
            pkg = self._package(n, cache)
            width = _width(pkg, n)
            if start + c0 + width > cache.max_len:
                raise ValueError(f"positions up to {start + c0 + width} exceed the cache's "
                                 f"{cache.max_len} slots")
            extra = {} if hide is None else {"hide": _pad_rows(hide[None, c0:c0 + n], width)[0]}
            outs = pkg(_pad_rows(chunk, width), torch.tensor([start + c0]), *cache.kv, **extra)
            if n < width:  # padding rows: not the caller's
                outs = [o[:, :n] for o in outs]
            logits.append(outs[0])
            hidden.append(outs[1])
            if self.taps:
                tapped.append(outs[2])
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)  # noqa: E731
        tap = self.select_taps(cat(tapped), taps) if taps else None
        return TargetOutput(logits=cat(logits), last_hidden=cat(hidden), taps=tap)


class CompiledMTP:
    """The MTP head's face (`mtp.MTPHead`: `new_cache`, `__call__`) over its packages."""

    @classmethod
    def from_packages(cls, head, loaded: list[tuple[CpuPackage, Package]], cpu: CpuPackages, where: str):
        return cls(head, [p for _, p in loaded], cpu.max_slots)

    def __init__(self, head, packages: list[Package], max_slots: int):
        self.rows = _Rows(packages, "mtp")
        self.config = head.config
        self.max_slots = max_slots

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device="cpu") -> StaticKVCache:
        d = self.config.decoder
        slots = slots_for(max_len + self.rows.max_rows, self.max_slots, "mtp")
        return StaticKVCache(1, d.num_key_value_heads, d.head_dim, slots, dtype, device)

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: StaticKVCache,
                 start: int | None = None):
        """Entries start.. of embeds/hidden [1, T, H] -> (logits [1, T, V], h [1, T, H])."""
        start = cache.length if start is None else start
        t, step = embeds.shape[1], self.rows.max_rows
        logits, hs = [], []
        for c0 in range(0, t, step):
            n = min(step, t - c0)
            pkg = self.rows.pick(n)
            width = _width(pkg, n)
            outs = pkg(_pad_rows(embeds[:, c0:c0 + n], width), _pad_rows(hidden[:, c0:c0 + n], width),
                       torch.tensor([start + c0]), *cache.kv)
            logits.append(outs[0][:, :n])
            hs.append(outs[1][:, :n])
        cache.length = start + t
        if len(logits) == 1:
            return logits[0], hs[0]
        return torch.cat(logits, dim=1), torch.cat(hs, dim=1)


class CompiledDFlash:
    """The DFlash/DFlash2 drafter's face (`new_cache`, `add_context`, `propose`) over its one
    package, which feeds up to `feed` context rows and proposes a block in one call: context
    added with `add_context` waits in the cache's `pending` rows and enters the drafter's cache
    with the next propose. A longer backlog (a prompt, or the plain steps of a suspended
    adaptive-k stream) is fed first by the eager drafter's own context projection (`context_kv`,
    one batched call) up to the last `feed` rows, which the package feeds with the block."""

    distributions = False  # drafts only: no blocks' distributions for a draft tree
    without_distributions = "CPU package gives drafts only (built before draft trees)"

    @classmethod
    def from_packages(cls, drafter, loaded: list[tuple[CpuPackage, Package]], cpu: CpuPackages, where: str):
        entry, pkg = loaded[0]
        if entry.block != drafter.config.block_size or entry.feed is None:
            raise EngineDirError(f"{where}: the CPU package proposes blocks of {entry.block} from "
                                 f"{entry.feed} context rows; the drafter's block size is "
                                 f"{drafter.config.block_size}")
        return cls(drafter, pkg, entry.feed, cpu.max_slots)

    def __init__(self, drafter, package: Package, feed: int, max_slots: int):
        self.config = drafter.config
        self.eager = drafter  # its context projection feeds long backlogs
        self.tp = None
        self.package, self.feed, self.max_slots = package, feed, max_slots
        self.block = drafter.config.block_size
        self._mask = torch.full((1, self.block), drafter.config.mask_token_id, dtype=torch.long)

    @property
    def candidate_selector(self):
        """DFlash2's candidate selector (the eager drafter's): a draft tree scores a node's
        children with it (`spec.ddtree.SelectorChildren`)."""
        return self.eager.candidate_selector

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device="cpu") -> StaticKVCache:
        d = self.config.decoder
        slots = slots_for(max_len + self.feed, self.max_slots, "dflash")
        return StaticKVCache(d.num_hidden_layers, d.num_key_value_heads, d.head_dim, slots, dtype, device)

    def add_context(self, features: torch.Tensor, cache: StaticKVCache) -> None:
        cache.pending.append(features)

    def _run(self, rows: torch.Tensor, cache: StaticKVCache, anchor: int, gamma: int) -> torch.Tensor:
        n = rows.shape[1]
        if cache.length + self.feed > cache.max_len:
            raise ValueError(f"drafter context up to {cache.length + self.feed} exceeds the cache's "
                             f"{cache.max_len} slots")
        block = self._mask.clone()
        block[0, 0] = anchor
        drafts = self.package(_pad_rows(rows, self.feed), torch.tensor([n]), torch.tensor([cache.length]),
                              block, torch.tensor([gamma]), *cache.kv)[0]
        cache.length += n
        return drafts

    def _feed_eagerly(self, rows: torch.Tensor, cache: StaticKVCache) -> None:
        n, start = rows.shape[1], cache.length
        if start + n + self.feed > cache.max_len:
            raise ValueError(f"drafter context up to {start + n + self.feed} exceeds the cache's "
                             f"{cache.max_len} slots")
        positions = torch.arange(start, start + n)
        for i, (k, v) in enumerate(self.eager.context_kv(rows, positions)):  # [1, nkv, n, hd]
            cache.kv[2 * i][start:start + n] = k[0].transpose(0, 1)
            cache.kv[2 * i + 1][start:start + n] = v[0].transpose(0, 1)
        cache.length = start + n

    def propose(self, anchor: torch.Tensor, embed, cache: StaticKVCache, gamma: int, tree_nodes: int = 0):
        """anchor [1] at position cache.length + pending rows -> γ−1 greedy drafts (no logits:
        the batched face, `aoti_dflash.BatchedDFlash`, gives the distributions a tree reads)."""
        from metrale.runtime.models.dflash import Proposal

        if not 1 < gamma <= self.block:
            raise ValueError(f"γ = {gamma}: the drafter's CPU package proposes blocks of 2..{self.block}")
        rows = cache.pending[0] if len(cache.pending) == 1 else (
            torch.cat(cache.pending, dim=1) if cache.pending else None)
        cache.pending = []
        if rows is None:
            rows = torch.zeros(1, 0, self.config.num_context_features * self.config.target_hidden_size,
                               dtype=cache.kv[0].dtype)
        if rows.shape[1] > self.feed:  # the backlog's older rows, in one eager projection
            self._feed_eagerly(rows[:, :-self.feed], cache)
            rows = rows[:, -self.feed:]
        drafts = self._run(rows, cache, int(anchor.reshape(-1)[0]), gamma)
        return Proposal(tokens=drafts[:gamma - 1][None], logits=None)


def check_fingerprint(cpu: CpuPackages, dtype: torch.dtype, where: str) -> None:
    """Refuse packages built for another torch, ISA, machine or dtype, naming both."""
    built, here = cpu.fingerprint(), build_fingerprint(dtype, cpu.threads)
    for key in ("torch", "isa", "machine", "dtype"):
        if built[key] != here[key]:
            raise EngineDirError(
                f"{where}: the CPU packages were built for {key} {built[key]!r}, this process "
                f"has {here[key]!r}; rebuild the engine here or use --backend torch")


def _load_packages(engine_dir: Path, cpu: CpuPackages) -> list[tuple[CpuPackage, Package]]:
    from metrale.runtime.backends.aoti_native import load_runner

    out = []
    for entry in cpu.packages:
        run = load_runner(Path(engine_dir) / entry.file, lanes=torch.get_num_threads())
        out.append((entry, Package(entry.rows or 1, run, entry.dynamic_rows, entry.batched)))
    return out


def load_compiled(engine_dir: Path, name: str, info: ComponentEntry, model, dtype: torch.dtype):
    """The compiled face of component `name` from its manifest entry's `cpu` packages."""
    cpu = info.cpu
    where = f"engine directory {engine_dir}: {name}"
    if cpu is None:
        raise EngineDirError(f"{where}: it has no CPU packages (build it with --cpu-engines aoti)")
    check_fingerprint(cpu, dtype, where)  # another machine's packages: say so first
    if not cpu.packages:
        raise EngineDirError(f"{where}: its manifest entry lists no CPU packages; rebuild the "
                             "engine with metrale build --cpu-engines aoti")
    face = BACKENDS["aoti"].face(KINDS[info.kind].shape)
    return face.from_packages(model, _load_packages(engine_dir, cpu), cpu, where)


# -- the swaps -------------------------------------------------------------------------------


def use_cpu_drafters(engine: LoadedEngine, required: bool) -> None:
    """Swap the MTP head and each one-rank drafter for its AOTInductor packages where the
    engine directory has them (a tensor-parallel drafter keeps running eagerly); `required`
    (`--backend aoti`): packages that do not load are an error, not a fallback."""
    for name, info in engine.manifest.components.items():
        if name == "target" or info.cpu is None:
            continue
        model = engine.component(name)
        if model is None or getattr(model, "tp", None) is not None:
            continue
        if name in engine.requantized:  # the packages hold the weights of the built tier
            engine.backend_note = (f"{name} runs eagerly: its CPU packages hold the weights it was "
                                   f"built with, not these ({engine.requantized[name]})")
            log.info("engine directory %s: %s", engine.path, engine.backend_note)
            continue
        try:
            compiled = load_compiled(engine.path, name, info, pack_for_inference(model), engine.dtype)
        except (EngineDirError, RuntimeError, OSError) as exc:
            if required:
                raise EngineDirError(f"--backend aoti: engine directory {engine.path}: {name}: {exc}") from None
            engine.backend_note = f"{name} runs eagerly: its CPU packages do not load ({exc})"
            log.info("engine directory %s: %s", engine.path, engine.backend_note)
            continue
        engine.place(name, KINDS[info.kind].role, compiled)


def use_cpu_packages(engine: LoadedEngine, info: ComponentEntry, required: bool) -> None:
    """Swap the target's decode face for its AOTInductor packages (see this module); `required`
    as `use_cpu_drafters`'."""
    where = f"engine directory {engine.path}"
    why = None
    if engine.device.type != "cpu":
        why = f"the CPU packages run on the CPU, not {engine.device}"
    elif info.cpu is None:
        why = "it has no CPU packages (build it with --cpu-engines aoti)"
    if why is None:
        try:
            pack_for_inference(engine.target)
            engine.target = load_compiled(engine.path, "target", info, engine.target, engine.dtype)
            engine.backend = BACKENDS["aoti"]
            return
        except EngineDirError as exc:
            if required:
                raise
            why = str(exc)
        except (RuntimeError, OSError) as exc:  # the package's code would not load here
            why = f"its CPU packages do not load in this process ({exc})"
    if required:
        raise EngineDirError(f"--backend aoti: {where}: {why}")
    if info.cpu is not None and engine.device.type == "cpu":  # packages there, but not runnable here
        engine.backend_note = f"CPU packages not used, running eager torch: {why}"
    log.info("%s: running eager torch (%s)", where, why)
