"""The OpenAI API's objects as this server speaks them: pydantic models, the one definition of
every request field's rule and of every answer's shape.

Contract:
- `CompletionRequest` and `ChatRequest` check a request body's fields (validated with the served
  `TextGenerator` as context, which names the one model served); `to_generation(gen)` then
  encodes the prompt and checks it against the context window, giving a `GenerationRequest`.
  The sampling fields use the sampling parameters' own rules (`spec.sampling.Temperature`, ...),
  so the API, `SamplingParams` and the CLI refuse exactly the same values.
- A refusal is an `APIError`: OpenAI's error object (`ErrorBody`) with a 4xx status that names
  the field (`param`), the value given and what is allowed. `api_error` words pydantic's errors
  so; the checks pydantic's types cannot express raise an `APIError` themselves.
- The answers are `api_answers`'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import (BaseModel, ConfigDict, Field, Strict, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from metrale.runtime.errors import ConfigError, MetraleError
from metrale.runtime.spec.grammar import JSON_OBJECT
from metrale.runtime.spec.schema_check import check_shape
from metrale.runtime.spec.sampling import (ALLOWED, DEFAULT_MAX_TOKENS, NO_CAP, MaxDrafts, MaxTokens, SamplingError,
                                           SamplingParams, Seed, Temperature, TopP, shown)

MAX_STOPS = 16
# OpenAI fields this server does not implement: refused unless they hold their no-op value.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
    "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False), "prediction": (), "modalities": (["text"],), "audio": (),
    "reasoning_effort": (), "web_search_options": (),
    # vLLM's and SGLang's sampling extensions, which clients of those servers send
    "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "min_tokens": (0,),
    "ignore_eos": (False,), "stop_token_ids": ([],), "use_beam_search": (False,), "bad_words": ([],),
    # their structured-output fields: only null (this server's is `response_format`)
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "regex": (), "ebnf": (), "json_schema": (),
}
STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
              "regex", "ebnf", "json_schema")


def _neutral_value(v: Any, neutral: tuple[Any, ...]) -> bool:
    """`v` is one of `neutral`: a boolean only as a boolean, a number as an int or a float
    (`true` is not `1`, `0.0` is `0`)."""
    return any(v == n and (isinstance(v, bool) == isinstance(n, bool)) for n in neutral)


ROLES = ("system", "developer", "user", "assistant")  # a chat message's (no tool calls here)
STREAM_OPTIONS = ("include_usage", "include_obfuscation")
RESPONSE_FORMAT = ('an object: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                   '"json_schema": {"name": ..., "schema": {...}}}')


# ---------------------------------------------------------------- errors

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class APIError(Exception):
    """A request the server refuses; becomes OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.kind, param=self.param,
                                           code=self.code))


def _path(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc))


def api_error(e: ValidationError, model: type[BaseModel]) -> APIError:
    """The first of pydantic's errors as a 400 naming the field, the value and what is allowed
    (the field's `description`; a list item's: its model's `ALLOWED`)."""
    err = e.errors(include_url=False)[0]
    loc, kind = tuple(err["loc"]), err["type"]
    param = str(loc[0]) if loc else None
    where = f"`{_path(loc)}`"
    if kind == "missing":
        message = (f"{where} is required" if len(loc) == 1
                   else f"`{_path(loc[:-1])}` needs `{loc[-1]}`")
        return APIError(400, message, param, "missing_required_parameter")
    if kind == "extra_forbidden":  # a key an object of this API does not take
        parent = _allowed(model, loc[:-1])
        return APIError(400, f"{where} is not a field of `{_path(loc[:-1])}`, which must be {parent}",
                        param, "invalid_value")
    if kind in _CUSTOM:  # worded by the check that raised it
        return APIError(400, f"{where} {err['msg']}", param, kind)
    allowed = _allowed(model, loc)
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return APIError(400, f"{where} must be {allowed}, got {shown(err['input'])}", param, code)


_CUSTOM = ("invalid_type", "invalid_value", "unsupported_parameter")


def _allowed(model: type[BaseModel], loc: tuple) -> str:
    """What the field at `loc` allows: its description, walking into objects and lists of
    models (`_ITEMS`)."""
    allowed, cls = "valid", model
    for part in loc:
        if cls is None:
            break
        if isinstance(part, int):
            allowed, cls = cls.ALLOWED, cls
            continue
        field = cls.model_fields.get(str(part))
        if field is None:
            break
        allowed = field.description or allowed
        cls = _ITEMS.get((cls, str(part)))
    return allowed


# ---------------------------------------------------------------- requests

def _invalid(kind: str, message: str) -> PydanticCustomError:
    """A refusal worded here (`api_error` puts the field's path in front of `message`)."""
    return PydanticCustomError(kind, message)


class Message(BaseModel):
    """A chat message; other keys (`name`, ...) reach the chat template as they came."""

    model_config = ConfigDict(extra="allow")
    ALLOWED: ClassVar[str] = "an object with a string `role` and `content`"

    role: str = Field(description="a string")

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise _invalid("invalid_value", f"must be one of {', '.join(ROLES)}, got {shown(v)}"
                           + ("; tool calls are not supported" if v in ("tool", "function") else ""))
        return v
    content: Any = Field(description="a string or a list of text parts")

    @field_validator("content")
    @classmethod
    def _text(cls, v: Any) -> str:
        """OpenAI lets content be a list of parts; the text parts join into the template's string."""
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
        if isinstance(v, list):
            raise _invalid("invalid_type", "holds a part that is not text; only text parts "
                           '({"type": "text", "text": ...}) are supported')
        raise _invalid("invalid_type", f"must be a string or a list of text parts, got {shown(v)}")


class SpeculativeOptions(BaseModel):
    """The request's control of speculative decoding (llama.cpp's server takes the same per
    request): `enabled` false decodes it plain; `max_drafts` caps the drafts each step verifies
    (`SamplingParams.speculate`, `max_drafts`). Other keys are refused."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(None, strict=True, description=ALLOWED["speculate"])
    max_drafts: MaxDrafts | None = Field(None, description=ALLOWED["max_drafts"])


SPECULATIVE = ("an object with `enabled` (a boolean) and `max_drafts` (an integer of at least 0), "
               "both optional")


class _GenerationBody(BaseModel):
    """The fields both generation endpoints share. Unknown fields are ignored, as OpenAI's
    clients send some this server has no use for (`user`, ...)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="a string")
    n: Annotated[int, Strict()] | None = Field(None, description="1")
    max_tokens: MaxTokens | None = Field(None, description=ALLOWED["max_tokens"])
    # OpenAI's newer name for the same cap; both given, they must agree
    max_completion_tokens: MaxTokens | None = Field(None, description=ALLOWED["max_tokens"])
    temperature: Temperature | None = Field(None, description=ALLOWED["temperature"])
    top_p: TopP | None = Field(None, description=ALLOWED["top_p"])
    seed: Seed | None = Field(None, description=ALLOWED["seed"])
    stop: Any = Field(None, validate_default=True,
                      description=f"a string or a list of at most {MAX_STOPS} strings")
    stream: bool | None = Field(None, strict=True, description="a boolean")
    stream_options: dict | None = Field(None, description="an object")
    best_of: Any = None
    echo: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    prediction: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    stop_token_ids: Any = None
    use_beam_search: Any = None
    bad_words: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    response_format: Any = Field(None, description=RESPONSE_FORMAT)
    speculative: SpeculativeOptions | None = Field(None, description=SPECULATIVE)

    PROMPT: ClassVar[str] = "prompt"  # the field whose tokens count against the context

    @field_validator("model")
    @classmethod
    def _served(cls, v: str | None, info: ValidationInfo) -> str | None:
        served = info.context.model_id if info.context is not None else v
        if v is not None and v != served:
            raise APIError(404, f"model {v!r} does not exist; this server serves {served!r}",
                           "model", "model_not_found")
        return v

    @field_validator(*NEUTRAL)
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not _neutral_value(v, NEUTRAL[info.field_name]):
            hint = "; structured output is asked with `response_format`" if info.field_name in STRUCTURED else ""
            raise _invalid("unsupported_parameter", f"is not supported by this server{hint}, got {shown(v)}")
        return v

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: Any) -> str | None:
        """-> the JSON schema its answer must satisfy, as text (None: free text)."""
        if v is None:
            return None
        kind = v.get("type") if isinstance(v, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return JSON_OBJECT
        if kind != "json_schema":
            raise _invalid("invalid_value", f"must be {RESPONSE_FORMAT}, got {shown(v)}")
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _invalid("invalid_value", "must hold `json_schema.schema`, a JSON schema object, "
                           f"got {shown(spec)}")
        try:
            check_shape(spec["schema"])
        except ConfigError as e:
            raise _invalid("invalid_value", f"holds a schema that cannot be enforced: {e}") from None
        return json.dumps(spec["schema"])

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: dict | None, info: ValidationInfo) -> dict | None:
        """OpenAI's rule: only with `stream` true; `include_usage` (and `include_obfuscation`,
        which changes nothing here) booleans."""
        if v is None:
            return None
        if info.data.get("stream") is not True:
            raise _invalid("invalid_value", "is only allowed when `stream` is true")
        for key, value in v.items():
            if key not in STREAM_OPTIONS:
                raise _invalid("invalid_value", f"has no key {key!r}; its keys are {', '.join(STREAM_OPTIONS)}")
            if not isinstance(value, bool):
                raise _invalid("invalid_type", f"`{key}` must be a boolean, got {shown(value)}")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise _invalid("unsupported_parameter", f"must be 1 (one choice per request), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise _invalid("invalid_type", f"must be a string or a list of strings, got {shown(v)}")
        stops = tuple(s for s in v if s)
        if len(stops) > MAX_STOPS:
            raise _invalid("invalid_value", f"holds {len(stops)} strings; at most {MAX_STOPS} are allowed")
        return stops

    def prompt_ids(self, gen) -> list[int]:
        raise NotImplementedError

    def completion_budget(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def budget_field(self) -> str:
        """The field `completion_budget` comes from."""
        return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"

    @model_validator(mode="after")
    def _one_budget(self) -> "_GenerationBody":
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise APIError(400, f"`max_tokens` {both[0]} and `max_completion_tokens` {both[1]} "
                           "disagree; give one of them", "max_completion_tokens", "invalid_value")
        return self

    def to_generation(self, gen) -> GenerationRequest:
        """The request against the served model: its prompt encoded (no tokens: refused), its
        completion budget checked against the context window (unset: the sampler's default, cut
        to what fits), its sampling parameters."""
        ids = self.prompt_ids(gen)
        where = self.PROMPT
        if not ids:
            raise APIError(400, f"`{where}` encodes to no tokens", where, "invalid_value")
        room = gen.max_context - len(ids)
        max_tokens = self.completion_budget()
        held = f"the context holds {gen.max_context} tokens; the {where} takes {len(ids)}"
        if room < 1:
            raise APIError(400, f"{held}, leaving none for completion", where, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        if max_tokens > room:
            raise APIError(400, f"{held}, leaving {room} for completion, but {self.budget_field()} "
                           f"is {max_tokens}", self.budget_field(), "context_length_exceeded")
        # any integer is a seed, taken modulo 2**64 (`sampling.generator_for`), and a draft cap
        # past NO_CAP caps nothing: both as the same values within 64 bits, as the engine
        # process's messages carry integers
        seed = None if self.seed is None else self.seed % 2**64
        sampling: dict[str, Any] = {"max_tokens": max_tokens, "seed": seed}
        if self.response_format is not None:
            sampling["json_schema"] = self.response_format
        if self.speculative is not None:
            if self.speculative.enabled is not None:
                sampling["speculate"] = self.speculative.enabled
            cap = self.speculative.max_drafts
            sampling["max_drafts"] = None if cap is None else min(cap, NO_CAP)
        if self.temperature is not None:
            sampling["temperature"] = self.temperature
        if self.top_p is not None:
            sampling["top_p"] = self.top_p
        try:
            params = SamplingParams(**sampling)
        except SamplingError as e:  # the fields passed the same rules: only a bug gets here
            raise APIError(400, str(e), e.field, "invalid_value") from e
        include_usage = (self.stream_options or {}).get("include_usage") is True
        return GenerationRequest(ids, params, self.stop, bool(self.stream), include_usage)


class CompletionRequest(_GenerationBody):
    """A `/v1/completions` body: `prompt` is a string, a list of one string, or token ids."""

    prompt: Any = Field(description="a string, a list of one string, or a list of token ids")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and all(type(t) is int for t in v):
            return v  # already token ids
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            if len(v) != 1:
                raise _invalid("unsupported_parameter", f"must hold exactly one string (batches "
                               f"are not supported), got {len(v)}")
            return v[0]
        if not isinstance(v, str):
            raise _invalid("invalid_type", "must be a string, a list of one string, or a list of "
                           f"token ids, got {shown(v)}")
        return v

    def prompt_ids(self, gen) -> list[int]:
        tok = gen.tokenizer
        if isinstance(self.prompt, str):
            return tok.encode(self.prompt, add_special=True)
        if not all(0 <= t < tok.vocab_size for t in self.prompt):
            raise APIError(400, f"`prompt` token ids must lie in [0, {tok.vocab_size})", "prompt",
                           "invalid_value")
        return list(self.prompt)


class ChatRequest(_GenerationBody):
    """A `/v1/chat/completions` body: `messages` rendered by the tokenizer's chat template."""

    messages: list[Message] = Field(description="a list of messages, non-empty")

    PROMPT: ClassVar[str] = "messages"

    @field_validator("messages")
    @classmethod
    def _some(cls, v: list[Message]) -> list[Message]:
        if not v:
            raise _invalid("invalid_value", "must be a non-empty list of messages, got []")
        return v

    def prompt_ids(self, gen) -> list[int]:
        tok = gen.tokenizer
        try:
            # OpenAI's `developer` messages are what chat templates know as `system`
            text = tok.apply_chat_template([m.model_dump() | ({"role": "system"} if m.role == "developer" else {})
                                            for m in self.messages])
        except MetraleError as e:
            raise APIError(400, str(e), "messages", "invalid_value") from e
        return tok.encode(text)


_ITEMS = {(ChatRequest, "messages"): Message, (ChatRequest, "speculative"): SpeculativeOptions,
          (CompletionRequest, "speculative"): SpeculativeOptions}


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: what the scheduler needs, nothing from the HTTP layer."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
