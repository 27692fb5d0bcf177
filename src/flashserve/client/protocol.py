"""What the API layer sees of the engine. API tests use a fake that satisfies this protocol."""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from flashserve.message.outputs import RequestOutput
from flashserve.message.sampling_params import SamplingParams


class EngineClient(Protocol):
    max_model_len: int

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, group: str | None = None,
        cache_salt: str | None = None, stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs step by step; the last one has finished=True.

        Raises InvalidParameter (at the first step of the iterator, before anything is queued) for
        token ids the model cannot take, EngineOverloaded when the queue is full and EngineDead when
        the engine loop is gone. Requests with the same `group` (one API request's choices) share
        a fair share of the running slots. Requests with different `cache_salt`s never share
        cached KV pages. `stream=False` (a caller that only wants the whole result) may merge
        outputs after the first into fewer, larger ones; the last still has finished=True.

        Stop strings in `params.stop` are matched on the detokenized text by the engine, so
        `RequestOutput.new_text` never contains them. Closing the iterator early (a client that
        disconnected) aborts the request and frees its pages.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request; safe to call for unknown or finished ids."""
        ...

    def is_healthy(self) -> bool: ...
