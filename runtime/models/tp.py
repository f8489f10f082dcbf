"""Tensor parallelism of the DFlash drafter over `torch.distributed` (gloo on CPU, NCCL on GPU).

Which drafter tensors a rank holds (`drafter_cut`, the one table; the builder cuts with it, the
loader merges with it): rank r of N holds a contiguous run of KV heads (`shard_range`: they
must cover every rank, and split unevenly when N does not divide them, e.g. 2, 1, 1 of 4 over
3 ranks) with their query heads (q/k/v rows, o_proj columns), a slice of the MLP intermediate (gate/up rows, down_proj columns), a slice of the LM
head's vocab rows, and, per layer, its heads' k and v rows of the stacked `context_kv_proj`.
Everything else (`fc`, norms, DFlash2's convs and candidate selector) is replicated. Slices are
contiguous, `shard_range` decides them, and quantized leaves follow their weight: FP8 row scales
and NVFP4 block scales are cut with their rows (or columns, in units of 16 weights); NVFP4 global
scales and FP8 scales of a column cut are replicated. So the shards of one tensor, put back in
rank order (per layer and k/v block for `context_kv_proj`), are exactly the one-rank bytes.

Collectives of a propose (`TensorParallel`): one all-reduce (sum) after each layer's o_proj and
one after its down_proj, then one all-gather of every rank's top candidates from its vocab slice
(values and global ids in one float32 message) from which every rank forms the same global
top-k. Invariant: every rank calls the same collectives in the same order; the replicated decode
guarantees it, and each all-gather also carries the anchors and the cache length so that ranks
whose decodes diverged are refused instead of silently mixing two sequences' partial sums.

`World` is the process group as launched (`torchrun` sets RANK / WORLD_SIZE; one process
without it): the leader (rank 0) broadcasts each request to the other ranks, and `agree` checks
that a flag has the same value on every rank.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from metrale.runtime.models.configs import DecoderConfig, DFlashConfig
from metrale.runtime.errors import ConfigError, EngineDirError, MetraleError

FP32_EXACT_IDS = 1 << 24  # token ids ride in float32 with the candidate values: exact below this
TOP_CANDIDATES = 16  # candidates each rank sends per slot (the DFlash2 selector's K)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous slice of `total` units; the first total % size ranks
    get one unit more."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class Cut:
    """How a tensor is split: its dimension `dim` is `blocks` equal blocks, each of `count` units
    of `unit` weights; every rank takes its `shard_range` of the units from every block."""

    dim: int
    blocks: int
    count: int
    unit: int

    @property
    def length(self) -> int:
        """The dimension's length in weights (a packed or block-scale tensor stores less)."""
        return self.blocks * self.count * self.unit


_LAYER_LINEAR = re.compile(r"layers\.\d+\.(?:self_attn\.([qkvo])_proj|mlp\.(gate|up|down)_proj)")


def drafter_cut(name: str, cfg: DFlashConfig) -> Cut | None:
    """How the drafter's engine tensor `name` (module naming, ModelOpt leaves) is split over
    ranks; None: every rank holds all of it."""
    module, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "weight_scale"):  # weight_scale_2 (NVFP4 global) is replicated
        return None
    d = cfg.decoder
    heads, kv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    if module == "lm_head":
        return Cut(0, 1, d.vocab_size, 1)
    if module == "context_kv_proj":  # per layer: k rows then v rows of every KV head
        return Cut(0, 2 * d.num_hidden_layers, kv, hd)
    m = _LAYER_LINEAR.fullmatch(module)
    if m is None:
        return None
    attn, mlp = m.groups()
    group = heads // kv * hd  # a KV head's query heads, in weights: they go where it goes
    return {"q": Cut(0, 1, kv, group), "k": Cut(0, 1, kv, hd), "v": Cut(0, 1, kv, hd),
            "o": Cut(1, 1, kv, group), "gate": Cut(0, 1, d.intermediate_size, 1),
            "up": Cut(0, 1, d.intermediate_size, 1),
            "down": Cut(1, 1, d.intermediate_size, 1)}[attn or mlp]


def _stored_slices(name: str, t: torch.Tensor, cut: Cut, rank: int, size: int) -> list[slice]:
    """The slices of t's stored dimension `cut.dim` rank r holds, one per block."""
    stored = t.shape[cut.dim]
    if cut.length % stored:
        raise EngineDirError(f"{name}: dimension {cut.dim} stores {stored}, which does not "
                             f"divide its {cut.length} weights")
    per = cut.length // stored  # 1, 2 (packed FP4) or 16 (NVFP4 block scales)
    start, end = shard_range(cut.count, rank, size)
    a, b = start * cut.unit, end * cut.unit  # in weights, within a block
    if a % per or b % per:
        raise ConfigError(
            f"--draft-tp-size {size}: {name} would be cut at weight {a}..{b} of each "
            f"{cut.count * cut.unit}, off its {per}-weight storage blocks (NVFP4 column cuts "
            "must fall on 16-weight block boundaries)")
    block = cut.count * cut.unit // per
    return [slice(i * block + a // per, i * block + b // per) for i in range(cut.blocks)]


def cut_tensor(name: str, t: torch.Tensor, cut: Cut | None, rank: int, size: int) -> torch.Tensor:
    """Rank's shard of the one-rank tensor t (contiguous; a replicated tensor is t itself)."""
    if cut is None or cut.dim >= t.dim():  # e.g. the FP8 row scale of a column-cut weight
        return t
    pieces = [t.narrow(cut.dim, s.start, s.stop - s.start)
              for s in _stored_slices(name, t, cut, rank, size)]
    return torch.cat(pieces, dim=cut.dim).contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def merge_tensor(name: str, shards: list[torch.Tensor], cut: Cut | None) -> torch.Tensor:
    """The one-rank tensor from its shards in rank order (the inverse of `cut_tensor`)."""
    if cut is None or cut.dim >= shards[0].dim():
        for r, s in enumerate(shards[1:], 1):
            if s.shape != shards[0].shape or not (s.is_meta or torch.equal(_bytes(s), _bytes(shards[0]))):
                raise EngineDirError(f"{name}: replicated tensor differs between rank 0 and rank {r}")
        return shards[0]
    per_rank = [s.chunk(cut.blocks, dim=cut.dim) for s in shards]  # [rank][block]
    return torch.cat([p for b in range(cut.blocks) for p in (r[b] for r in per_rank)], dim=cut.dim)


def merge_drafter_state(shards: list[Mapping[str, torch.Tensor]],
                         cfg: DFlashConfig) -> dict[str, torch.Tensor]:
    """The one-rank engine state from its per-rank shards (the inverse of the builder's cut)."""
    names = list(shards[0])
    for r, s in enumerate(shards[1:], 1):
        if set(s) != set(names):
            odd = sorted(set(s) ^ set(names))[0]
            raise EngineDirError(f"drafter shards hold different tensors: {odd} on one of ranks 0, {r}")
    return {n: merge_tensor(n, [s[n] for s in shards], drafter_cut(n, cfg)) for n in names}


def local_decoder(d: DecoderConfig, rank: int, size: int) -> DecoderConfig:
    """The drafter decoder shapes rank holds: its heads, intermediate slice and vocab slice."""
    def count(total: int) -> int:
        start, end = shard_range(total, rank, size)
        return end - start

    kv = count(d.num_key_value_heads)
    return replace(d, num_attention_heads=kv * (d.num_attention_heads // d.num_key_value_heads),
                   num_key_value_heads=kv,
                   intermediate_size=count(d.intermediate_size), vocab_size=count(d.vocab_size))


def check_drafter_split(cfg: DFlashConfig, size: int, what: str = "--draft-tp-size") -> None:
    """Refuse a rank count the drafter's heads or vocab cannot be split over."""
    d = cfg.decoder
    if type(size) is not int or size < 1:
        raise ConfigError(f"{what}: expected a rank count of at least 1, got {size!r}")
    if d.num_key_value_heads < size:
        raise ConfigError(
            f"{what} {size}: the drafter's {d.num_key_value_heads} KV heads do not cover "
            f"{size} ranks; expected at most {d.num_key_value_heads} ranks")
    if d.vocab_size >= FP32_EXACT_IDS:
        raise ConfigError(f"{what} {size}: a vocabulary of {d.vocab_size} tokens is too large "
                          f"for the candidate all-gather (ids must stay below {FP32_EXACT_IDS})")


@dataclass
class CollectiveStats:
    """Host-side seconds and calls per collective kind (on CUDA, NCCL calls are asynchronous:
    the seconds are their launch cost unless the caller synchronizes)."""

    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, seconds: float) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def mean_us(self, kind: str) -> float:
        return 1e6 * self.seconds.get(kind, 0.0) / max(self.calls.get(kind, 0), 1)


@dataclass
class TensorParallel:
    """This process's place in the drafter's tensor-parallel group (the whole world)."""

    rank: int
    size: int
    stats: CollectiveStats = field(default_factory=CollectiveStats)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")

    def range(self, total: int) -> tuple[int, int]:
        return shard_range(total, self.rank, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x [...] over the ranks, in place; returns x."""
        t0 = time.perf_counter()
        dist.all_reduce(x)
        self.stats.add("all_reduce", time.perf_counter() - t0)
        return x

    def top_candidates(self, logits: torch.Tensor, vocab_start: int, k: int, check: torch.Tensor,
                       normalizer: bool = False):
        """logits [..., V_r] of this rank's vocab slice (global ids vocab_start..) -> the global
        top k, (values fp32 [..., k], ids int64 [..., k]) sorted by value, ties to the lower
        rank, the same on every rank; with `normalizer`, also the whole vocabulary's logsumexp
        [...] (what turns the values into log-probabilities: a draft tree's). `check` [c]:
        numbers every rank must hold (the anchors and the cache length); one all-gather carries
        all of it."""
        kr = min(k, logits.shape[-1])
        vals, ids = logits.float().topk(kr, dim=-1)  # [..., kr]
        if kr < k:  # a vocab slice smaller than k: pad with candidates that never win
            pad = list(vals.shape[:-1]) + [k - kr]
            vals = torch.cat([vals, vals.new_full(pad, float("-inf"))], dim=-1)
            ids = torch.cat([ids, ids.new_zeros(pad)], dim=-1)
        lse = logits.float().logsumexp(-1).flatten() if normalizer else vals.new_zeros(0)  # [m]
        mine = torch.cat([vals.flatten(), (ids + vocab_start).float().flatten(), lse,
                          check.float().flatten()])  # float32 [2·numel + m + c]
        every = [torch.empty_like(mine) for _ in range(self.size)]
        t0 = time.perf_counter()
        dist.all_gather(every, mine)
        self.stats.add("all_gather", time.perf_counter() - t0)
        n, m = vals.numel(), lse.numel()
        checks = [e[2 * n + m:] for e in every]
        if any(not torch.equal(c, checks[0]) for c in checks[1:]):
            raise MetraleError(
                "drafter ranks diverged: anchors and cache length differ between ranks "
                f"({', '.join(str(c.tolist()) for c in checks)}); every rank must decode the "
                "same sequence")
        shape = list(vals.shape[:-1]) + [self.size * k]
        all_vals = torch.stack([e[:n].view(vals.shape) for e in every], dim=-2).reshape(shape)
        all_ids = torch.stack([e[n:2 * n].view(vals.shape) for e in every], dim=-2).reshape(shape)
        order = torch.sort(all_vals, dim=-1, descending=True, stable=True).indices[..., :k]
        top = all_vals.gather(-1, order), all_ids.gather(-1, order).long()
        if not normalizer:
            return top
        total = torch.stack([e[2 * n:2 * n + m] for e in every]).logsumexp(0).view(vals.shape[:-1])
        return (*top, total)


_LAUNCH = "as a torchrun launch (or --nproc) sets it; unset WORLD_SIZE to run one process"


def env_count(name: str, lowest: int, highest: int | None = None, default: int | None = None) -> int:
    """Environment variable `name` (a torchrun launch's) as a whole number from `lowest` to
    `highest`, `default` where it is unset; refused naming it otherwise, or where it is unset
    without a default."""
    text = os.environ.get(name)
    allowed = f"from {lowest} to {highest}" if highest is not None else f"of at least {lowest}"
    if text is None:
        if default is None:
            raise ConfigError(f"{name} is not set: expected an integer {allowed} in the "
                              f"environment, {_LAUNCH}")
        return default
    # ASCII digits only: int() would also take "1_0", " 2" and other scripts' digits
    value = int(text) if text.isascii() and text.isdigit() and len(text) < 10 else -1
    if value < lowest or (highest is not None and value > highest):
        raise ConfigError(f"{name}={text!r}: expected an integer {allowed}, {_LAUNCH}")
    return value


@dataclass(frozen=True)
class World:
    """The processes of one launch: `size` 1 (a plain process) or a `torchrun` world."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str | torch.device = "cpu") -> World:
        """The world `torchrun` describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK),
        joined with gloo on CPU and NCCL on CUDA; a plain process when WORLD_SIZE is unset or 1.
        A variable that is not a count in range, or one the rendezvous needs that is missing, is
        refused naming it, before any process group is joined."""
        size = env_count("WORLD_SIZE", 1, default=1)
        if size == 1:
            return cls()
        local = env_count("LOCAL_RANK", 0, default=0)
        if not dist.is_initialized():
            env_count("RANK", 0, size - 1)  # the env:// rendezvous reads these three
            if not os.environ.get("MASTER_ADDR"):
                raise ConfigError(f"WORLD_SIZE={size} without MASTER_ADDR: expected the rendezvous "
                                  f"address in the environment, {_LAUNCH}")
            env_count("MASTER_PORT", 1, 65535)
        cuda = torch.device(device).type == "cuda"
        if not dist.is_initialized():
            if cuda:
                torch.cuda.set_device(local)
            dist.init_process_group("nccl" if cuda else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), local)

    def device(self, device: str) -> str:
        """`cuda` without an index means this rank's local GPU under a multi-process launch; an
        index there is refused on every rank alike (it would put every rank on one GPU)."""
        if self.size == 1 or not device.startswith("cuda"):
            return device
        if device != "cuda":
            raise ConfigError(f"--device {device}: each of the {self.size} ranks runs on its own GPU "
                              "(its LOCAL_RANK's); use --device cuda")
        return f"cuda:{self.local_rank}"

    def broadcast(self, obj: object = None) -> object:
        """The leader's `obj` on every rank (others pass anything)."""
        if self.size == 1:
            return obj
        box = [obj if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: object) -> list:
        """Every rank's `value`, by rank."""
        if self.size == 1:
            return [value]
        values: list = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def agree(self, value: str, flag: str) -> None:
        """Refuse, on every rank, a flag whose value differs between ranks."""
        if self.size == 1:
            return
        values = self.gather(value)
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ConfigError(f"{flag}: the ranks disagree ({shown}); set the same value on "
                              "every rank")

    def close(self) -> None:
        """Leave the process group together with the other ranks (a rank that exits while
        another still talks to it can make that one abort)."""
        if self.size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    """The command line that re-runs `python -m metrale <argv>` under torchrun with `nproc`
    processes on this host (`--standalone`: a local rendezvous on a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "metrale", *argv]

