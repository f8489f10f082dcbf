"""`--dflash-adaptive-k`'s cost model: measured ms per decode step by draft count (given on the
command line, or measured by `metrale calibrate` and `bench`), and the number formats the
speculative flags parse."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from metrale.runtime.errors import ConfigError

DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
UINT = re.compile(r"\d+")
COST_ALLOWED = "expected drafts:ms pairs over consecutive counts from 0 or 1, e.g. 0:32,1:44,2:50"


def quoted(value: object) -> str:
    """A value quoted for a message the way the seeds print it: `"0"`."""
    return json.dumps(value if isinstance(value, str) else str(value))


@dataclass(frozen=True)
class CostModel:
    """`--dflash-adaptive-k`: measured ms per decode step, for consecutive draft counts.

    `ms[i]` is the cost of a step verifying `first + i` drafts; `first` is 0 (the model knows
    the plain decode step, so it may suspend speculation) or 1. `acceptance`: the drafter's
    per-position acceptance measured with the table (`metrale calibrate`, `bench`), the
    controller's prior for a new stream; None for a table given on the command line.
    """

    first: int
    ms: tuple[float, ...]
    acceptance: float | None = None

    def __post_init__(self) -> None:
        if self.first not in (0, 1):
            raise ConfigError(
                f"--dflash-adaptive-k: counts start at {self.first}; expected them to start "
                "at 0 or 1"
            )
        if self.max_count < 1:
            raise ConfigError(
                f"--dflash-adaptive-k: got {quoted(str(self))}; expected at least one draft count "
                "of 1 or more"
            )
        for count, ms in self.pairs():
            if not (math.isfinite(ms) and ms > 0.0):
                raise ConfigError(
                    f"--dflash-adaptive-k: count {count} costs {quoted(ms)} ms; expected a finite "
                    "number of ms above 0"
                )

    @property
    def counts(self) -> range:
        return range(self.first, self.first + len(self.ms))

    @property
    def max_count(self) -> int:
        return self.first + len(self.ms) - 1

    def cost(self, count: int) -> float:
        if count not in self.counts:
            raise KeyError(count)
        return self.ms[count - self.first]

    def up_to(self, count: int) -> CostModel:
        """The same table (and acceptance) over its counts up to `count` (its first at least)."""
        return CostModel(self.first, self.ms[:max(1, count + 1 - self.first)], self.acceptance)

    def plus_rows(self, ms: float) -> CostModel:
        """The table with `ms` more for each row a step verifies (count + 1: its drafts and the
        pending token), as host work per row (a grammar's) adds to a measured table."""
        return CostModel(self.first, tuple(m + ms * (c + 1) for c, m in self.pairs()), self.acceptance)

    @property
    def row_ms(self) -> float:
        """What one more target row costs, ms: the mean step from 1 draft to the most (each
        draft is one more verify row), or, in a table of counts 0 and 1 only, the whole step
        from 0 to 1 (the propose included: an upper bound); never below 0."""
        lo = 1 if self.max_count >= 2 else self.first
        if self.max_count == lo:
            return 0.0
        return max(0.0, (self.cost(self.max_count) - self.cost(lo)) / (self.max_count - lo))

    def pairs(self) -> list[tuple[int, float]]:
        return list(zip(self.counts, self.ms))

    @classmethod
    def parse(cls, s: str) -> CostModel:
        allowed = COST_ALLOWED
        counts: list[int] = []
        costs: list[float] = []
        for item in s.split(","):
            count, sep, ms = item.strip().partition(":")
            count, ms = count.strip(), ms.strip()
            if not (sep and UINT.fullmatch(count) and DECIMAL.fullmatch(ms)):
                raise ConfigError(
                    f"--dflash-adaptive-k: malformed pair {quoted(item)} in {quoted(s)}; {allowed}"
                )
            n = int(count)
            if n in counts:
                raise ConfigError(
                    f"--dflash-adaptive-k: count {n} appears twice in {quoted(s)}; {allowed}"
                )
            if counts and n != counts[-1] + 1:
                raise ConfigError(
                    f"--dflash-adaptive-k: count {n} follows {counts[-1]} in {quoted(s)}; counts must "
                    f"be consecutive; {allowed}"
                )
            counts.append(n)
            costs.append(float(ms))
        if counts[0] not in (0, 1):
            raise ConfigError(
                f"--dflash-adaptive-k: counts in {quoted(s)} start at {counts[0]}; {allowed}"
            )
        return cls(first=counts[0], ms=tuple(costs))

    def __str__(self) -> str:
        return ",".join(f"{c}:{ms!r}" for c, ms in self.pairs())
