"""Shared by the speculative-decoding tests: an LLM's engine with its speculator set aside."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def speculation_off(llm: Any) -> Iterator[None]:
    """Steps `llm` without drafts for the duration (its scheduler's speculator set aside)."""
    scheduler = llm.engine.scheduler
    speculator, scheduler.speculator = scheduler.speculator, None
    try:
        yield
    finally:
        scheduler.speculator = speculator
