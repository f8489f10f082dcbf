"""Speculative decoding flags, parsed once into a frozen config before any model loads.

Contract:
- `HELP` (kept in `spec.help`) holds the `--help` text of every speculative flag (shared by
  `generate` and `serve`).
- `SpeculativeConfig.from_flags(...)` takes the raw values the CLI gives (strings, ints, bools;
  `None` for a flag that was not given) and returns a validated, frozen config, or raises
  `ConfigError` naming the flag, the value and what is allowed.
- `resolve_dflash(cfg, block_size)` checks the DFlash flags against the drafter's block size,
  once the drafter's config is known (still before its weights load).
- `resolve_draft_tp_size(cfg, world_size, num_kv_heads)` does the same for the drafter's
  tensor-parallel degree against the topology.

Invariants: the speculation mode is one `SpecMode` (MTP and DFlash exclude each other); every
default lives in `SpeculativeConfig.__post_init__`, which also holds every cross-flag check, so a
config built directly (or by `dataclasses.replace`) is validated exactly like one from flags.
A flag whose field is `None` was not given; a flag that only one mode reads is refused in the
other modes instead of being silently ignored.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass

from metrale.plugins.formats import DRAFT_TIERS
from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.cost_model import DECIMAL, UINT, CostModel
from metrale.runtime.spec.cost_model import quoted as _q
from metrale.runtime.spec.help import HELP  # noqa: F401  (the flags' --help texts)
from metrale.runtime.steps import MAX_TREE_NODES

log = logging.getLogger(__name__)

DEFAULT_NUM_DRAFTS, MAX_NUM_DRAFTS = 3, 32  # a chain past 32 drafts is never all accepted
DEFAULT_REPROBE_INTERVAL = 16
TREE_VERIFY = ("auto", "forward", "paths")  # `--dflash-tree-verify`
AUTO = "auto"  # `--dflash-adaptive-k auto`: the table `metrale calibrate` stored
DEFAULT_DRAFT_TP_SIZE = 1
DEFAULT_DFLASH_DRAFTER = "dflash"

# A plain decimal number; float() alone would also take "nan", "inf", "1_0" and padding.
_DRAFTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_LADDER_ALLOWED = "expected strictly ascending draft counts of at least 1, e.g. 1,3,7"
_TP_ALLOWED = "--draft-tp-size: expected `auto` or a rank count of at least 1, got"


class SpecMode(enum.Enum):
    """Which drafter runs; the modes exclude each other."""

    OFF = "off"
    MTP = "mtp"  # --speculative
    DFLASH = "dflash"  # --dflash


@dataclass(frozen=True)
class DraftStop:
    """`--draft-confidence-stop`: stop a chain on the top-1 probability (or running product)."""

    cumulative: bool
    tau: float

    def __post_init__(self) -> None:
        if not (isinstance(self.tau, (int, float)) and 0.0 < self.tau < 1.0):  # NaN fails too
            raise ConfigError(
                f"--draft-confidence-stop: got TAU {_q(self.tau)}; expected 0 < TAU < 1"
            )

    @classmethod
    def parse(cls, s: str) -> DraftStop:
        body, cumulative = (s[4:], True) if s.startswith("cum:") else (s, False)
        if not DECIMAL.fullmatch(body):
            raise ConfigError(
                f"--draft-confidence-stop: got {_q(s)}; expected TAU or cum:TAU, a number with "
                "0 < TAU < 1 (e.g. 0.6 or cum:0.3)"
            )
        return cls(cumulative=cumulative, tau=float(body))

    def __str__(self) -> str:
        return f"cum:{self.tau!r}" if self.cumulative else repr(self.tau)


def parse_ladder(s: str) -> tuple[int, ...]:
    """`--dflash-draft-ladder`: strictly ascending draft counts, each at least 1."""
    allowed = _LADDER_ALLOWED
    items = [t.strip() for t in s.split(",")]
    if not all(UINT.fullmatch(t) for t in items):
        raise ConfigError(f"--dflash-draft-ladder: got {_q(s)}; {allowed}")
    return _check_ladder(tuple(int(t) for t in items))


def _check_ladder(rungs: tuple[int, ...]) -> tuple[int, ...]:
    allowed = _LADDER_ALLOWED
    shown = _q(",".join(map(str, rungs)))
    if not rungs:
        raise ConfigError(f"--dflash-draft-ladder: got {shown} (no rungs); {allowed}")
    if rungs[0] < 1:
        raise ConfigError(f"--dflash-draft-ladder: got {shown}, rung {rungs[0]} < 1; {allowed}")
    for lo, hi in zip(rungs, rungs[1:]):
        if hi <= lo:
            raise ConfigError(
                f"--dflash-draft-ladder: got {shown}, rung {hi} after {lo}; {allowed}"
            )
    return rungs


@dataclass(frozen=True)
class DraftTpSize:
    """`--draft-tp-size`: the serve's world size (`ranks is None`, i.e. `auto`) or a count."""

    ranks: int | None

    def __post_init__(self) -> None:
        if self.ranks is not None and (type(self.ranks) is not int or self.ranks < 1):
            raise ConfigError(f"{_TP_ALLOWED} {_q(self.ranks)}")

    @classmethod
    def parse(cls, s: str | int) -> DraftTpSize:
        if s == "auto":
            return cls(None)
        if type(s) is int:
            return cls(s)
        if isinstance(s, str) and UINT.fullmatch(s):
            return cls(int(s))
        raise ConfigError(f"{_TP_ALLOWED} {_q(s)}")

    def ranks_on(self, world_size: int) -> int:
        return world_size if self.ranks is None else self.ranks

    def __str__(self) -> str:
        return "auto" if self.ranks is None else str(self.ranks)


def check_draft_tier(tier: str | None) -> None:
    """Refuse a `--draft-weight-quantization` value that is not a tier (None: not given)."""
    if tier not in (None, *DRAFT_TIERS):
        raise ConfigError(f"--draft-weight-quantization {_q(tier)}: expected one of "
                          f"{', '.join(DRAFT_TIERS)}")


def _int_flag(flag: str, value: object, minimum: int, most: int | None = None) -> int:
    if type(value) is not int or value < minimum or (most is not None and value > most):
        raise ConfigError(f"{flag}: got {_q(value)}; expected an integer of at least {minimum}" + (f" and at most {most}" if most else ""))  # noqa: E501
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """The speculative flags, one field per flag; `None` means the flag was not given.

    After construction the defaults of the active mode are filled in: `num_drafts` is 3 under
    MTP; under DFlash `draft_tp_size` is 1, `dflash_drafter` is "dflash", and
    `dflash_reprobe_interval` is 16 when `dflash_adaptive_k` is set. `dflash_gamma` stays
    `None` until `resolve_dflash` (the drafter's block size decides).
    """

    mode: SpecMode = SpecMode.OFF
    num_drafts: int | None = None
    draft_stop: DraftStop | None = None
    dflash_gamma: int | None = None
    dflash_draft_ladder: tuple[int, ...] | None = None
    dflash_adaptive_k: CostModel | str | None = None  # "auto": the engine's calibration
    dflash_reprobe_interval: int | None = None
    dflash_tree_budget: int | None = None  # None or 0: the chain
    dflash_tree_verify: str | None = None  # None: auto
    exact_verify: bool = False
    draft_tp_size: DraftTpSize | None = None
    dflash_drafter: str | None = None
    draft_weight_quantization: str | None = None  # None: the tier the engine was built with
    mtp_experts_nvfp4: bool | None = None  # None: as the engine was built

    def __post_init__(self) -> None:
        mtp, dflash = self.mode is SpecMode.MTP, self.mode is SpecMode.DFLASH
        if self.draft_stop is not None and not mtp:
            extra = "; not with --dflash" if dflash else ""
            raise ConfigError(
                f"--draft-confidence-stop {_q(str(self.draft_stop))} requires --speculative{extra}"
            )
        if self.num_drafts is not None and not mtp:
            raise ConfigError(f"--num-drafts {_q(self.num_drafts)} requires --speculative")
        if mtp:
            if self.num_drafts is None:
                object.__setattr__(self, "num_drafts", DEFAULT_NUM_DRAFTS)
            _int_flag("--num-drafts", self.num_drafts, 1, MAX_NUM_DRAFTS)
        if self.exact_verify and self.mode is SpecMode.OFF:
            raise ConfigError("--exact-verify requires --speculative or --dflash")
        dflash_only = {
            "--dflash-gamma": self.dflash_gamma,
            "--dflash-draft-ladder": self.dflash_draft_ladder,
            "--dflash-adaptive-k": self.dflash_adaptive_k,
            "--dflash-reprobe-interval": self.dflash_reprobe_interval,
            "--dflash-tree-budget": self.dflash_tree_budget,
            "--dflash-tree-verify": self.dflash_tree_verify,
            "--draft-tp-size": self.draft_tp_size,
            "--dflash-drafter": self.dflash_drafter,
            "--draft-weight-quantization": self.draft_weight_quantization,
        }
        check_draft_tier(self.draft_weight_quantization)
        if self.mtp_experts_nvfp4 not in (None, True, False):
            raise ConfigError(f"--mtp-experts-nvfp4: expected on or off, got {_q(self.mtp_experts_nvfp4)}")
        if self.mtp_experts_nvfp4 is not None and not mtp:  # only the MTP head's drafts read it
            given = "--mtp-experts-nvfp4" if self.mtp_experts_nvfp4 else "--no-mtp-experts-nvfp4"
            extra = "; not with --dflash" if dflash else ""
            raise ConfigError(f"{given} requires --speculative (it sets the MTP head's experts){extra}")
        if not dflash:
            for flag, value in dflash_only.items():
                if value is not None:
                    shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
                    raise ConfigError(f"{flag} {_q(shown)} requires --dflash")
            return
        self._check_dflash()

    def _check_dflash(self) -> None:
        if self.dflash_gamma is not None:
            _int_flag("--dflash-gamma", self.dflash_gamma, 2)
        if self.dflash_draft_ladder is not None:
            _check_ladder(self.dflash_draft_ladder)
        if self.dflash_reprobe_interval is not None and self.dflash_adaptive_k is None:
            raise ConfigError(
                f"--dflash-reprobe-interval {_q(self.dflash_reprobe_interval)} requires "
                "--dflash-adaptive-k"
            )
        if self.dflash_adaptive_k is not None:
            if self.dflash_reprobe_interval is None:
                object.__setattr__(self, "dflash_reprobe_interval", DEFAULT_REPROBE_INTERVAL)
            _int_flag("--dflash-reprobe-interval", self.dflash_reprobe_interval, 1)
        if self.dflash_tree_budget is not None:
            _int_flag("--dflash-tree-budget", self.dflash_tree_budget, 0, MAX_TREE_NODES)
            if self.dflash_tree_budget and self.dflash_draft_ladder is not None:
                raise ConfigError(f"--dflash-tree-budget {self.dflash_tree_budget} and "
                                  "--dflash-draft-ladder exclude each other: give one of them")
        if self.dflash_tree_verify is not None:
            if self.dflash_tree_verify not in TREE_VERIFY:
                raise ConfigError(f"--dflash-tree-verify: got {_q(self.dflash_tree_verify)}; expected "
                                  f"one of {', '.join(TREE_VERIFY)}")
            if not self.dflash_tree_budget:
                raise ConfigError(f"--dflash-tree-verify {_q(self.dflash_tree_verify)} requires "
                                  "--dflash-tree-budget")
        if self.draft_tp_size is None:
            object.__setattr__(self, "draft_tp_size", DraftTpSize(DEFAULT_DRAFT_TP_SIZE))
        if self.dflash_drafter is None:
            object.__setattr__(self, "dflash_drafter", DEFAULT_DFLASH_DRAFTER)
        name = self.dflash_drafter
        if not (isinstance(name, str) and _DRAFTER_NAME.fullmatch(name)):
            raise ConfigError(
                f"--dflash-drafter: got {_q(name)}; expected a component name of "
                "letters, digits, '_' and '-', e.g. dflash or dflash2"
            )
        if self.dflash_gamma is not None:
            # γ given explicitly: the draft counts can be checked now, before the drafter loads.
            _check_counts_fit(self, self.dflash_gamma - 1, f"--dflash-gamma {self.dflash_gamma}")

    @classmethod
    def from_flags(
        cls,
        speculative: bool = False,
        num_drafts: int | None = None,
        draft_confidence_stop: str | None = None,
        dflash: bool = False,
        dflash_gamma: int | None = None,
        dflash_draft_ladder: str | None = None,
        dflash_adaptive_k: str | None = None,
        dflash_reprobe_interval: int | None = None,
        dflash_tree_budget: int | None = None,
        dflash_tree_verify: str | None = None,
        exact_verify: bool = False,
        draft_tp_size: str | int | None = None,
        dflash_drafter: str | None = None,
        draft_weight_quantization: str | None = None,
        mtp_experts_nvfp4: bool | None = None,
    ) -> SpeculativeConfig:
        """Parse the raw CLI values; pass `None` for every flag the user did not give."""
        if speculative and dflash:
            raise ConfigError("--speculative and --dflash exclude each other; choose one")
        mode = SpecMode.MTP if speculative else SpecMode.DFLASH if dflash else SpecMode.OFF
        if draft_confidence_stop is not None and not speculative:
            # Checked before parsing so the mode conflict is the message, not the syntax.
            extra = "; not with --dflash" if dflash else ""
            raise ConfigError(
                f"--draft-confidence-stop {_q(draft_confidence_stop)} requires --speculative{extra}"
            )
        return cls(
            mode=mode,
            num_drafts=num_drafts,
            draft_stop=_maybe(DraftStop.parse, draft_confidence_stop),
            dflash_gamma=dflash_gamma,
            dflash_draft_ladder=_maybe(parse_ladder, dflash_draft_ladder),
            dflash_adaptive_k=_maybe(_parse_adaptive_k, dflash_adaptive_k),
            dflash_reprobe_interval=dflash_reprobe_interval,
            dflash_tree_budget=dflash_tree_budget,
            dflash_tree_verify=dflash_tree_verify,
            exact_verify=bool(exact_verify),
            draft_tp_size=_maybe(DraftTpSize.parse, draft_tp_size),
            dflash_drafter=dflash_drafter,
            draft_weight_quantization=draft_weight_quantization,
            mtp_experts_nvfp4=mtp_experts_nvfp4,
        )


def _parse_adaptive_k(text: str | CostModel) -> CostModel | str:
    if isinstance(text, CostModel):  # measured in this process (bench), with its acceptance
        return text
    return AUTO if text.strip() == AUTO else CostModel.parse(text)


def _maybe(parse, value):
    """Parse a flag that was given; keep `None` (not given) as is."""
    return None if value is None else parse(value)


def _check_counts_fit(cfg: SpeculativeConfig, max_drafts: int, bound: str) -> None:
    """Refuse ladder rungs and adaptive-k counts above γ − 1 (`max_drafts`); with draft trees,
    adaptive-k counts (tree budgets) above the tree budget."""
    if cfg.dflash_tree_budget:  # (no ladder: it excludes trees)
        budget = cfg.dflash_tree_budget
        if isinstance(cfg.dflash_adaptive_k, CostModel) and cfg.dflash_adaptive_k.max_count > budget:
            raise ConfigError(
                f"--dflash-adaptive-k: count {cfg.dflash_adaptive_k.max_count} is a tree of more "
                f"nodes than --dflash-tree-budget {budget}; expected counts of at most {budget}")
        return
    for rung in cfg.dflash_draft_ladder or ():
        if rung > max_drafts:
            raise ConfigError(
                f"--dflash-draft-ladder: rung {rung} drafts more than γ − 1 = {max_drafts} "
                f"({bound}); expected rungs of at most {max_drafts}"
            )
    if isinstance(cfg.dflash_adaptive_k, CostModel) and cfg.dflash_adaptive_k.max_count > max_drafts:
        raise ConfigError(
            f"--dflash-adaptive-k: count {cfg.dflash_adaptive_k.max_count} drafts more than "
            f"γ − 1 = {max_drafts} ({bound}); expected counts of at most {max_drafts}"
        )


@dataclass(frozen=True)
class ResolvedDFlash:
    """The DFlash settings once the drafter's block size is known."""

    block_size: int
    gamma: int  # anchor + drafts per step; 2 <= gamma <= block_size
    ladder: tuple[int, ...] | None
    adaptive_k: CostModel | None
    reprobe_interval: int | None
    drafter: str
    tree_budget: int = 0  # nodes of each step's draft tree; 0: the chain
    tree_verify: str = "auto"  # how each tree is verified (`tree_verify.TreeVerifyChoice`)

    @property
    def max_drafts(self) -> int:
        return self.gamma - 1


def resolve_dflash(cfg: SpeculativeConfig, block_size: int,
                   calibrated: CostModel | None = None, calibration_of: str = "") -> ResolvedDFlash:
    """γ = the drafter's block size unless `--dflash-gamma` lowers it; check counts against it.
    `--dflash-adaptive-k auto` takes `calibrated` (what `metrale calibrate` stored for this
    drafter and backend, described by `calibration_of`), cut to the counts γ allows (with draft
    trees, to the tree budget)."""
    if cfg.mode is not SpecMode.DFLASH:
        raise ConfigError(f"resolving DFlash settings needs --dflash; the mode is {cfg.mode.value}")
    if type(block_size) is not int or block_size < 2:
        raise ConfigError(
            f"DFlash drafter {_q(cfg.dflash_drafter)}: block_size {_q(block_size)}; expected an "
            "integer of at least 2"
        )
    gamma = block_size if cfg.dflash_gamma is None else cfg.dflash_gamma
    if gamma > block_size:
        raise ConfigError(
            f"--dflash-gamma: got {gamma}, above the drafter {_q(cfg.dflash_drafter)}'s block "
            f"size {block_size}; expected 2 <= γ <= {block_size}"
        )
    bound = (
        f"the drafter {_q(cfg.dflash_drafter)}'s block size {block_size}"
        if cfg.dflash_gamma is None
        else f"--dflash-gamma {gamma}"
    )
    _check_counts_fit(cfg, gamma - 1, bound)
    assert cfg.dflash_drafter is not None  # filled by __post_init__ under DFlash
    adaptive_k = cfg.dflash_adaptive_k
    if adaptive_k == AUTO:
        if calibrated is None:
            raise ConfigError(
                f"--dflash-adaptive-k auto: there is no calibration for {calibration_of or 'this drafter'}; "
                "run `metrale calibrate --engine-dir DIR` with the same backend, dtype and threads "
                "first, or give the table as drafts:ms pairs")
        # counts γ allows, or with trees the tree budgets up to --dflash-tree-budget (a table
        # measured with `metrale calibrate --tree-budget`)
        most = cfg.dflash_tree_budget or gamma - 1
        adaptive_k = calibrated.up_to(most)
        if adaptive_k.max_count < most:  # trees past the table: it cannot price them
            log.warning("--dflash-tree-budget %d with --dflash-adaptive-k auto: the calibration prices "
                        "trees of up to %d nodes, so no tree verifies more; run `metrale calibrate "
                        "--tree-budget %d` to price them", most, adaptive_k.max_count, most)
    return ResolvedDFlash(
        block_size=block_size,
        gamma=gamma,
        ladder=cfg.dflash_draft_ladder,
        adaptive_k=adaptive_k,
        reprobe_interval=cfg.dflash_reprobe_interval,
        drafter=cfg.dflash_drafter,
        tree_budget=cfg.dflash_tree_budget or 0,
        tree_verify=cfg.dflash_tree_verify or "auto",
    )


def resolve_draft_tp_size(cfg: SpeculativeConfig, world_size: int, num_kv_heads: int) -> int:
    """The drafter's rank count: 1 or the world size, with a KV head for every rank."""
    if cfg.mode is not SpecMode.DFLASH:
        raise ConfigError(f"--draft-tp-size needs --dflash; the mode is {cfg.mode.value}")
    assert cfg.draft_tp_size is not None  # filled by __post_init__ under DFlash
    ranks = cfg.draft_tp_size.ranks_on(world_size)
    if ranks not in (1, world_size):
        raise ConfigError(
            f"--draft-tp-size: got {ranks} on a serve of {world_size} ranks; the drafter's "
            f"collectives span every rank, so expected 1 or {world_size}"
        )
    if num_kv_heads < ranks:
        raise ConfigError(
            f"--draft-tp-size: got {ranks}, but the drafter's {num_kv_heads} KV heads do not "
            f"cover {ranks} ranks; expected 1 or at most {num_kv_heads} ranks"
        )
    return ranks
