"""The parts of the engine core's turn besides the engine's step (`engine/engine_core.py`): apply a new
request or an abort, end requests that waited too long for their first schedule, and publish each
step's numbers to the metrics."""

from __future__ import annotations

from typing import Any, Sequence

from flashserve.engine.llm_engine import LLMEngine
from flashserve.message.outputs import RequestOutput, error_output
from flashserve.message.requests import Abort, Add
from flashserve.metrics import Metrics, StepStats


def apply_add(engine: LLMEngine, add: Add, params: Any = None) -> RequestOutput | None:
    """Queue `add` (with `params` instead of its own, when given); an error output if the engine
    refuses it (that request fails alone)."""
    try:
        engine.add_request(add.request_id, add.prompt_token_ids, params if params is not None else add.params,
                           add.group, add.cache_salt, add.stream, add.lora_int_id)
    except Exception as exc:
        return error_output(add.request_id, len(add.prompt_token_ids), str(exc))
    return None


def apply_abort(engine: LLMEngine, abort: Abort) -> RequestOutput | None:
    return engine.abort(abort.request_id, abort.error)


def expire(engine: LLMEngine, queue_timeout: float | None, now: float) -> list[RequestOutput]:
    """Abort requests never scheduled `queue_timeout` seconds after they arrived."""
    if queue_timeout is None:
        return []
    expired: list[str] = []
    # New requests join the back in arrival order; preempted ones (already served once, never
    # expired) go to the front. So the first young new request ends the scan.
    for request in engine.scheduler.waiting:
        if request.num_preemptions:
            continue
        if now - request.arrival_time < queue_timeout:
            break
        expired.append(request.request_id)
    message = (f"the request waited more than {queue_timeout:g} s to be scheduled; "
               "the server is overloaded, retry later")
    outputs = [engine.abort(rid, message) for rid in expired]
    return [out for out in outputs if out is not None]


class StepRecorder:
    """Publishes each loop turn's numbers to `metrics` (engine-loop only)."""

    def __init__(self, engine: LLMEngine, metrics: Metrics | None) -> None:
        self.engine = engine
        self.metrics = metrics
        # Ids scheduled at least once and not finished (for queue times).
        self._scheduled: set[str] = set()
        # Scheduler counters (preemptions, prefix-cache queries and hits) as of the last record.
        self._counters_seen = (0, 0, 0)
        self._spec_seen: tuple[int, int, int, list[int]] = (0, 0, 0, [])  # the same, of speculative decoding

    def record(self, outputs: Sequence[RequestOutput], step_start: float, generation_tokens: int = 0) -> None:
        """`step_start`: when the step began, on the monotonic clock of the requests' arrival times
        and after every request it may schedule arrived. A request's queue time runs from its
        arrival to when the scheduler first admitted it (`first_scheduled_time`, the time a span
        reports too). `generation_tokens`: the step's output tokens, those held for requests not
        streamed included."""
        if self.metrics is None:
            return
        scheduler = self.engine.scheduler
        queue_times: list[float] = []
        for request in scheduler.running:
            if request.request_id not in self._scheduled:
                self._scheduled.add(request.request_id)
                queue_times.append((request.first_scheduled_time or step_start) - request.arrival_time)
        prompt_tokens = 0
        for out in outputs:
            n = len(out.new_token_ids)
            if n and out.num_output_tokens == n:  # its first tokens: its prompt was prefilled
                prompt_tokens += out.num_prompt_tokens
            if out.finished:
                if n and out.request_id not in self._scheduled:  # scheduled and done in one step
                    queue_times.append((out.scheduled_time or step_start) - out.arrival_time)
                self._scheduled.discard(out.request_id)
        kv_cache, prefix = scheduler.kv_cache, scheduler.prefix_cache
        counters = (scheduler.num_preemptions, prefix.num_queries, prefix.num_hits)
        preemptions, queries, hits = (now - seen for now, seen in zip(counters, self._counters_seen))
        self._counters_seen = counters
        spec = self._spec_deltas()
        self.metrics.record_step(StepStats(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            kv_pages_used=kv_cache.num_used_pages, kv_pages_free=kv_cache.num_free_pages,
            kv_pages_cached=kv_cache.num_cached_pages, num_preemptions=preemptions,
            prefix_cache_queries=queries, prefix_cache_hits=hits, num_prompt_tokens=prompt_tokens,
            num_generation_tokens=generation_tokens, queue_times=queue_times, **spec,
        ))
        loras = self.engine.loras
        if loras.enabled:
            assert loras.config is not None
            running = {r.lora_int_id for r in scheduler.running if r.lora_int_id}
            waiting = {r.lora_int_id for r in scheduler.waiting if r.lora_int_id}
            self.metrics.record_loras([n for i in running if (n := loras.name_of(i))],
                                      [n for i in waiting if (n := loras.name_of(i))], loras.config.max_loras)

    def _spec_deltas(self) -> dict[str, Any]:
        """Speculative decoding's counts since the last record (StepStats' spec_* fields)."""
        stats = self.engine.scheduler.spec_stats
        if stats is None or stats.num_drafts == self._spec_seen[0]:
            return {}
        drafts, tokens, accepted, per_pos = self._spec_seen
        seen = per_pos + [0] * (len(stats.accepted_per_pos) - len(per_pos))
        self._spec_seen = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                           list(stats.accepted_per_pos))
        return {"spec_drafts": stats.num_drafts - drafts, "spec_draft_tokens": stats.num_draft_tokens - tokens,
                "spec_accepted_tokens": stats.num_accepted_tokens - accepted,
                "spec_accepted_per_pos": [a - b for a, b in zip(stats.accepted_per_pos, seen)]}

