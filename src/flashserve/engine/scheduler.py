"""Continuous batching with chunked prefill over a paged KV cache; preemption by recompute.

One step is `schedule()` (what runs now) then `update()` (what came out). All request state changes
happen in these two calls and in `add_request` / `abort` / `finish`, all made from the engine loop.

Scheduling ahead (overlap): the next step may be scheduled before the last one's results are
applied. `schedule()` advances each request's computed tokens when it schedules them, and a
request that samples in a step still on the device has an output placeholder: the next step gives
it a decode row whose token the runner takes from that step's sampled ids on the device
(`ScheduledRequest.last_token_in_flight`). A request that the pending token finishes by length is
not scheduled again; one that it finishes otherwise (EOS, a stop id or string) computes one
discarded row, whose result `update()` drops. Updates come in the order of the schedules.

A step is data (`SchedulerOutput`): a request's first row after its admission (or its resumption
after a preemption) is new and carries its parameters, tokens and page table, copied; later rows
carry only what changed (the tokens they compute, the pages added since). Requests that left the
running set go out as finished or preempted ids with the next step that runs, and the runner keeps
the rest (`worker/input_batch.py`). Nothing in a step is shared with the scheduler's own lists.

Policy (like vLLM v1): running requests first, oldest first, each gets one decode token or its next
prefill chunk; then waiting requests are admitted first-come first-served while the token budget,
the sequence cap and the free pages allow. A step in which no running request has output yet may
hold `prefill_only_budget` tokens instead: the budget protects running streams, and there are none.
A step takes a waiting prompt beside other prompt tokens only while its prompt tokens stay within
`max_prefill_tokens` (as SGLang's --max-prefill-tokens): of prompts that arrive together the first
gets its first token after its own step rather than after all of theirs, and running streams wait
on shorter steps. A step that running streams wait on holds at most `chunked_prefill_size` prompt
tokens (as SGLang's --chunked-prefill-size): a longer prompt continues in the next steps, so a
stream's gap between two tokens stays within a few decode steps.
When a running request needs a page and none is free, the newest running request is preempted: its
pages are freed and it later recomputes its prompt and output so far.

Prefix caching (`PrefixCache`): a request is admitted with the longest run of cached pages that
starts its tokens and computes only the rest; one whose next page another running request is
computing waits for it (it is passed over like a group at its share) instead of computing it too.
Its pages are registered for others once their K/V is computed, in update().

Fair share: the sequences of one API request (its prompts x n, a `group`) hold at most half the
running slots, so a request that fans out into hundreds of sequences cannot shut every other
client out until it ends. A waiting request whose group holds its share is passed over for later
ones; it is admitted as soon as one of its group's sequences ends.

LoRA adapters: the running set holds requests of at most `max_loras` distinct adapters (the base
model, id 0, is not one), so that no step names more adapters than the runner has slots for. A
waiting request of another adapter is passed over (it waits, nothing fails) until one of those
adapters has no running request left.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

from flashserve.config import SchedulerConfig
from flashserve.engine.outputs import SampledTokens, ScheduledRequest, SchedulerOutput
from flashserve.engine.prefix_cache import PrefixCache
from flashserve.engine.request import FinishReason, Request, RequestStatus
from flashserve.engine.speculative import Speculator
from flashserve.engine.step_rows import (NO_DRAFTS, admission_error, advance_grammars, apply_result, build_row,
                                         capacity_error, step_masks)
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.spec_decode.stats import SpecDecodeStats


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int, vocab_size: int | None = None
    ) -> None:
        """vocab_size: the model's, for the token bitmasks of requests with a grammar."""
        if config.max_num_seqs is None or config.max_num_batched_tokens is None:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens are chosen by device in build_engine: {config}")
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be positive: {config}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.config = config
        self.kv_cache = kv_cache
        self.prefix_cache = PrefixCache(kv_cache)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self._requests: dict[str, Request] = {}  # every unfinished request
        # Left the running set since the last step that went out: the runner drops their rows.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        # Pages of each running request's table that a step has told the runner of: the next
        # row carries only the pages after them. A request missing here gets a new row.
        self._sent_pages: dict[str, int] = {}
        # Finished by the scheduler itself outside update() (invalid or impossible requests);
        # the next update() reports them so the engine has one place to emit outputs.
        self._finished_unreported: list[Request] = []
        # The requests of each scheduled step whose results update() has not applied, oldest first.
        self._in_flight: deque[dict[str, Request]] = deque()
        self.num_preemptions = 0  # since start; the engine loop turns it into a metric
        self.max_running_per_group = max(1, config.max_num_seqs // 2)
        self._group_running: dict[str, int] = {}  # running requests per group
        # The most distinct LoRA adapters among the running requests (None: no limit); `build_engine`
        # sets it from --max-loras.
        self.max_loras: int | None = None
        self._lora_running: dict[int, int] = {}  # running requests per LoRA adapter id (never 0)
        # Draft tokens for decoding requests (`engine/speculative.py`); None: speculation off.
        self.speculator = Speculator(config.speculative) if config.speculative is not None else None

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """Acceptance of draft tokens since start; None with speculation off."""
        return self.speculator.stats if self.speculator is not None else None

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests or self._finished_unreported)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get(self, request_id: str) -> Request | None:
        """An unfinished request by id; None once it has finished."""
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a request. One that can never run is finished with ERROR and reported by update()."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        error = admission_error(request, self.max_model_len, self.kv_cache)
        if error is not None:
            request.finish(FinishReason.ERROR, error)
            self._finished_unreported.append(request)
            return
        self._requests[request.request_id] = request
        self.prefix_cache.add(request)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request now (the client went away) and free its pages; None if unknown/finished."""
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason, error: str | None = None) -> Request | None:
        """Finish a request now and free its pages (the engine's stop strings and errors).

        The caller reports it; update() does not return it again. None if unknown or finished.
        """
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._finish(request, reason, error)
        return request

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens and allocate their pages; the next call must be update(out, ...).

        Can be empty while requests the scheduler finished on its own wait to be reported: call
        update(out, []) anyway.
        """
        budget = self.config.max_num_batched_tokens
        # Whether a running stream waits on this step: only asked where a budget depends on it.
        streams_wait = bool(self.config.prefill_only_budget is not None or self.config.chunked_prefill_size) and any(
            r.output_token_ids or r.num_output_placeholders for r in self.running)
        if self.config.prefill_only_budget is not None and not streams_wait:
            budget = max(budget, self.config.prefill_only_budget)  # no stream waits on this step
        scheduled: list[tuple[Request, int]] = []
        prefill_cap = self.config.max_prefill_tokens or None
        # The prompt tokens a step may hold while streams wait on it: chunks beyond it go to later steps.
        chunk_cap = (self.config.chunked_prefill_size or None) if streams_wait else None
        prefill = 0  # prompt tokens of this step (chunks of more than one token)
        preempted = False
        speculate = self.speculator is not None and self.speculator.active(len(self.running))
        drafts: dict[str, list[int]] = {}  # request id -> its draft tokens, after its n tokens

        i = 0
        capacity_tokens = self.kv_cache.capacity * self.kv_cache.page_size
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_tokens = request.num_tokens  # known tokens, read once: this loop is per request per step
            # The capacity check of `_capacity_error`, inline: every running request, every step.
            error = capacity_error(self.kv_cache, request) if num_tokens > capacity_tokens else None
            if error is not None:
                self._finish(request, FinishReason.ERROR, error)
                self._finished_unreported.append(request)
                continue  # running[i] is now the next request
            pending = request.num_output_placeholders
            if pending and (request.num_output_tokens + pending >= request.params.max_tokens
                            or num_tokens + pending >= self.max_model_len):
                i += 1  # its token in flight is its last (check_stop's LENGTH): nothing more to compute
                continue
            n = min(num_tokens + pending - request.num_computed_tokens, budget)
            if n > 1 and chunk_cap is not None:  # a prompt chunk (a decode row is one token)
                n = min(n, chunk_cap - prefill)
                if n <= 0:
                    i += 1  # its next chunk waits for a later step; the streams after it still decode
                    continue
            while not self.kv_cache.allocate(request.request_id, request.num_computed_tokens + n):
                victim = self.running[-1]  # never one already scheduled: those are older
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # it was the newest, so no running request is left to look at
            if speculate and n == 1 and not pending and budget > 1:
                assert self.speculator is not None
                if draft := self.speculator.draft(request, budget - 1, self.kv_cache, self.max_model_len):
                    drafts[request.request_id] = draft
                    budget -= len(draft)
            scheduled.append((request, n))
            budget -= n
            if n > 1:
                prefill += n
            i += 1

        # Admitting right after a preemption would only take the pages back from older requests.
        i = 0
        while i < len(self.waiting) and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            if request.num_output_placeholders:
                i += 1  # preempted while its token was in flight: its tokens are not all known yet
                continue
            if request.group is not None and self._group_running.get(request.group, 0) >= self.max_running_per_group:
                i += 1  # its group holds its fair share; later requests of other groups go first
                continue
            lora = request.lora_int_id
            if (lora and self.max_loras is not None and lora not in self._lora_running
                    and len(self._lora_running) >= self.max_loras):
                i += 1  # every adapter slot is taken: it waits for one, requests of running adapters go first
                continue
            error = capacity_error(self.kv_cache, request)
            if error is not None:
                self._finish(request, FinishReason.ERROR, error)
                self._finished_unreported.append(request)
                continue
            cached = self.prefix_cache.lookup(request)  # waiting requests have computed nothing
            if cached is None:
                i += 1  # another request is computing its next page: wait for it, let others go
                continue
            num_cached = len(cached) * self.kv_cache.page_size
            n = min(request.num_tokens - num_cached, budget)
            if prefill and prefill_cap is not None and prefill + n > prefill_cap:
                break  # it starts in a later step; first come, first served: nobody overtakes it
            if chunk_cap is not None:
                n = min(n, chunk_cap - prefill)
                if n <= 0:
                    break  # the step holds its prompt tokens; first come, first served
            if not self.kv_cache.allocate(request.request_id, num_cached + n, cached):
                break  # first come, first served: nobody overtakes a request short of pages
            self.prefix_cache.admitted(request, cached)
            del self.waiting[i]
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            if request.group is not None:
                self._group_running[request.group] = self._group_running.get(request.group, 0) + 1
            if lora:
                self._lora_running[lora] = self._lora_running.get(lora, 0) + 1
            scheduled.append((request, n))
            budget -= n
            prefill += n

        if not scheduled:  # nothing runs: the released ids wait for the next step that does
            return SchedulerOutput([])
        finished, self._finished_ids = self._finished_ids, []
        preempted, self._preempted_ids = self._preempted_ids, []
        requests = [self._scheduled_request(r, n, drafts.get(r.request_id, NO_DRAFTS)) for r, n in scheduled]
        self._in_flight.append({r.request_id: r for r, _ in scheduled})
        ahead = all(r.params.schedules_ahead for r, _ in scheduled)
        if ahead and self.speculator is not None and self.speculator.active(len(self.running)):
            # See engine/speculative.py: a step whose requests may speculate next is not scheduled ahead.
            ahead = not any(self.speculator.wants(r) for r, _ in scheduled)
        bitmask = step_masks(scheduled, requests, drafts, self.vocab_size)
        return SchedulerOutput(requests, finished, preempted, bitmask, ahead, decode_only=not prefill and not drafts)

    def update(self, out: SchedulerOutput, results: Sequence[SampledTokens]) -> list[Request]:
        """Apply a step's results; `results[i]` belongs to `out.requests[i]`.

        Returns the requests that got a token or finished in this step, in schedule order, after
        those the scheduler finished on its own since the last update (invalid or impossible).
        Requests finished with abort()/finish() in the meantime are skipped: their token is dropped.
        """
        if len(results) != len(out.requests):
            raise ValueError(f"{len(results)} results for {len(out.requests)} scheduled requests")
        touched, self._finished_unreported = self._finished_unreported, []
        if out.is_empty:
            return touched
        in_flight = self._in_flight.popleft()
        if len(in_flight) != len(out.requests):
            raise ValueError("update() got a step other than the oldest one scheduled")
        advanced = advance_grammars(out, results, in_flight)
        for scheduled, result in zip(out.requests, results):
            request = in_flight.get(scheduled.request_id)
            if request is None or request.is_finished:
                continue
            if scheduled.sample:
                request.num_output_placeholders -= 1
            if request.status is RequestStatus.RUNNING:  # not preempted since it was scheduled
                rejected = 0
                if scheduled.num_draft_tokens:
                    assert self.speculator is not None
                    rejected = self.speculator.verified(request, scheduled, result)
                # Rejected drafts' K/V never enters the prefix cache; accepted ones' pages enter
                # it once their tokens are appended (hashed), with the next step's results.
                self.prefix_cache.computed(request, min(scheduled.kv_len - rejected, request.num_tokens))
            end = apply_result(request, scheduled, result, advanced.get(request.request_id), self.prefix_cache,
                               self.max_model_len)
            if end is not None:
                self._finish(request, *end)
            if scheduled.sample or end is not None:
                touched.append(request)
        return touched

    def _leave_running(self, request: Request, preempted: bool = False) -> None:
        self.running.remove(request)
        if self._sent_pages.pop(request.request_id, None) is not None:  # the runner has its row
            (self._preempted_ids if preempted else self._finished_ids).append(request.request_id)
        self.prefix_cache.released(request)
        if request.group is not None:
            left = self._group_running[request.group] - 1
            if left:
                self._group_running[request.group] = left
            else:
                del self._group_running[request.group]
        if request.lora_int_id:
            left = self._lora_running[request.lora_int_id] - 1
            if left:
                self._lora_running[request.lora_int_id] = left
            else:
                del self._lora_running[request.lora_int_id]

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop its K/V and queue it first, to be recomputed in full."""
        self._leave_running(request, preempted=True)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        if request.status is RequestStatus.RUNNING:
            self._leave_running(request)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)
        self._requests.pop(request.request_id, None)
        request.finish(reason, error)

    def _scheduled_request(self, request: Request, n: int, drafts: list[int]) -> ScheduledRequest:
        """The request's share of the step (`step_rows.build_row`); the runner learns of its pages."""
        table = self.kv_cache.pages(request.request_id)
        sent = self._sent_pages.get(request.request_id)
        self._sent_pages[request.request_id] = len(table)
        return build_row(request, n, drafts, table, sent)
