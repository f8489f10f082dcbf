"""Sampling parameters and the one token-sampling path of metrale.

Contract: `SamplingParams` holds one request's settings, each checked by its field's rule,
defined once here (`Temperature`, `TopP`, `Seed`, `MaxTokens`, and `ALLOWED` in words): the HTTP
API's request models and the CLI's flags check with the same rules. `probs_from_logits` turns
logits into the distribution a token is drawn from (temperature, then top-p nucleus); `sample`
draws from it. Plain decoding and speculative
verification both call these, so a sampled token means the same thing on either path.

Invariants: temperature 0 is greedy, and greedy is exactly `argmax` (the first maximal index on
ties), expressed as a one-hot distribution where a distribution is needed. Probabilities are
float32 whatever the logits' dtype, so bf16 logits do not round the nucleus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import AfterValidator, Field, Strict, TypeAdapter, ValidationError

from metrale.runtime.errors import ConfigError

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_TOKENS = 256
NO_CAP = 1 << 30  # an iteration's cap on a request's drafts that leaves them uncapped
# Below this, logits / temperature overflows float32 (denormal temperatures): refused, not guessed.
MIN_TEMPERATURE = 1e-3


def _greedy_or_hot(t: float) -> float:
    if t == 0 or t >= MIN_TEMPERATURE:
        return t
    raise ValueError(f"temperature {t!r} is neither 0 nor at least {MIN_TEMPERATURE}")


# The one definition of each sampling field's rule: its pydantic type (strict: a bool or a
# numeric string is not a number) and what it allows, in words. `SamplingParams`, the HTTP
# API's request models (`serving.api_request`) and the CLI's flags all check with these.
Temperature = Annotated[float, Strict(), Field(allow_inf_nan=False), AfterValidator(_greedy_or_hot)]
TopP = Annotated[float, Strict(), Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Seed = Annotated[int, Strict()]
MaxTokens = Annotated[int, Strict(), Field(ge=1)]
MaxDrafts = Annotated[int, Strict(), Field(ge=0)]
ALLOWED = {
    "temperature": f"0 (greedy) or a finite number of at least {MIN_TEMPERATURE} (and so >= 0)",
    "top_p": "a number in (0, 1]",
    "seed": "an integer or null",
    "max_tokens": "an integer of at least 1",
    "speculate": "a boolean",
    "max_drafts": "an integer of at least 0 (0: no drafts) or null (the server's count)",
    "json_schema": "a JSON schema as text, or null",
}
_CHECKS = {name: TypeAdapter(t) for name, t in (
    ("temperature", Temperature), ("top_p", TopP), ("seed", Seed | None), ("max_tokens", MaxTokens),
    ("speculate", Annotated[bool, Strict()]), ("max_drafts", MaxDrafts | None),
    ("json_schema", Annotated[str, Strict()] | None))}


class SamplingError(ConfigError):
    """A sampling field's value refused: `field`, `value` and what is `allowed` (`ALLOWED`), so
    each caller words it its own way (the CLI names the flag, the API the parameter)."""

    def __init__(self, field: str, value: Any) -> None:
        self.field, self.value, self.allowed = field, value, ALLOWED[field]
        super().__init__(f"{field}: got {shown(value)}; expected {self.allowed}")


def shown(value: Any, most: int = 60) -> str:
    """`repr(value)`, cut to `most` characters (a JSON number may have thousands of digits)."""
    try:
        text = repr(value)
    except ValueError:  # an int longer than Python converts to text
        return "a number too long to show"
    return text if len(text) <= most else text[: most - 3] + "..."


def check(field: str, value: Any) -> Any:
    """`value` as sampling field `field` holds it; `SamplingError` when its rule refuses it."""
    try:
        return _CHECKS[field].validate_python(value)
    except ValidationError:
        raise SamplingError(field, value) from None


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: temperature >= 0 (0 = greedy), 0 < top_p <= 1, max_tokens >= 1
    (each field's rule: `ALLOWED`).

    `seed`, when given, makes the request's sampled tokens reproducible (see `generator_for`).

    The request's control of speculation (the API's `speculative` object): `speculate` False
    decodes it plain, as a server without speculative flags does; `max_drafts` caps the drafts
    each of its steps verifies (0: none), as the flags that cap them do (`--num-drafts` for MTP
    chains; for DFlash the block is the server's γ and its first drafts are verified, as with a
    one-rung `--dflash-draft-ladder`). Neither changes what greedy decoding emits, only its speed.

    `json_schema` (the API's `response_format`) constrains every emitted token to the schema's
    documents (`spec.grammar`), with or without speculation.
    """

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    speculate: bool = True
    max_drafts: int | None = None
    json_schema: str | None = None

    def __post_init__(self) -> None:
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p),
                            ("seed", self.seed), ("max_tokens", self.max_tokens),
                            ("speculate", self.speculate), ("max_drafts", self.max_drafts),
                            ("json_schema", self.json_schema)):
            object.__setattr__(self, name, check(name, value))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def drafts(self) -> bool:
        """It lets its steps draft (speculation on, a cap above 0)."""
        return self.speculate and self.max_drafts != 0

    @property
    def lane_cap(self) -> int:
        """The most drafts an iteration may accept for it: 0 with speculation off, its
        `max_drafts`, else NO_CAP (what `iteration.IterationState.cap` holds)."""
        if not self.speculate:
            return 0
        return NO_CAP if self.max_drafts is None else min(self.max_drafts, NO_CAP)

    def draft_cap(self, room: int) -> int:
        """The most drafts a step may verify with `room` tokens left in its budget."""
        cap = room - 1
        return cap if self.max_drafts is None else min(cap, self.max_drafts)


def generator_for(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """A generator seeded with `params.seed`, or None (torch's global stream) when unseeded.

    Any integer is a seed (OpenAI's API allows negative ones); it is taken modulo 2**64, the
    range torch's generators hold.
    """
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed % 2**64)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] (any float dtype) -> probs [..., V] float32, each row summing to 1.

    Greedy: one-hot at argmax. Otherwise softmax(logits / temperature), then the nucleus: the
    smallest set of most likely tokens whose mass reaches top_p is kept and renormalized.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / params.temperature, dim=-1)  # [..., V]
    if params.top_p >= 1.0:
        return probs
    # Stable: among equally likely tokens the lower id ranks first, as argmax's tie rule does.
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., V] each
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # [..., V]: mass of the tokens ranked above
    # A token is kept while the tokens above it have not yet reached top_p; the top token always is.
    keep_sorted = mass_before < params.top_p
    keep_sorted[..., 0] = True  # also when top_p rounds to 0 in float32
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # [..., V] bool
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def probs_on_device(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`probs_from_logits` of a sampled request with its temperature and top_p as device
    tensors ([1] float32 each), so one captured graph serves every request: logits [N, V] ->
    probs [N, V] float32, the same bits."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [N, V]
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    nucleus = probs * keep
    return torch.where(top_p >= 1.0, probs, nucleus / nucleus.sum(dim=-1, keepdim=True))


def sample_from_probs(
    probs: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """probs [..., V] (non-negative, any positive sum) -> token ids [...] int64, one draw per
    row: each row's inverse CDF at a uniform draw, in float64 (one cumsum and one search for
    the whole batch, where torch.multinomial's per-row work dominates small rows).

    u = r·total with r < 1 a 53-bit uniform is strictly below the row's total mass, so the
    first index whose cumulative mass exceeds u always carries mass: a token of zero
    probability is never drawn."""
    flat = probs.reshape(-1, probs.shape[-1])  # [N, V]
    cdf = flat.double().cumsum(dim=-1)  # [N, V], non-decreasing
    u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device,
                   dtype=torch.float64).mul_(cdf[:, -1:])  # [N, 1], in [0, total)
    ids = torch.searchsorted(cdf, u, right=True)  # [N, 1]
    return ids.reshape(probs.shape[:-1])


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [..., V] -> token ids [...] int64: argmax when greedy, else a nucleus draw."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample_from_probs(probs_from_logits(logits, params), generator)
