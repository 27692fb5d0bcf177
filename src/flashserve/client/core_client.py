"""`EngineCoreClient`: the `EngineClient` of a front-end process, over a pipe to the engine core.

Requests go out as plain data the moment the app submits them (`AddRequest`, the grammar as its
spec); each step's outputs for this front end come back in one message, read on the event loop as
they arrive (`add_reader`: a reader thread would wait for the GIL behind this loop's work), then
detokenized and checked for stop strings here (`OutputProcessor`) before they reach the streams.
Admission and health are every core client's (`client/base.py`). When the engine core dies, or its
pipe closes, every open request ends with an error and `on_dead(reason)` runs, so that the server
stops and exits non-zero.

LoRA adapters: the engine core owns them (`engine/lora_registry.py`). This client keeps the list
it last heard (the setup's, then every `LoRAAdapters` the core sends to all front ends after a
change) and sends load and unload calls (`LoRAUpdate`), whose answers come back in order behind
that list, so that a request sent after a load returns names the new adapter.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Callable, Mapping

from flashserve.client.output_processor import OutputProcessor
from flashserve.client.streams import OutputStreams
from flashserve.message.codec import (
    AddRequest, Dead, EngineSetup, FrameWriter, LoRAAdapters, LoRAUpdate, LoRAUpdateDone, StepOutputs, recv,
)
from flashserve.message.errors import EngineDead
from flashserve.message.lora import LORA_ERRORS, LoRAAdapterError, LoRARequest
from flashserve.message.outputs import RequestOutput
from flashserve.message.requests import Abort, Add

logger = logging.getLogger(__name__)


class EngineCoreClient(OutputStreams):
    """`max_waiting` bounds the sequences queued in the engine core (as of its last report, plus
    what this front end sent since): past it, `generate()` raises EngineOverloaded."""

    def __init__(self, conn: Connection, setup: EngineSetup, max_waiting: int | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        super().__init__(setup.max_model_len, setup.vocab_size, max_waiting)
        self.on_dead = on_dead
        self._conn = conn
        self._outputs = OutputProcessor(setup.tokenizer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: FrameWriter | None = None
        self.lora_enabled = setup.lora_enabled
        self._loras = {lora.lora_name: lora for lora in setup.lora_adapters}
        self._lora_calls: dict[int, asyncio.Future[LoRAUpdateDone]] = {}
        self._next_call = 0

    @property
    def lora_adapters(self) -> Mapping[str, LoRARequest]:
        return self._loras

    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> None:
        await self._lora_call(lora_name, lora_path, base_model_name)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._lora_call(lora_name, None, None)

    async def _lora_call(self, lora_name: str, lora_path: str | None, base_model_name: str | None) -> None:
        if not self.is_healthy():
            raise EngineDead(self.dead_reason or "the engine is not running")
        self._next_call += 1
        call_id = self._next_call
        answer: asyncio.Future[LoRAUpdateDone] = asyncio.get_running_loop().create_future()
        self._lora_calls[call_id] = answer
        try:
            self._put(LoRAUpdate(call_id, lora_name, lora_path, base_model_name))
            done = await answer
        finally:
            self._lora_calls.pop(call_id, None)
        if done.error is not None:
            raise LORA_ERRORS.get(done.error_kind or "", LoRAAdapterError)(done.error)

    def start(self) -> None:
        """Starts reading the engine core's messages on the running event loop, and writing to it
        from there without blocking."""
        self._loop = asyncio.get_running_loop()
        self._writer = FrameWriter(self._conn, self._loop)
        self._loop.add_reader(self._conn.fileno(), self._read)

    def shutdown(self) -> None:
        self._stop_reading()
        self._fail_all("the server is shutting down")
        for answer in self._lora_calls.values():
            if not answer.done():
                answer.set_exception(EngineDead("the server is shutting down"))
        if self._writer is not None:
            self._writer.close()
        self._conn.close()

    def is_healthy(self) -> bool:
        return super().is_healthy() and self._loop is not None

    def _admit(self, add: Add) -> None:
        params, grammar = add.params, add.params.grammar
        spec = None
        if grammar is not None:  # the compiled grammar stays here; the engine core compiles the spec
            params, spec = replace(params, grammar=None), grammar.spec
        # Stop strings are found here, so the engine must send every step's tokens.
        self.add(AddRequest(replace(add, params=params, stream=add.stream or bool(params.stop)), spec))

    def _submit(self, request: AddRequest) -> None:
        self._put(self._request(request))
        add = request.add
        self._outputs.add(add.request_id, add.prompt_token_ids, add.params)

    def _request(self, request: AddRequest) -> AddRequest:
        """The message that submits `request` (run-batch's client adds the request's batch line)."""
        return request

    def _send(self, item: Abort) -> None:
        self._outputs.discard(item.request_id)
        if self._dead is None:  # else the engine is gone with every request
            try:
                self._put(item)
            except EngineDead:  # it went just now; the reader reports it
                pass

    def _put(self, message: AddRequest | Abort) -> None:
        if self._writer is None:
            raise EngineDead("the engine core client has not started")
        try:
            self._writer.write(message)
        except OSError:  # a broken pipe: the engine core is gone
            raise EngineDead("the engine core process exited") from None

    def _read(self) -> None:
        """What the engine core sent, to the streams; then, if it died, `on_dead`."""
        alive = self._dead is None
        self._dispatch(self.outputs())
        if alive and self._dead is not None and self.on_dead is not None:
            self.on_dead(self._dead)

    def outputs(self) -> list[RequestOutput]:
        """Every message waiting in the pipe, read (a message is written whole): the step outputs
        among them detokenized, with their stop strings found; the error outputs of the open
        requests when the engine core died or its pipe closed."""
        outputs: list[RequestOutput] = []
        try:
            while self._conn.poll():
                outputs += self._receive(recv(self._conn))
        except (EOFError, OSError):
            self._stop_reading()
            outputs += self._receive(Dead("the engine core process exited"))
        return outputs

    def _receive(self, message: Any) -> list[RequestOutput]:
        """One message from the engine core; the outputs it brings."""
        if isinstance(message, StepOutputs):
            self.num_waiting = message.num_waiting
            for out in message.outputs:
                if self._outputs.process(out):  # a stop string ended it: free its pages now
                    self._send(Abort(out.request_id))
            return message.outputs
        if isinstance(message, LoRAAdapters):
            self._loras = {lora.lora_name: lora for lora in message.adapters}
        elif isinstance(message, LoRAUpdateDone):
            answer = self._lora_calls.get(message.call_id)
            if answer is not None and not answer.done():
                answer.set_result(message)
        elif isinstance(message, Dead) and self._dead is None:
            logger.error("%s", message.reason)
            for answer in self._lora_calls.values():
                if not answer.done():
                    answer.set_exception(EngineDead(message.reason))
            return self.died(message.reason, list(self._streams))
        return []

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
