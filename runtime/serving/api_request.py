"""The OpenAI request contract: what the server serves, and how a request body is checked.

Contract: `decode_body` turns raw bytes into JSON or an `APIError` (400) — invalid JSON, nesting
too deep for the parser, integers too long to convert, text that is not valid Unicode (a lone
surrogate escaped in the JSON) — and `parse_request` turns the JSON into a `GenerationRequest`
or an `APIError`: a malformed request (missing or mistyped field, n>1, a temperature that is
neither 0 nor at least `MIN_TEMPERATURE`, top_p outside (0, 1], prompt + max_tokens over the
context, an unknown model) gets a 4xx with OpenAI's error object `{"error": {"message", "type",
"param", "code"}}`. Both are plain functions without I/O, so the server runs them on a worker
thread: tokenizing an 8 MB prompt never blocks the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from metrale.runtime.errors import MetraleError
from metrale.runtime.spec.sampling import MIN_TEMPERATURE, SamplingParams
from metrale.runtime.artifact.tokenizer import Tokenizer


class TextGenerator(Protocol):
    """What the server serves: a single-stream generator plus its tokenizer."""

    model_id: str  # shown by /v1/models; requests naming another model get a 404
    tokenizer: Tokenizer
    max_context: int  # prompt + max_tokens must fit

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield generated token ids; stop at EOS or after params.max_tokens ids."""
        ...

    def metrics_text(self) -> str:
        """Prometheus exposition text for /metrics."""
        ...


class APIError(Exception):
    """A request the server refuses; becomes OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind,
                          "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- request parsing

_NUMBER = (int, float)
MAX_STOPS = 16
# OpenAI fields this server does not implement: refused unless they hold their no-op value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
    "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "tools": ([],), "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},),
}


def _field(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], what: str,
           required: bool = False) -> Any:
    """body[name] checked against `kinds` (bool is never a number); None when absent or null."""
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"`{name}` is required", name, "missing_required_parameter")
        return None
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise APIError(400, f"`{name}` must be {what}, got {value!r}", name, "invalid_type")
    return value


def _finite(value: int | float | None, name: str) -> float | None:
    """A JSON number as a finite float; integers too long for a float are refused."""
    if value is None:
        return None
    try:
        f = float(value)
    except OverflowError:
        f = float("inf")
    if f != f or f in (float("inf"), float("-inf")):
        raise APIError(400, f"`{name}` must be a finite number", name, "invalid_value")
    return f


def _strings(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise APIError(400, f"`{name}` must be a string or a list of strings, got {value!r}", name,
                   "invalid_type")


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: what the worker needs, nothing from the HTTP layer."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _message_text(m: Any, i: int) -> Any:
    """OpenAI lets content be a list of parts; the text parts join into the template's string."""
    if isinstance(m, dict) and isinstance(m.get("content"), list):
        parts = m["content"]
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in parts):
            raise APIError(400, f"messages[{i}].content: only text parts are supported",
                           "messages", "invalid_type")
        return {**m, "content": "".join(p["text"] for p in parts)}
    return m


def parse_request(gen: TextGenerator, body: Any, chat: bool) -> GenerationRequest:
    """Check a /v1/completions (chat=False) or /v1/chat/completions body; raise APIError."""
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    model = _field(body, "model", str, "a string")
    if model is not None and model != gen.model_id:
        raise APIError(404, f"model {model!r} does not exist; this server serves "
                       f"{gen.model_id!r}", "model", "model_not_found")
    for name, neutral in _NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise APIError(400, f"`{name}` is not supported by this server, got {body[name]!r}",
                           name, "unsupported_parameter")
    n = _field(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise APIError(400, f"`n` must be 1 (one choice per request), got {n}", "n",
                       "unsupported_parameter")
    tok = gen.tokenizer
    if chat:
        prompt_param = "messages"
        messages = _field(body, "messages", list, "a list of messages", required=True)
        try:
            text = tok.apply_chat_template([_message_text(m, i) for i, m in enumerate(messages)])
        except MetraleError as e:
            raise APIError(400, str(e), "messages", "invalid_value") from e
        prompt_ids = tok.encode(text)
    else:
        prompt_param = "prompt"
        prompt = _field(body, "prompt", (str, list), "a string, a list of one string, or a list "
                        "of token ids", required=True)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < tok.vocab_size for t in prompt):
                raise APIError(400, f"`prompt` token ids must lie in [0, {tok.vocab_size})",
                               "prompt", "invalid_value")
            prompt_ids = list(prompt)  # already token ids
        else:
            prompts = _strings(prompt, "prompt")
            if len(prompts) != 1:
                raise APIError(400, f"`prompt` must hold exactly one string (batches are not "
                               f"supported), got {len(prompts)}", "prompt", "unsupported_parameter")
            prompt_ids = tok.encode(prompts[0], add_special=True)
    if not prompt_ids:
        raise APIError(400, f"`{prompt_param}` encodes to no tokens", prompt_param, "invalid_value")

    max_tokens = _field(body, "max_tokens", int, "an integer")
    if chat and max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", int, "an integer")
    temperature = _field(body, "temperature", _NUMBER, "a number")
    top_p = _field(body, "top_p", _NUMBER, "a number")
    seed = _field(body, "seed", int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"`max_tokens` must be at least 1, got {max_tokens}", "max_tokens",
                       "invalid_value")
    temperature, top_p = _finite(temperature, "temperature"), _finite(top_p, "top_p")
    if temperature is not None and not (temperature == 0 or temperature >= MIN_TEMPERATURE):
        raise APIError(400, f"`temperature` must be 0 (greedy) or at least {MIN_TEMPERATURE} "
                       f"(and so >= 0), got {temperature}", "temperature", "invalid_value")
    if top_p is not None and not 0 < top_p <= 1:
        raise APIError(400, f"`top_p` must lie in (0, 1], got {top_p}", "top_p", "invalid_value")
    room = gen.max_context - len(prompt_ids)
    if max_tokens is None:
        max_tokens = min(SamplingParams().max_tokens, room)  # the sampler's default, if it fits
    if room < 1 or max_tokens > room:
        raise APIError(400, f"the context holds {gen.max_context} tokens; the {prompt_param} "
                       f"takes {len(prompt_ids)}, leaving {max(room, 0)} for completion, but "
                       f"max_tokens is {max_tokens}", prompt_param, "context_length_exceeded")
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "seed": seed}
    if temperature is not None:
        sampling["temperature"] = float(temperature)
    if top_p is not None:
        sampling["top_p"] = float(top_p)
    try:
        params = SamplingParams(**sampling)
    except MetraleError as e:  # its message starts with the field's name
        field = str(e).split(":", 1)[0]
        raise APIError(400, str(e), field if field in sampling else None, "invalid_value") from e

    stop = body.get("stop")
    stops = tuple(s for s in _strings(stop, "stop") if s) if stop is not None else ()
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"`stop` holds {len(stops)} strings; at most {MAX_STOPS} are allowed",
                       "stop", "invalid_value")
    stream = _field(body, "stream", bool, "a boolean")
    options = _field(body, "stream_options", dict, "an object") or {}
    include_usage = options.get("include_usage") is True
    return GenerationRequest(prompt_ids, params, stops, bool(stream), include_usage)



def decode_body(raw: bytes) -> Any:
    """The request's JSON; every way bytes can fail to be a JSON document is a 400."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "request body nests JSON too deeply", code="invalid_json") from None
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not UTF-8 ({e.reason} at byte {e.start})",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, and int() refusing thousands of digits
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body holds text that is not valid Unicode (a lone "
                       "surrogate such as \\ud800)", code="invalid_text") from None
    except (RecursionError, ValueError):
        raise APIError(400, "request body nests JSON too deeply", code="invalid_json") from None
    return body
