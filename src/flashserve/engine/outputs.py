"""The objects that cross the engine's inner boundary: scheduler -> runner and back (what goes
out to the API is `message/outputs.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from flashserve.message.outputs import TokenLogprob
from flashserve.message.sampling_params import SamplingParams
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
    # The last this many of new_token_ids are draft tokens (speculative decoding): the step
    # computes logits at each of them and at the token before, and accepts a prefix of them.
    num_draft_tokens: int = 0
    # The LoRA adapter of the request (`LoRARequest.lora_int_id`), on every row; 0: the base model.
    lora_int_id: int = 0

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
    # One token a row and no draft tokens: no prompt chunk, nothing to verify. The scheduler sets it
    # from what it counted while building the step (late launches ask it of every step).
    decode_only: bool = False

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
        return replace(self, requests=rows, token_bitmask=None)


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
