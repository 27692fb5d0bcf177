"""A request as the engine sees it: token ids in, token ids out, and where it stands."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashserve.message.outputs import TokenLogprob
    from flashserve.structured.grammar import GrammarMatcher

from flashserve.message.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, a stop string, or the end of the request's grammar
    LENGTH = "length"  # max_tokens, or the context length
    ABORT = "abort"  # the client went away
    ERROR = "error"  # this request failed alone; `Request.error` says why


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Requests of one API request (its prompts x n) share a group; the scheduler caps how many
    # running slots one group may hold. None: a request of its own, uncapped.
    group: str | None = None
    cache_salt: str | None = None  # requests with different salts never share cached pages
    lora_int_id: int = 0  # the LoRA adapter it runs with; 0: the base model
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose K/V is in the cache or computed by a launched step (it advances when a step is
    # scheduled). After a preemption this drops to 0 and the request recomputes prompt + output so
    # far (preemption by recompute).
    num_computed_tokens: int = 0
    # Output tokens that launched steps sample and whose ids the host does not have yet (0 or 1):
    # the next step may be scheduled behind them, its token taken from the device.
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    # Monotonic seconds when the scheduler first admitted it (its time in queue ends there).
    first_scheduled_time: float | None = None
    # Prompt tokens found in the prefix cache at the first schedule (usage's cached_tokens).
    num_cached_tokens: int = 0
    # Chained hashes of the request's full pages so far (prompt and output), for the prefix cache.
    page_hashes: list[bytes] = field(default_factory=list, repr=False)
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Speculative decoding (`engine/speculative.py`): draft tokens verified and accepted so far, and
    # whether its acceptance stayed so low that it stopped proposing.
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_disabled: bool = False
    # The request's grammar state (params.grammar): advanced with every output token.
    matcher: GrammarMatcher | None = field(default=None, repr=False)
    # The grammar accepted its end (what `advance` reported; asking the matcher costs a GIL trip).
    grammar_done: bool = False
    # When params.logprobs is set: one per output token.
    output_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)
    # When params.prompt_logprobs is set: prompt positions 1.. as their chunks are computed.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
