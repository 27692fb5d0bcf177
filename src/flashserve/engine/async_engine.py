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

from flashserve.engine.client import EngineOverloaded
from flashserve.engine.engine import LLMEngine
from flashserve.engine.heap import existing_objects_frozen
from flashserve.engine.outputs import RequestOutput
from flashserve.engine.streams import Abort, Add, OutputStreams, error_output
from flashserve.metrics import Metrics, StepStats

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
        # Engine-loop only: ids scheduled at least once and not finished (for queue times).
        self._scheduled: set[str] = set()
        # Scheduler counters (preemptions, prefix-cache queries and hits) as of the last metrics.
        self._counters_seen = (0, 0, 0)

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
                start = time.monotonic()
                outputs = self._apply(inbox)
                outputs.extend(self._expire(start))
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
        outputs: list[RequestOutput] = []
        for item in inbox:
            if isinstance(item, Abort):
                aborted = self.engine.abort(item.request_id, item.error)
                if aborted is not None:
                    outputs.append(aborted)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params, item.group,
                                        item.cache_salt, item.stream)
            except Exception as exc:
                outputs.append(error_output(item.request_id, len(item.prompt_token_ids), str(exc)))
        return outputs

    def _expire(self, now: float) -> list[RequestOutput]:
        """Abort requests never scheduled `queue_timeout` seconds after they arrived."""
        if self.queue_timeout is None:
            return []
        expired: list[str] = []
        # New requests join the back in arrival order; preempted ones (already served once,
        # never expired) go to the front. So the first young new request ends the scan.
        for request in self.engine.scheduler.waiting:
            if request.num_preemptions:
                continue
            if now - request.arrival_time < self.queue_timeout:
                break
            expired.append(request.request_id)
        message = (f"the request waited more than {self.queue_timeout:g} s to be scheduled; "
                   "the server is overloaded, retry later")
        outputs = [self.engine.abort(rid, message) for rid in expired]
        return [out for out in outputs if out is not None]

    def _record(self, outputs: list[RequestOutput], step_start: float, generation_tokens: int = 0) -> None:
        """Publish the queue length for `generate()` and this step's numbers to the metrics
        (`generation_tokens`: the step's output tokens, those held for requests not streamed included)."""
        scheduler = self.engine.scheduler
        with self._wakeup:
            self._num_waiting = scheduler.num_waiting + sum(isinstance(i, Add) for i in self._inbox)
        if self.metrics is None:
            return
        queue_times: list[float] = []
        for request in scheduler.running:
            if request.request_id not in self._scheduled:
                self._scheduled.add(request.request_id)
                queue_times.append(step_start - request.arrival_time)
        prompt_tokens = 0
        for out in outputs:
            n = len(out.new_token_ids)
            if n and out.num_output_tokens == n:  # its first tokens: its prompt was prefilled
                prompt_tokens += out.num_prompt_tokens
            if out.finished:
                if n and out.request_id not in self._scheduled:  # scheduled and done in one step
                    queue_times.append(step_start - out.arrival_time)
                self._scheduled.discard(out.request_id)
        kv_cache, prefix = scheduler.kv_cache, scheduler.prefix_cache
        counters = (scheduler.num_preemptions, prefix.num_queries, prefix.num_hits)
        preemptions, queries, hits = (now - seen for now, seen in zip(counters, self._counters_seen))
        self._counters_seen = counters
        self.metrics.record_step(StepStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            kv_pages_used=kv_cache.num_used_pages, kv_pages_free=kv_cache.num_free_pages,
            kv_pages_cached=kv_cache.num_cached_pages, num_preemptions=preemptions,
            prefix_cache_queries=queries, prefix_cache_hits=hits, num_prompt_tokens=prompt_tokens,
            num_generation_tokens=generation_tokens, queue_times=queue_times,
        ))

    def _emit(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

