"""metrale: an ahead-of-time engine builder and serving runtime for speculative decoding."""

__version__ = "0.1.0"
