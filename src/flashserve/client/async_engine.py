"""Bridge between asyncio handlers and the engine loop thread.

Handlers call `generate()` and read their request's outputs from an asyncio.Queue. The engine
loop, a single background thread, owns `LLMEngine` (and so the scheduler); it receives new
requests and aborts through a locked inbox and hands back each step's outputs with ONE
`call_soon_threadsafe` per step, not one per token. A request that is not streamed wakes its
handler twice, not once per step: the engine sends its first output at once (the time to first
token) and holds the rest until it finishes (`LLMEngine.add_request`). Once per loop turn it also
ends requests that waited too long for their first schedule and publishes the step's numbers to
the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

from flashserve.message.errors import EngineOverloaded
from flashserve.client.streams import OutputStreams
from flashserve.message.requests import Abort, Add
from flashserve.engine.engine import LLMEngine
from flashserve.engine.heap import existing_objects_frozen
from flashserve.engine.loop import StepRecorder, apply_abort, apply_add, expire
from flashserve.message.outputs import RequestOutput
from flashserve.metrics import Metrics

logger = logging.getLogger(__name__)


class AsyncEngine(OutputStreams):
    """An `EngineClient` over an `LLMEngine` run by a background thread.

    `max_waiting` bounds the requests queued for the engine (new or preempted): past it,
    `generate()` raises EngineOverloaded. `queue_timeout` (seconds) aborts a request, with an
    error, that has not been scheduled that long after it arrived. `on_dead(reason)` runs on the
    event loop once the engine loop has died and every open stream has got its error: a server
    exits then, so that its supervisor restarts it (a CUDA error poisons the whole process).
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_model_len: int,
        metrics: Metrics | None = None,
        max_waiting: int | None = None,
        queue_timeout: float | None = None,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        if queue_timeout is not None and queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be positive, got {queue_timeout}")
        super().__init__(max_model_len)
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.queue_timeout = queue_timeout
        self.on_dead = on_dead
        self._inbox: list[Add | Abort] = []
        self._wakeup = threading.Condition()
        # Guarded by _wakeup: waiting requests as of the last loop turn, plus adds sent since.
        self._num_waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._dead: str | None = None
        self._recorder = StepRecorder(engine, metrics)  # engine-loop only

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._record([], time.monotonic())  # the loop has not started: this thread may read the state
        self._thread = threading.Thread(target=self._run, name="flashserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still open end with an error instead of waiting forever."""
        with self._wakeup:
            self._stop = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all("the server is shutting down")

    def is_healthy(self) -> bool:
        return (self._dead is None and not self._stop and self._thread is not None
                and self._thread.is_alive())

    @property
    def dead_reason(self) -> str | None:
        """Why the engine loop died, or None while it lives (or stopped normally)."""
        return self._dead

    def _admit(self, add: Add) -> None:
        # Here, not only in the engine loop: a bad id is the client's error (InvalidParameter), and
        # it never enters the queue.
        self.engine.check_request(add.prompt_token_ids, add.params)
        with self._wakeup:
            if self.max_waiting is not None and self._num_waiting >= self.max_waiting:
                raise EngineOverloaded(
                    f"the server is overloaded: {self._num_waiting} requests are already waiting; retry later")
            self._num_waiting += 1
            self._inbox.append(add)
            self._wakeup.notify()

    def _send(self, item: Abort) -> None:
        with self._wakeup:
            self._inbox.append(item)
            self._wakeup.notify()

    def _died(self, message: str) -> None:
        self._fail_all(message)
        if self.on_dead is not None:
            self.on_dead(message)

    # ---- engine-loop side ------------------------------------------------------------------
    def _run(self) -> None:
        with existing_objects_frozen():
            self._loop_until_stopped()

    def _loop_until_stopped(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while not self._stop and not self._inbox and not self.engine.has_unfinished:
                        self._wakeup.wait()
                    if self._stop:
                        return
                    inbox, self._inbox = self._inbox, []
                outputs = self._apply(inbox)
                start = time.monotonic()  # after the arrivals just applied: queue times are never negative
                outputs.extend(expire(self.engine, self.queue_timeout, start))
                generated = 0
                if self.engine.has_unfinished:
                    outputs.extend(self.engine.step())
                    generated = self.engine.num_step_tokens
                self._record(outputs, start, generated)
                if outputs:
                    self._emit(outputs)
        except BaseException as exc:  # the loop itself died: fail everyone, report unhealthy
            logger.exception("engine loop died")
            self._dead = f"engine loop died: {exc!r}"
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._died, self._dead)
                except RuntimeError:  # the event loop is closed
                    pass

    def _apply(self, inbox: list[Add | Abort]) -> list[RequestOutput]:
        outputs = [apply_abort(self.engine, item) if isinstance(item, Abort) else apply_add(self.engine, item)
                   for item in inbox]
        return [out for out in outputs if out is not None]

    def _record(self, outputs: list[RequestOutput], step_start: float, generation_tokens: int = 0) -> None:
        """Publish the queue length for `generate()` and this step's numbers to the metrics."""
        with self._wakeup:
            self._num_waiting = self.engine.scheduler.num_waiting + sum(isinstance(i, Add) for i in self._inbox)
        self._recorder.record(outputs, step_start, generation_tokens)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

