"""Why an engine client refuses a request before it is queued."""

from __future__ import annotations


class EngineDead(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class EngineOverloaded(RuntimeError):
    """The engine's queue is full; the request was not queued. Worth retrying later."""
