"""Per-request generation parameters, validated once at the API boundary."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# OpenAI's limit on top_logprobs; each costs a top-k over the vocabulary per token.
MAX_LOGPROBS = 20

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclass(frozen=True)
class SamplingParams:
    # 0: the prompt only (computed, with its prompt_logprobs when asked), no token generated.
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF rule, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI rule, over output tokens
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # Ids that end generation unless ignore_eos; filled from the model's generation config.
    eos_token_ids: tuple[int, ...] = field(default=())
    # (token id, bias) pairs added to the logits before sampling; the engine checks the ids.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Logprobs of each sampled token and of the `logprobs` most likely tokens at its position
    # (0: the sampled token's only); None: none. `prompt_logprobs` likewise for the prompt's tokens.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # A compiled grammar (`flashserve.structured.grammar.Grammar`) the output must follow; None: free text.
    grammar: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Python's JSON parser accepts NaN and Infinity, and NaN fails every comparison: a range
        # check such as `repetition_penalty <= 0` would let it through to the sampler.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise InvalidParameter(name, f"{name} must be a finite number, got {value}")
        if self.max_tokens < 0:
            raise InvalidParameter("max_tokens", f"max_tokens must not be negative, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidParameter("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidParameter("top_k", f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise InvalidParameter(
                "repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParameter(name, f"{name} must be in [-2, 2], got {value}")
        if self.min_tokens < 0:
            raise InvalidParameter("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", "min_tokens must not exceed max_tokens")
        if any(not s for s in self.stop):
            raise InvalidParameter("stop", "stop strings must be non-empty")
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {token}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidParameter("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidParameter(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop_token_ids must be non-negative")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def schedules_ahead(self) -> bool:
        """Whether the request's next step may be scheduled before its last token reaches the
        host: not when penalties count its output tokens, its grammar needs the token for the next
        mask, or its prompt logprobs are copied to the host (which would wait for the step launched
        behind). min_tokens and seeds need only the count of its outputs, which the host knows."""
        return not (self.needs_penalties or self.grammar is not None or self.prompt_logprobs is not None)

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )
