"""What the server serves, and how a request body becomes a `GenerationRequest`.

Contract: `decode_body` turns raw bytes into JSON or an `APIError` (400) — invalid JSON, nesting
too deep for the parser, integers too long to convert, a key given twice in an object, text that is not valid Unicode (a lone
surrogate escaped in the JSON) — and `parse_request` checks the JSON with the endpoint's request
model (`api_models`, the one definition of every field's rule) and encodes its prompt against
the served model, or raises an `APIError` with OpenAI's error object. Both are plain functions
without I/O, so the server may run them on a worker thread: tokenizing an 8 MB prompt never
blocks the event loop.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterator, Protocol

from pydantic import ValidationError

from metrale.runtime.artifact.tokenizer import Tokenizer
from metrale.runtime.serving.api_models import (APIError, ChatRequest, CompletionRequest,
                                                GenerationRequest, api_error)
from metrale.runtime.serving.scheduler import Capabilities
from metrale.runtime.serving.stats import GeneratorStats
from metrale.runtime.errors import ConfigError
from metrale.runtime.spec.grammar import check_schema
from metrale.runtime.spec.metrics import SpecMetrics
from metrale.runtime.spec.sampling import SamplingParams


class TextGenerator(Protocol):
    """What the server serves: a single-stream generator plus its tokenizer."""

    model_id: str  # shown by /v1/models; requests naming another model get a 404
    tokenizer: Tokenizer
    max_context: int  # prompt + max_tokens must fit
    # what its scheduler may do with it (`scheduler.STREAM_ONLY`: each request's `stream` alone)
    capabilities: Capabilities

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               counted: SpecMetrics | None = None) -> Iterator[int]:
        """Yield generated token ids; stop at EOS or after params.max_tokens ids. A generator
        that speculates merges the request's counters into `counted` as it ends (its drafts
        go into the answer's usage)."""
        ...

    def stats(self) -> GeneratorStats:
        """Its counters for /metrics (speculative decoding's, the prefix cache's)."""
        ...


def parse_request(gen: TextGenerator, body: Any, chat: bool) -> GenerationRequest:
    """Check a /v1/completions (chat=False) or /v1/chat/completions body; raise APIError."""
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}")
    model = ChatRequest if chat else CompletionRequest
    try:
        request = model.model_validate(body, context=gen)
    except ValidationError as e:
        raise api_error(e, model) from None
    return request.to_generation(gen)


class _Repeats(dict):
    """A JSON object that held key `repeated` twice (which one counts, parsers disagree)."""

    repeated = ""


def _once(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        out = _Repeats(pairs)
        out.repeated = next(k for k, _ in pairs if k in seen or seen.add(k))
    return out


def _repeated(body: Any) -> tuple[str, str | None] | None:
    """The first key given twice in one object of `body`, and the request field that holds it;
    None where every key is given once. Walks the body only where a repeat was seen."""
    stack, found = [(body, None)], None
    while stack and found is None:
        node, field = stack.pop()
        if isinstance(node, _Repeats):
            found = (node.repeated, field or node.repeated)
        # pushed in reverse, so the first repeat in the document's order is found first
        if isinstance(node, dict):
            stack.extend((v, field or k) for k, v in reversed(node.items()) if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, field) for v in reversed(node) if isinstance(v, (dict, list)))
    return found


def decode_body(raw: bytes) -> Any:
    """The request's JSON; every way bytes can fail to be a JSON document is a 400."""
    repeats: list[bool] = []

    def once(pairs: list[tuple[str, Any]]) -> dict:
        out = _once(pairs)
        if isinstance(out, _Repeats):
            repeats.append(True)
        return out

    try:
        body = json.loads(raw, object_pairs_hook=once)
    except RecursionError:
        raise APIError(400, "request body nests JSON too deeply", code="invalid_json") from None
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not UTF-8 ({e.reason} at byte {e.start})",
                       code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except ValueError:  # int() refusing a number of thousands of digits
        raise APIError(400, f"request body holds a number of more than {sys.get_int_max_str_digits()} "
                       "digits", code="invalid_json") from None
    found = _repeated(body) if repeats else None
    if found is not None:
        raise APIError(400, f"request body repeats the key {found[0]!r} in an object; give each "
                       "key once", found[1], "invalid_json")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body holds text that is not valid Unicode (a lone "
                       "surrogate such as \\ud800)", code="invalid_text") from None
    except (RecursionError, ValueError):
        raise APIError(400, "request body nests JSON too deeply", code="invalid_json") from None
    return body


def check_request_schema(schema: str) -> None:
    """A request's schema compiled before the request is admitted (`grammar.check_schema`, which
    compiles it over the single bytes, not the vocabulary; the server calls it on a worker
    thread, as xgrammar leaves the interpreter free meanwhile), so a schema the grammar cannot
    enforce is a 400 naming `response_format`, not an error in the middle of generation."""
    try:
        check_schema(schema)
    except ConfigError as e:
        raise APIError(400, f"`response_format` holds a schema that cannot be enforced: {e}",
                       "response_format", "invalid_value") from None
