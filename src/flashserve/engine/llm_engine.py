"""The synchronous engine: one step = schedule, execute, update, then text and stop strings.

When a request stops is decided in one place, `check_stop` (engine/stop.py): the scheduler asks it
after every token, this engine after a stop string.

The device computes the next step while the host works on this one. With overlap scheduling
(`overlap=True`), step N+1 is scheduled and launched before step N's results are collected: its
decode rows take their tokens from N's sampled ids on the device, so the device goes from N to
N+1 without waiting for the host, and the host applies N's results (`update`), detokenizes them
and builds outputs while N+1 runs. Without it (or for a step whose requests need their last token
on the host first: `SamplingParams.schedules_ahead`), N's results are applied, then N+1 is
scheduled and launched, then the host detokenizes N. Either way a request that a result or a stop
string finishes may already be in the launched step; `update` drops its token, and its freed
pages are reused only by steps that run after it on the device.

With late launches as well (`late_launch=True`, `engine/late_launch.py`), the loop that drives the
engine may hold a step of decode rows on the device to a deadline shortly before it ends
(`launch_deadline`), receiving requests until then, so that a prompt arriving meanwhile joins the
step right behind it rather than the one after that.

`LLMEngine` is driven by exactly one thread (the engine loop of `AsyncEngine`, or the caller of
the offline API); nothing in it is thread-safe and nothing in it needs to be.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from flashserve.detokenizer import IncrementalDetokenizer, raw_decoder
from flashserve.engine.late_launch import AUTO_MIN_DECODE_S, DeviceTimes, LateLaunch
from flashserve.engine.lora_registry import LoRARegistry
from flashserve.engine.outputs import SampledTokens, SchedulerOutput
from flashserve.engine.request import FinishReason, Request
from flashserve.engine.scheduler import Scheduler
from flashserve.engine.stop import check_stop
from flashserve.message.outputs import RequestOutput
from flashserve.message.sampling_params import InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)


class Executor(Protocol):
    def launch(self, out: SchedulerOutput, previous: Any = None) -> Any:
        """Starts a non-empty step on the device; returns a handle for `collect`. `previous`: the
        handle of the step still on the device whose sampled ids are the step's tokens in flight
        (`ScheduledRequest.last_token_in_flight`), when the step has any."""
        ...

    def collect(self, handle: Any) -> list[SampledTokens]:
        """Waits for a launched step: one result per scheduled request, in order."""
        ...


@dataclass(eq=False)
class _Live:
    request: Request
    detokenizer: IncrementalDetokenizer | None
    stream: bool = True  # False: an output for the first tokens, then one when it finishes
    num_processed_tokens: int = 0  # output tokens detokenized and checked for stop strings
    num_sent_tokens: int = 0  # output tokens that went out in an output
    prompt_logprobs_sent: bool = False
    new_text: list[str] = field(default_factory=list)  # text not sent yet


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Raises InvalidParameter unless every id indexes a row of the model's embedding: an id past
    it would fail inside a kernel, which on a GPU poisons the whole process."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise InvalidParameter(
            param, f"token id {bad} in {param} is out of range: this model's vocabulary has "
            f"{vocab_size} tokens (ids 0 to {vocab_size - 1})")


def check_request(prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int) -> None:
    """Raises InvalidParameter for token ids the model cannot take (prompt, stop ids, logit_bias)."""
    check_token_ids(prompt_token_ids, vocab_size, "prompt")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids([token for token, _ in params.logit_bias], vocab_size, "logit_bias")


class LLMEngine:
    def __init__(
        self, scheduler: Scheduler, executor: Executor, tokenizer: Any | None = None, *, vocab_size: int,
        overlap: bool = False, loras: LoRARegistry | None = None, late_launch: bool | None = False,
    ) -> None:
        """overlap: schedule and launch each step before collecting the one before (the executor
        fills tokens in flight from `previous`). loras: the LoRA adapters the executor has loaded
        (default: none, and none can be). late_launch: with overlap, time the steps and give the
        driving loop a deadline for the next launch (`launch_deadline`); None: only behind decode steps
        of at least `AUTO_MIN_DECODE_S` on the device."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's embedding rows; never changes, so any thread may read it
        self.overlap = overlap
        self.loras = loras if loras is not None else LoRARegistry(executor, None)
        self._decode = raw_decoder(tokenizer) if tokenizer is not None else None
        self._live: dict[str, _Live] = {}
        self._launched: tuple[SchedulerOutput, Any] | None = None  # the step on the device
        self.late: LateLaunch | None = None
        self._times: DeviceTimes | None = None  # the executor, once it times the steps
        self._deadline_given = False  # the driving loop held the next launch to a deadline
        if overlap and late_launch is not False:
            self.start_late_launches(AUTO_MIN_DECODE_S if late_launch is None else 0.0)
        self.num_step_tokens = 0  # output tokens the last step() produced, held ones included

    def set_tokenizer(self, tokenizer: Any | None) -> None:
        """Detokenize (and find stop strings) with `tokenizer` from the next request on; None leaves
        text to the front ends."""
        self.tokenizer = tokenizer
        self._decode = raw_decoder(tokenizer) if tokenizer is not None else None

    @property
    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def lora_requests(self) -> Counter[int]:
        """Unfinished requests per LoRA adapter id (the base model's not counted)."""
        return Counter(live.request.lora_int_id for live in self._live.values() if live.request.lora_int_id)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidParameter for token ids the model cannot take (prompt, stop ids, logit_bias)."""
        check_request(prompt_token_ids, params, self.vocab_size)

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, group: str | None = None,
        cache_salt: str | None = None, stream: bool = True, lora_int_id: int = 0,
    ) -> None:
        """Queue a request; raises InvalidParameter for ids the model cannot take. Requests with the
        same `group` (the choices and prompts of one API request) share the scheduler's fair share;
        requests with different `cache_salt`s never share cached KV pages. `lora_int_id`: the LoRA
        adapter it runs with, loaded in the executor already (0: the base model). A request not streamed
        gets two outputs, not one per step: its first tokens at once (the time to first token),
        then everything after them when it finishes (or is aborted)."""
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_request(prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, group=group, cache_salt=cache_salt,
                          lora_int_id=lora_int_id)
        if params.grammar is not None:
            request.matcher = params.grammar.new_matcher()
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params, self._decode)
        self._live[request_id] = _Live(request, detok, stream)
        self.scheduler.add_request(request)

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Abort a request now (its pages are free when this returns); None if unknown. `error`
        says why when the server, not the client, gave up on it (queue timeout, shutdown)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        self.scheduler.finish(request_id, FinishReason.ABORT, error)
        return self._output(live)

    def start_late_launches(self, min_decode_s: float = 0.0) -> bool:
        """Times the steps and gives the driving loop deadlines (`launch_deadline`) from now on, behind
        decode steps of at least `min_decode_s` on the device; False where the executor has no device
        times (`DeviceTimes`: a GPU's runner has them)."""
        start = getattr(self.executor, "start_timing", None)
        if self.overlap and start is not None and start():
            self.late, self._times = LateLaunch(min_decode_s), self.executor  # type: ignore[assignment]
        return self.late is not None

    def launch_deadline(self) -> float | None:
        """With late launches: until when (`time.monotonic()`) the driving loop may receive requests
        before its next `step`, a step of decode rows being on the device; None: step at once."""
        deadline = self.late.deadline() if self.late is not None and self._launched is not None else None
        self._deadline_given = deadline is not None
        return deadline

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that got tokens or finished.

        Leaves the next step running on the device, if there is one; the next call collects it.
        """
        touched = self._launch() if self._launched is None else []
        if self._launched is not None:
            out, handle = self._launched
            self._launched = None
            if self.overlap and out.schedules_ahead:
                touched += self._launch(handle)  # behind the step on the device, before its results
                touched += self.scheduler.update(out, self._collect(handle))
            else:
                touched += self.scheduler.update(out, self._collect(handle))
                touched += self._launch()
        self.num_step_tokens = 0
        return [output for r in touched if r.request_id in self._live
                if (output := self._process(self._live[r.request_id])) is not None]

    def _launch(self, previous: Any = None) -> list[Request]:
        start = time.monotonic()
        out = self.scheduler.schedule()
        if out.is_empty:
            # update() reports requests the scheduler failed on its own (e.g. too long to fit).
            return self.scheduler.update(out, [])
        self._launched = (out, self.executor.launch(out, previous))
        if self.late is not None:
            assert self._times is not None
            end = time.monotonic()
            found_done = self._times.step_done(previous) if previous is not None and self._deadline_given else None
            self.late.launched(out, start, end, at_deadline=self._deadline_given, found_done=found_done)
            self._deadline_given = False
        return []

    def _collect(self, handle: Any) -> list[SampledTokens]:
        if self.late is None:
            return self.executor.collect(handle)
        assert self._times is not None
        start = time.monotonic()
        results = self.executor.collect(handle)
        self.late.collected(start, time.monotonic(), self._times.device_seconds(handle))
        return results

    def _process(self, live: _Live) -> RequestOutput | None:
        """The request's new tokens turned into text and checked for stop strings; its output, or
        None while a request that is not streamed holds them."""
        req = live.request
        new_ids = req.output_token_ids[live.num_processed_tokens :]
        live.num_processed_tokens = req.num_output_tokens
        self.num_step_tokens += len(new_ids)
        if live.detokenizer is not None:
            try:
                self._detokenize(live, new_ids)
            except Exception as exc:  # a failed request fails alone
                logger.exception("detokenizing request %s failed", req.request_id)
                self.scheduler.finish(req.request_id, FinishReason.ERROR, f"detokenization failed: {exc}")
        if req.is_finished:
            self._live.pop(req.request_id, None)
        elif live.num_sent_tokens and not live.stream:  # its first tokens went out: hold the rest
            return None
        return self._output(live)

    def _detokenize(self, live: _Live, new_ids: list[int]) -> None:
        detok = live.detokenizer
        assert detok is not None
        for i, token_id in enumerate(new_ids):
            live.new_text.append(detok.add(token_id))
            if detok.stopped:
                req = live.request
                if i + 1 < len(new_ids):
                    # Several tokens came in one step (accepted draft tokens): those after the one
                    # that completed the stop string are not output (ids, logprobs, usage).
                    keep = req.num_output_tokens - (len(new_ids) - i - 1)
                    del req.output_token_ids[keep:]
                    del req.output_logprobs[keep:]
                    live.num_processed_tokens = keep
                reason = check_stop(req, self.scheduler.max_model_len, stop_string=True)
                assert reason is not None  # a stop string always stops
                self.scheduler.finish(req.request_id, reason)
                return
        if live.request.is_finished and not detok.stopped:
            live.new_text.append(detok.flush())

    def _output(self, live: _Live) -> RequestOutput:
        """Everything the request got since its last output (an abort included)."""
        req = live.request
        start, end = live.num_sent_tokens, live.num_processed_tokens
        new_ids = req.output_token_ids[start:end]
        live.num_sent_tokens = end
        text = "".join(live.new_text)
        live.new_text.clear()
        logprobs = prompt_logprobs = None
        if new_ids and req.params.logprobs is not None:
            logprobs = req.output_logprobs[start:end]
        if req.params.prompt_logprobs is not None and not live.prompt_logprobs_sent and (new_ids or req.is_finished):
            live.prompt_logprobs_sent = True
            prompt_logprobs = [None, *req.prompt_logprobs]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,  # already a fresh slice
            new_text=text,
            finished=req.is_finished,
            finish_reason=req.finish_reason.value if req.finish_reason is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            error=req.error,
            arrival_time=req.arrival_time,
            num_cached_tokens=req.num_cached_tokens,
            scheduled_time=req.first_scheduled_time or 0.0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
