"""What the API layer sees of the engine. API tests use a fake that satisfies this protocol."""

from __future__ import annotations

from typing import AsyncIterator, Mapping, Protocol

from flashserve.message.lora import LoRARequest
from flashserve.message.outputs import RequestOutput
from flashserve.message.sampling_params import SamplingParams


class EngineClient(Protocol):
    max_model_len: int

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, group: str | None = None,
        cache_salt: str | None = None, stream: bool = True, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs step by step; the last one has finished=True.

        Raises InvalidParameter (at the first step of the iterator, before anything is queued) for
        token ids the model cannot take, EngineOverloaded when the queue is full and EngineDead when
        the engine loop is gone. Requests with the same `group` (one API request's choices) share
        a fair share of the running slots. Requests with different `cache_salt`s never share
        cached KV pages. `stream=False` (a caller that only wants the whole result) may merge
        outputs after the first into fewer, larger ones; the last still has finished=True.

        `lora_request`: the LoRA adapter to run with (one of `lora_adapters`); None: the base model.

        Stop strings in `params.stop` are matched on the detokenized text by the engine, so
        `RequestOutput.new_text` never contains them. Closing the iterator early (a client that
        disconnected) aborts the request and frees its pages.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request; safe to call for unknown or finished ids."""
        ...

    def is_healthy(self) -> bool: ...


class LoRAEngineClient(EngineClient, Protocol):
    """An engine client that serves LoRA adapters (`--enable-lora`); the API checks for these
    members and treats an engine without them as one that serves the base model only."""

    lora_enabled: bool

    @property
    def lora_adapters(self) -> Mapping[str, LoRARequest]:
        """The loaded adapters by name, as the engine core last reported them."""
        ...

    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> None:
        """Loads an adapter in the engine core(s); raises LoRAAdapterError (a name in use, files
        the runner refuses, no room) and EngineDead."""
        ...

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unloads an adapter; raises LoRANotFound, LoRAInUse (it has running or waiting requests)
        and EngineDead."""
        ...
