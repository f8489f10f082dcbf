"""The `aoti` backend: the target's steps as AOTInductor packages compiled by `metrale build`.

An engine directory built with CPU engines holds, under `target/cpu/`, one package per (rows T,
slots S) pair (`t{T}.s{S}.pt2`) and the manifest's `cpu` entry of the target component::

    {"packages": [{"file": "target/cpu/t1.s256.pt2", "rows": 1, "slots": 256}, ...],
     "taps": [0, 1, 3], "torch": "2.13.0", "isa": "AVX2", "dtype": "float32", "threads": 1}

`CompiledTarget` has the target model's decode face (`__call__(ids, cache, start, taps)` ->
`TargetOutput`, `new_cache`, `config`, `model.embed_tokens`), so the decode loop and the
proposers run on it unchanged. Per step it runs the smallest package with at least the step's
rows (rows past the step's are padding: their K/V land in slots the next step overwrites before
any query sees them) over the request's slot bucket, which is fixed for the whole request: a
row's bits then depend on its position and context only, never on how many rows its step had
(see `cpu_steps`), so chunkwise verify emits plain greedy decoding's tokens exactly.
Prompts longer than the widest package are fed in chunks of its rows.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.runtime.errors import EngineDirError
from metrale.runtime.qwen3 import Qwen3ForCausalLM, TargetOutput

log = logging.getLogger(__name__)


def cpu_isa() -> str:
    """The vector ISA torch's CPU kernels dispatch to here (what compiled code was tuned for)."""
    return torch.backends.cpu.get_cpu_capability()


def build_fingerprint(dtype: torch.dtype, threads: int) -> dict:
    """What a package is built for; a package runs only where all of it matches."""
    return {"torch": torch.__version__.split("+")[0], "isa": cpu_isa(), "machine": platform.machine(),
            "dtype": str(dtype).removeprefix("torch."), "threads": threads}


class StaticKVCache:
    """One sequence's target K/V as the packages take them: per layer K and V [S, nkv, hd],
    slot-major so a prefix is contiguous. `length` counts the valid positions."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, dtype, device="cpu"):
        shape = (slots, kv_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * layers)]
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.kv[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.kv[0].device


@dataclass(frozen=True)
class Package:
    rows: int
    slots: int
    run: object  # the loaded AOTInductor callable


class CompiledTarget:
    """The target's decode face over AOTInductor packages (see the module docstring)."""

    def __init__(self, model: Qwen3ForCausalLM, packages: list[Package], taps: tuple[int, ...]):
        if not packages:
            raise EngineDirError("the target has no CPU packages")
        self.model_ref = model  # embedding (drafters embed with it), config, dtype
        self.config = model.config
        self.model = model.model
        self.lm_head = model.lm_head
        self.taps = tuple(taps)
        self.packages = sorted(packages, key=lambda p: (p.slots, p.rows))
        self.slot_buckets = sorted({p.slots for p in packages})
        self.max_rows = max(p.rows for p in packages)

    @property
    def dtype(self) -> torch.dtype:
        return self.model_ref.dtype

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A cache of the smallest slot bucket that holds `max_len` positions plus one padded step."""
        if batch != 1:
            raise ValueError("the aoti backend decodes one sequence per cache")
        need = max_len + self.max_rows
        fits = [s for s in self.slot_buckets if s >= need]
        if not fits:
            raise ValueError(f"a sequence of {max_len} positions needs {need} slots; the CPU "
                             f"packages hold at most {self.slot_buckets[-1]}")
        c = self.config
        return StaticKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, fits[0],
                             self.dtype, self.model.embed_tokens.weight.device)

    def _package(self, rows: int, slots: int) -> Package:
        for p in self.packages:
            if p.slots == slots and p.rows >= rows:
                return p
        raise AssertionError(f"no package for {rows} rows over {slots} slots")  # checked at load

    def __call__(self, ids: torch.Tensor, cache: StaticKVCache, start: int | None = None,
                 taps: tuple[int, ...] = ()) -> TargetOutput:
        """ids [1, T] at positions start.. (default cache.length); cache.length becomes start+T."""
        start = cache.length if start is None else start
        t = ids.shape[1]
        slots = cache.max_len
        logits, hidden, tapped = [], [], []
        for c0 in range(0, t, self.max_rows):
            chunk = ids[:, c0:c0 + self.max_rows]  # [1, n]
            n = chunk.shape[1]
            pkg = self._package(n, slots)
            if start + c0 + pkg.rows > slots:
                raise ValueError(f"positions up to {start + c0 + pkg.rows} exceed the cache's {slots} slots")
            if pkg.rows > n:
                chunk = torch.cat([chunk, chunk.new_zeros(1, pkg.rows - n)], dim=1)
            outs = pkg.run(chunk, torch.tensor([start + c0]), *cache.kv)
            logits.append(outs[0][:, :n])
            hidden.append(outs[1][:, :n])
            if self.taps:
                tapped.append(outs[2][:, :n])
        cache.length = start + t
        tap = None
        if taps:
            h = self.config.hidden_size
            every = torch.cat(tapped, dim=1) if len(tapped) > 1 else tapped[0]  # [1, T, n·H]
            cols = [every[..., self.taps.index(i) * h:(self.taps.index(i) + 1) * h] for i in taps]
            tap = cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)  # noqa: E731
        return TargetOutput(logits=cat(logits), last_hidden=cat(hidden), taps=tap)


def check_fingerprint(info: dict, dtype: torch.dtype, where: str) -> None:
    """Refuse packages built for another torch, ISA, machine or dtype, naming both."""
    here = build_fingerprint(dtype, info.get("threads", 1))
    for key in ("torch", "isa", "machine", "dtype"):
        if info.get(key) != here[key]:
            raise EngineDirError(
                f"{where}: the CPU packages were built for {key} {info.get(key)!r}, this process "
                f"has {here[key]!r}; rebuild the engine here or use --backend torch")


def load_compiled_target(engine_dir: Path, info: dict, model: Qwen3ForCausalLM) -> CompiledTarget:
    """The target's packages listed in its manifest entry (`info["cpu"]`), loaded."""
    import torch._inductor

    cpu = info["cpu"]
    where = f"engine directory {engine_dir}: target"
    check_fingerprint(cpu, model.dtype, where)
    packages = []
    for entry in cpu["packages"]:
        run = torch._inductor.aoti_load_package(str(Path(engine_dir) / entry["file"]))
        packages.append(Package(int(entry["rows"]), int(entry["slots"]), run))
    for slots in {p.slots for p in packages}:
        if 1 not in {p.rows for p in packages if p.slots == slots}:
            raise EngineDirError(f"{where}: no one-row package for {slots} slots")
    return CompiledTarget(model, packages, tuple(cpu.get("taps", ())))
