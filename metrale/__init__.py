"""metrale: an ahead-of-time engine builder and serving runtime for speculative decoding."""

from metrale.runtime import __version__  # noqa: F401  (the version engine directories record)
