"""Bridge between asyncio handlers and the engine loop thread.

Handlers call `generate()` and read their request's outputs from an asyncio.Queue. The engine
loop, a single background thread, owns `LLMEngine` (and so the scheduler); it receives new
requests and aborts through a locked inbox and hands back each step's outputs with ONE
`call_soon_threadsafe` per step, not one per token.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from flashserve.engine.client import EngineDead
from flashserve.engine.engine import LLMEngine
from flashserve.engine.outputs import RequestOutput
from flashserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AsyncEngine:
    """An `EngineClient` over an `LLMEngine` run by a background thread."""

    def __init__(self, engine: LLMEngine, max_model_len: int) -> None:
        self.engine = engine
        self.max_model_len = max_model_len
        self._inbox: list[_Add | str] = []  # str = request id to abort
        self._wakeup = threading.Condition()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._dead: str | None = None

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="flashserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._wakeup:
            self._stop = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_healthy():
            raise EngineDead(self._dead or "the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._send(_Add(request_id, list(prompt_token_ids), params))
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
                self._send(request_id)

    def abort(self, request_id: str) -> None:
        self._send(request_id)

    def _send(self, item: _Add | str) -> None:
        with self._wakeup:
            self._inbox.append(item)
            self._wakeup.notify()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    # ---- engine-loop side ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while not self._stop and not self._inbox and not self.engine.has_unfinished:
                        self._wakeup.wait()
                    if self._stop:
                        return
                    inbox, self._inbox = self._inbox, []
                outputs = self._apply(inbox)
                if self.engine.has_unfinished:
                    outputs.extend(self.engine.step())
                if outputs:
                    self._emit(outputs)
        except BaseException as exc:  # the loop itself died: fail everyone, report unhealthy
            logger.exception("engine loop died")
            self._dead = f"engine loop died: {exc!r}"
            self._fail_all(self._dead)

    def _apply(self, inbox: list[_Add | str]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for item in inbox:
            if isinstance(item, str):
                aborted = self.engine.abort(item)
                if aborted is not None:
                    outputs.append(aborted)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params)
            except Exception as exc:
                outputs.append(_error_output(item.request_id, len(item.prompt_token_ids), str(exc)))
        return outputs

    def _emit(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, message: str) -> None:
        ids = list(self._streams)
        self._emit([_error_output(rid, 0, message) for rid in ids])


def _error_output(request_id: str, num_prompt_tokens: int, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=0,
        error=message,
    )
