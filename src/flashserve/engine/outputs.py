"""The objects that cross the engine's boundaries: scheduler -> runner, engine -> API."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import msgspec

from flashserve.engine.sampling_params import SamplingParams
from flashserve.structured.grammar import TokenBitmask


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: a prefill chunk or one decode token. Plain data: nothing in
    it is shared with the scheduler, so a step can be pickled to other ranks or processes.

    A request's first row (at admission, and again when it resumes after a preemption) is *new*:
    it carries the request's sampling parameters and its tokens known so far, and `page_ids` is
    its whole page table. Every later row is a diff: the tokens it computes and the pages added
    to its table since its last row. The runner keeps the rest (`worker/input_batch.py`).

    Read-only by convention, not frozen: a frozen dataclass's __init__ sets every field through
    object.__setattr__, 0.68 against 0.15 us here, paid for every running request every step.
    """

    request_id: str
    new_token_ids: list[int]  # tokens whose K/V this step computes
    num_computed_tokens: int  # tokens already cached = position of new_token_ids[0]
    # New row: the request's pages; later rows: the pages added since its last row (mostly none).
    page_ids: Sequence[int]
    # True when the chunk ends at the request's last known token, so the step samples its next one.
    sample: bool
    params: SamplingParams | None = None  # set on a new row only
    # A new row's tokens known so far (copies): the prompt, and the outputs before a preemption.
    prompt_token_ids: list[int] = field(repr=False, default_factory=list)
    output_token_ids: list[int] = field(repr=False, default_factory=list)
    # The last of new_token_ids is a placeholder for the token that the step before this one (still
    # on the device) samples for this request; the runner takes it from that step's ids. Only a
    # decode row has one.
    last_token_in_flight: bool = False

    @property
    def is_new(self) -> bool:
        """The request's first row since it was admitted or resumed: the runner (re)builds its state."""
        return self.params is not None

    @property
    def num_new_tokens(self) -> int:
        return len(self.new_token_ids)

    @property
    def kv_len(self) -> int:
        """Tokens in the cache after this step's append."""
        return self.num_computed_tokens + len(self.new_token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    # Requests that left the running set since the last step: finished (or aborted) and
    # preempted; the runner drops their state. A preempted one comes back as a new row.
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # The allowed tokens of the sampling rows that follow a grammar; None when none does.
    token_bitmask: TokenBitmask | None = None
    # Every request of the step may have its next step scheduled before this one's results are
    # on the host (`SamplingParams.schedules_ahead`).
    schedules_ahead: bool = True

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def for_ranks(self) -> SchedulerOutput:
        """The step as the other tensor-parallel ranks take it: no grammar (compiled grammars stay
        with rank 0, which alone samples) and no bitmask."""
        rows = [r if r.params is None or r.params.grammar is None else replace(r, params=replace(r.params, grammar=None))
                for r in self.requests]
        return SchedulerOutput(rows, self.finished_ids, self.preempted_ids, None, self.schedules_ahead)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A token's log-probability under the model's distribution at its position (log-softmax of the
    raw logits: before penalties, bias, temperature, filters and grammar masks, as vLLM reports by
    default), and the `top` most likely tokens there, most likely first. A msgspec Struct, as
    `RequestOutput` is."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class SampledTokens:
    """The runner's result for one scheduled request (runner -> scheduler, one per
    `SchedulerOutput.requests` entry, in order). Read-only by convention, like `RequestOutput`."""

    # Sampled this step, oldest first: [] for a chunk that does not sample (or on error).
    token_ids: list[int] = field(default_factory=list)
    # One per token id, when the request asks for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # Prompt tokens this chunk computed logits for (the request asks for prompt logprobs): the
    # entry of prompt position p + 1 for every position p of the chunk but the prompt's last.
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # this request's sampling failed; it fails alone


NOTHING = SampledTokens()  # a chunk that does not sample


def sampled(*token_ids: int) -> SampledTokens:
    return SampledTokens(list(token_ids))


def sample_error(message: str) -> SampledTokens:
    return SampledTokens(error=message)


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """What the engine tells the API about one request after a step (engine -> API).

    One is made per running request per step and crosses to a front end in every step's message,
    so it is a msgspec Struct that travels as an array (`client/codec.py`): against the slotted
    dataclass it was, 512 of them are made in 120 us instead of 240, encode in 44 us instead of
    417, decode in 158 us instead of 667, and take 34 KB instead of 113 (this project's 2-core
    machine). Read-only by convention rather than frozen (a frozen class's __init__ costs more);
    untracked by the garbage collector (`gc=False`): it holds lists of numbers and logprobs, never
    anything that could refer back to it."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # "" without a tokenizer
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    # Seconds on the monotonic clock; lets the API and metrics compute TTFT and latency.
    arrival_time: float = 0.0
    # Prompt tokens whose K/V came from the prefix cache when the request was first scheduled
    # (OpenAI's usage.prompt_tokens_details.cached_tokens); 0 until then.
    num_cached_tokens: int = 0
    # When the scheduler first admitted it, on the clock of `arrival_time`; 0.0 until then. Their
    # difference is the request's time in queue (its trace span's gen_ai.latency.time_in_queue).
    scheduled_time: float = 0.0
    # One per new token id when the request asks for logprobs, else None.
    logprobs: list[TokenLogprob] | None = None
    # On the output that carries the first token, when the request asks for prompt logprobs: one
    # entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None


def merge_outputs(parts: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and logprobs in order, the
    rest as the last one says (the counts, the finish)."""
    last = parts[-1]
    if len(parts) == 1:
        return last
    logprobs = None
    if any(p.logprobs is not None for p in parts):
        logprobs = [lp for p in parts for lp in (p.logprobs or ())]
    prompt_logprobs = next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None)
    return msgspec.structs.replace(
        last,
        new_token_ids=[t for p in parts for t in p.new_token_ids],
        new_text="".join(p.new_text for p in parts),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=max(p.num_cached_tokens for p in parts),
    )
