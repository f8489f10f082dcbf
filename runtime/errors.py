"""The one exception hierarchy of metrale.

Every error raised at a boundary (a flag, a file, a checkpoint, an engine directory, a request)
is a `MetraleError` whose message names the flag or file, the value, and what is allowed. The
CLI prints these messages without a traceback; anything else escaping is a bug.
"""

import enum


class MetraleError(Exception):
    """Base class: a user-facing error with a complete message."""


class ConfigError(MetraleError):
    """A flag, a recipe or a config file holds a value that is not allowed."""


class CheckpointError(MetraleError):
    """A Hugging Face checkpoint is missing, malformed, or does not match its config."""


class EngineDirError(MetraleError):
    """An engine directory is missing, incomplete, or fails its checksums."""


class QuantizationError(MetraleError):
    """A quantization request cannot be honoured for this model (e.g. NVFP4 on a dense head)."""


class FlagChoice(str, enum.Enum):
    """A flag's allowed values as a string enum: `parse` returns the member of a value, or
    refuses it naming the flag (the subclass's `flag()`), the value and the allowed values."""

    @classmethod
    def flag(cls) -> str:
        raise NotImplementedError

    @classmethod
    def parse(cls, value: str):
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ConfigError(f"{cls.flag()} {value!r}: allowed values are {allowed}") from None
