"""The event-loop side of an engine client: one asyncio.Queue of outputs per open request.

`generate()` registers a request's queue, hands the request to the engine core (`_admit`, which
ends in `CoreClient.add`: admission is `client/base.py`'s), and yields what arrives in the queue
until the output that finishes it; closing the iterator early aborts the request (`_send`). Where
the engine core runs is the subclass's business: `EngineCoreClient` (front ends, run-batch's app
process) reaches one over a pipe, `AsyncEngine` one in a thread of this process. Either delivers
its `outputs` with `_dispatch` on the event loop, and `_fail_all` when the server stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from flashserve.client.base import CoreClient, error_outputs
from flashserve.message.lora import LoRARequest
from flashserve.message.outputs import RequestOutput
from flashserve.message.requests import Abort, Add
from flashserve.message.sampling_params import SamplingParams


class OutputStreams(CoreClient):
    """An `EngineClient` over a `CoreClient`: subclasses implement `_admit` and `_send`, and the
    transport's `_submit` and `outputs`."""

    def __init__(self, max_model_len: int, vocab_size: int, max_waiting: int | None = None) -> None:
        super().__init__(vocab_size, max_waiting)
        self.max_model_len = max_model_len
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}

    def _admit(self, add: Add) -> None:
        """Hands a new request to the engine core through `add`, whose exceptions it raises
        (nothing is queued then)."""
        raise NotImplementedError

    def _send(self, item: Abort) -> None:
        raise NotImplementedError

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, group: str | None = None,
        cache_salt: str | None = None, stream: bool = True, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        # From the health check (in `add`) to the registration nothing awaits, so an engine core
        # that dies meanwhile finds this stream in _streams when its error outputs go out.
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._admit(Add(request_id, list(prompt_token_ids), params, group, cache_salt, stream, lora_request))
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (client disconnect): free its pages
                self._send(Abort(request_id))

    def abort(self, request_id: str, error: str | None = None) -> None:
        self._send(Abort(request_id, error))  # its last output comes with the outputs

    def abort_all(self, error: str) -> None:
        """End every open request with `error` (graceful shutdown past its deadline)."""
        for request_id in list(self._streams):
            self._send(Abort(request_id, error))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            queue = streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _fail_all(self, message: str) -> None:
        """Every open stream gets a final error output."""
        self._dispatch(error_outputs(message, list(self._streams)))

