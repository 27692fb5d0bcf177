"""What a client asks of the engine: a new request, or the end of one."""

from __future__ import annotations

from dataclasses import dataclass

from flashserve.message.lora import LoRARequest
from flashserve.message.sampling_params import SamplingParams


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group: str | None = None
    cache_salt: str | None = None
    stream: bool = True
    # The adapter the request runs with (its `model` named it); None: the base model.
    lora_request: LoRARequest | None = None

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0


@dataclass(frozen=True)
class Abort:
    request_id: str
    error: str | None = None  # None: the client went away; else why the server gave up on it
