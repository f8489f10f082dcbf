"""The messages between the HTTP process and the engine process (`engine_process`), typed.

Each is a msgspec Struct, tagged with its class name and encoded as a MessagePack array
(`pipe` frames them). The HTTP side sends `ToEngine`: `Submit` a checked request, `Cancel` one,
`Stop` the engine. The engine sends `FromEngine`: once `Ready` (what it loaded) or `LoadFailed`
(why not), then `Outputs`: the events of one scheduler phase, every request's together, with a
snapshot of its counters (`stats.EngineStats`) where they changed (`engine_process._Outbox`).
"""

from __future__ import annotations

import msgspec

from metrale.runtime.serving.api_models import GenerationRequest
from metrale.runtime.serving.stats import EngineStats, Finished


class Submit(msgspec.Struct, tag=True, array_like=True):
    rid: str
    request: GenerationRequest


class Cancel(msgspec.Struct, tag=True, array_like=True):
    rid: str


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


ToEngine = Submit | Cancel | Stop


class EngineInfo(msgspec.Struct, frozen=True):
    """What the engine says once loaded: the model, its context and where it was loaded from,
    what runs it (and why, where auto chose otherwise), the weights requantized at load, whether
    prompts' prefixes are cached, the threads of its steps (`lanes`: those of its batched target,
    None where they are not split) and torch's, and whether it takes requests with a schema."""

    model_id: str
    max_context: int
    engine_dir: str
    backend: str
    backend_note: str = ""
    requantized: dict[str, str] = {}
    prefix_cache: bool = False
    lanes: int | None = None
    threads: int = 1


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo
    stats: EngineStats


class LoadFailed(msgspec.Struct, tag=True, array_like=True):
    """`user_error`: a `MetraleError` (told as the CLI tells it: `words`), else a bug
    (`described`: its type and words)."""

    user_error: bool
    described: str
    words: str


class Text(msgspec.Struct, tag=True, array_like=True):
    rid: str
    text: str


class Done(msgspec.Struct, tag=True, array_like=True):
    rid: str
    finished: Finished


class Failure(msgspec.Struct, tag=True, array_like=True):
    """A request's generation failed: the exception's type and words (its traceback is in the
    engine's log)."""

    rid: str
    described: str


Event = Text | Done | Failure


class Outputs(msgspec.Struct, tag=True, array_like=True):
    events: list[Event]
    stats: EngineStats | None = None


FromEngine = Ready | LoadFailed | Outputs
