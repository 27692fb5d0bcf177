"""What a client asks of the engine: a new request, or the end of one."""

from __future__ import annotations

from dataclasses import dataclass

from flashserve.message.sampling_params import SamplingParams


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group: str | None = None
    cache_salt: str | None = None
    stream: bool = True


@dataclass(frozen=True)
class Abort:
    request_id: str
    error: str | None = None  # None: the client went away; else why the server gave up on it
