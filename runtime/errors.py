"""The one exception hierarchy of metrale.

Every error raised at a boundary (a flag, a file, a checkpoint, an engine directory, a request)
is a `MetraleError` whose message names the flag or file, the value, and what is allowed. The
CLI prints these messages without a traceback; anything else escaping is a bug.
"""


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


def choice(enum_cls, value: str, flag: str):
    """The member of the string enum `enum_cls` whose value is `value`, or a ConfigError naming
    `flag`, the value and the allowed values."""
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum_cls)
        raise ConfigError(f"{flag} {value!r}: allowed values are {allowed}") from None
