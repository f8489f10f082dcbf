"""Per-rank shards of a DFlash drafter for `metrale build --draft-tp-size N`.

The builder quantizes the whole drafter first (every NVFP4 global scale from the whole
unsharded tensor) and only then cuts its engine state into N shards with the runtime's layout
(`runtime.models.tp.drafter_cut`): rank r's `rank{r}.safetensors` holds its KV heads with their
query groups, its slice of the MLP intermediate and of the LM head's vocab rows, its heads' rows of
the stacked context K/V projection, and a copy of everything else. Because the cut comes after
the quantization, the ranks' bytes put back in rank order are exactly the one-rank drafter's
bytes (`runtime.models.tp.merge_drafter_state` is the inverse, which a one-rank load of a
sharded build uses).

Refusals, before any quantizing (`check_drafter_tp`): N < 1; fewer KV heads than ranks; under NVFP4, a column cut (o_proj's heads, down_proj's intermediate) off a 16-weight
block boundary. Each message names the flag and the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from metrale.plugins import formats
from metrale.runtime.models.configs import DFlashConfig
from metrale.runtime.errors import ConfigError
from metrale.runtime.models.tp import check_drafter_split, cut_tensor, drafter_cut, shard_range


def resolve_build_tp(tp: int | str) -> int:
    """The rank count a build cuts: `auto` is 1 at build time (the world size is a serve's)."""
    return 1 if tp == "auto" else tp


def check_drafter_tp(cfg: DFlashConfig, size: int, fmt: str | None, name: str = "dflash") -> None:
    """Refuse `--draft-tp-size size` for drafter `name` at a tier of format `fmt` before any work."""
    if type(size) is not int or size < 1:
        raise ConfigError(f"--draft-tp-size: expected a rank count of at least 1, got {size!r}")
    check_drafter_split(cfg, size, f"--draft-tp-size (drafter {name})")
    unit_cols = formats.FORMATS[fmt].col_unit if fmt is not None else 1
    if unit_cols == 1:  # any column cut keeps whole scale blocks
        return
    d = cfg.decoder
    group = d.num_attention_heads // d.num_key_value_heads * d.head_dim  # a KV head's queries
    for module, count, unit in (("self_attn.o_proj", d.num_key_value_heads, group),
                                ("mlp.down_proj", d.intermediate_size, 1)):
        for r in range(size):
            start, end = shard_range(count, r, size)
            if (start * unit) % unit_cols or (end * unit) % unit_cols:
                raise ConfigError(
                    f"--draft-tp-size {size} (drafter {name}): {fmt.upper()} {module} would be cut at "
                    f"column {start * unit}..{end * unit} of {count * unit} on rank {r}; column "
                    f"cuts must fall on {unit_cols}-weight block boundaries")


def shard_drafter(state: Mapping[str, torch.Tensor], cfg: DFlashConfig,
                  size: int) -> list[dict[str, torch.Tensor]]:
    """The engine state (one rank, quantized) cut into `size` per-rank states, rank order."""
    check_drafter_split(cfg, size)
    if size == 1:
        return [dict(state)]
    return [{name: cut_tensor(name, t, drafter_cut(name, cfg), r, size) for name, t in state.items()}
            for r in range(size)]


def shard_bytes(shards: list[Mapping[str, torch.Tensor]]) -> list[int]:
    """Weight bytes per rank (replicated tensors counted on every rank)."""
    return [sum(t.nbytes for t in s.values()) for s in shards]
