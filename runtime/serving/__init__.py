"""Serving: the generator a request runs on, request validation, the guards and the OpenAI-compatible HTTP server."""
