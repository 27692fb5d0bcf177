"""`--speculative-config`: vLLM's JSON shape, parsed once at start into a frozen dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

MAX_SPECULATIVE_TOKENS = 16
# Methods vLLM serves that flashserve does not yet; asking for one is a start-up error saying so.
NOT_SUPPORTED_YET = frozenset({"eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "deepseek_mtp", "suffix"})
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a decoding request proposes draft tokens and when it stops proposing.

    `method`: "ngram" (prompt lookup over the request's own prompt and output: the longest of its
    last `prompt_lookup_max` .. `prompt_lookup_min` tokens that occurred before proposes the tokens
    that followed it) or "draft_model" (`model`, a smaller model with the same vocabulary).
    `disable_by_batch_size`: no proposals in a step with more running requests than this (vLLM's
    name); None: always. `min_acceptance_rate`: a request whose accepted draft tokens, over its
    first `acceptance_window` verified drafts or more, fall below this share of the drafted ones
    stops proposing (each rejected draft token costs a row of the step); 0 keeps every request on.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.1
    acceptance_window: int = 32

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ValueError(f"--speculative-config: {problem}")

    def _problem(self) -> str | None:
        if self.method in NOT_SUPPORTED_YET:
            return f'method "{self.method}" is not supported yet; supported methods: "ngram", "draft_model"'
        if self.method not in METHODS:
            return f'unknown method "{self.method}"; supported methods: "ngram", "draft_model"'
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            return f"num_speculative_tokens must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {k!r}"
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
                return ("prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, "
                        f"got {lo!r} and {hi!r}")
        if self.method == "draft_model" and not self.model:
            return 'method "draft_model" needs "model": the draft model\'s path or id'
        if self.disable_by_batch_size is not None and (
                not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1):
            return f"disable_by_batch_size must be a positive integer, got {self.disable_by_batch_size!r}"
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            return f"min_acceptance_rate must be between 0 and 1, got {self.min_acceptance_rate!r}"
        if not isinstance(self.acceptance_window, int) or self.acceptance_window < 1:
            return f"acceptance_window must be a positive integer, got {self.acceptance_window!r}"
        return None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's keys: `method` (default "ngram", or "draft_model" when `model` is given),
        `num_speculative_tokens` (required), `prompt_lookup_min`/`max` (each defaults to the other,
        both to 5), `model`, `disable_by_batch_size`; ours: `min_acceptance_rate`, `acceptance_window`."""
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config: expected a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown field(s) {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config: num_speculative_tokens is required")
        values = dict(raw)
        if values.get("method") is None:
            values["method"] = "draft_model" if values.get("model") else "ngram"
        if values["method"] == "ngram":
            lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            values["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else 5)
            values["prompt_lookup_max"] = hi if hi is not None else values["prompt_lookup_min"]
        if values.get("min_acceptance_rate") is not None:
            values["min_acceptance_rate"] = float(values["min_acceptance_rate"])
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config: not JSON: {exc}") from None
        return cls.from_dict(raw)

    def describe(self) -> str:
        """One line for the start-up log."""
        what = (f"ngram (prompt lookup {self.prompt_lookup_min}..{self.prompt_lookup_max} tokens)"
                if self.method == "ngram" else f"draft model {self.model}")
        off = f", off above {self.disable_by_batch_size} running requests" if self.disable_by_batch_size else ""
        return (f"speculative decoding: {what}, {self.num_speculative_tokens} draft tokens per step{off}, "
                f"a request stops proposing below {self.min_acceptance_rate:.0%} acceptance")
