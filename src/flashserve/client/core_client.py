"""`EngineCoreClient`: the `EngineClient` of a front-end process, over a pipe to the engine core.

Requests go out as plain data the moment the app submits them (`AddRequest`, the grammar as its
spec); each step's outputs for this front end come back in one message, read on the event loop as
they arrive (`add_reader`: a reader thread would wait for the GIL behind this loop's work), then
detokenized and checked for stop strings here (`OutputProcessor`) before they reach the streams.
When the engine core dies, or its pipe closes, every open request ends with an error and
`on_dead(reason)` runs, so that the server stops and exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Callable

from flashserve.client.output_processor import OutputProcessor
from flashserve.client.streams import OutputStreams
from flashserve.engine.llm_engine import check_request
from flashserve.message.codec import AddRequest, Dead, EngineSetup, FrameWriter, StepOutputs, recv
from flashserve.message.errors import EngineDead, EngineOverloaded
from flashserve.message.requests import Abort, Add

logger = logging.getLogger(__name__)


class EngineCoreClient(OutputStreams):
    """`max_waiting` bounds the sequences queued in the engine core (as of its last report, plus
    what this front end sent since): past it, `generate()` raises EngineOverloaded."""

    def __init__(self, conn: Connection, setup: EngineSetup, max_waiting: int | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        super().__init__(setup.max_model_len)
        self.vocab_size = setup.vocab_size
        self.max_waiting = max_waiting
        self.on_dead = on_dead
        self._conn = conn
        self._outputs = OutputProcessor(setup.tokenizer)
        self._num_waiting = 0  # the engine's queue length as last reported, plus adds sent since
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: FrameWriter | None = None
        self._dead: str | None = None

    def start(self) -> None:
        """Starts reading the engine core's messages on the running event loop, and writing to it
        from there without blocking."""
        self._loop = asyncio.get_running_loop()
        self._writer = FrameWriter(self._conn, self._loop)
        self._loop.add_reader(self._conn.fileno(), self._read)

    def shutdown(self) -> None:
        self._stop_reading()
        self._fail_all("the server is shutting down")
        if self._writer is not None:
            self._writer.close()
        self._conn.close()

    def is_healthy(self) -> bool:
        return self._dead is None and self._loop is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _admit(self, add: Add) -> None:
        check_request(add.prompt_token_ids, add.params, self.vocab_size)  # a bad id is the client's 400
        if self.max_waiting is not None and self._num_waiting >= self.max_waiting:
            raise EngineOverloaded(
                f"the server is overloaded: {self._num_waiting} requests are already waiting; retry later")
        params, grammar = add.params, add.params.grammar
        spec = None
        if grammar is not None:  # the compiled grammar stays here; the engine core compiles the spec
            params, spec = replace(params, grammar=None), grammar.spec
        # Stop strings are found here, so the engine must send every step's tokens.
        add = replace(add, params=params, stream=add.stream or bool(params.stop))
        self._put(self._request(add, spec))
        self._outputs.add(add.request_id, add.prompt_token_ids, add.params)
        self._num_waiting += 1

    def _request(self, add: Add, grammar_spec: Any) -> AddRequest:
        """The message that submits `add` (run-batch's client adds the request's batch line)."""
        return AddRequest(add, grammar_spec)

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
        """Every message waiting in the pipe (a message is written whole)."""
        try:
            while self._conn.poll():
                self._receive(recv(self._conn))
        except (EOFError, OSError):
            self._stop_reading()
            self._receive(Dead("the engine core process exited"))

    def _receive(self, message: Any) -> None:
        if isinstance(message, StepOutputs):
            self._num_waiting = message.num_waiting
            for out in message.outputs:
                if self._outputs.process(out):  # a stop string ended it: free its pages now
                    self._send(Abort(out.request_id))
            self._dispatch(message.outputs)
        elif isinstance(message, Dead) and self._dead is None:
            logger.error("%s", message.reason)
            self._dead = message.reason
            self._fail_all(message.reason)
            if self.on_dead is not None:
                self.on_dead(message.reason)

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
