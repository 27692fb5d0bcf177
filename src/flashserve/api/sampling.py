"""An OpenAI request (chat or text completion) as the engine's SamplingParams: defaults filled in
as OpenAI has them, values out of range refused with the field they came from, and the params of
each further choice of a seeded request."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from flashserve.api.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from flashserve.message.sampling_params import InvalidParameter, SamplingParams


def to_sampling_params(
    req: GenerationRequest, max_tokens: int, eos_token_ids: Sequence[int], grammar: Any = None
) -> SamplingParams:
    """SamplingParams for choice 0; raises InvalidParameter for out-of-range values."""
    completion = isinstance(req, CompletionRequest)
    if max_tokens < 1 and not (max_tokens == 0 and completion and req.echo):  # type: ignore[attr-defined]
        # 0 with echo: the prompt alone, with its logprobs (prompt scoring, as in vLLM); no generation.
        hint = " (0 only with echo, which returns the prompt and its logprobs)" if completion else ""
        raise InvalidParameter("max_tokens", f"max_tokens must be at least 1, got {max_tokens}{hint}")
    logprobs = prompt_logprobs = None
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs set to true")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    elif isinstance(req, CompletionRequest):
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_or(req.temperature, 1.0),  # OpenAI's default
        top_p=_or(req.top_p, 1.0),
        top_k=_or(req.top_k, -1),
        min_p=_or(req.min_p, 0.0),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        presence_penalty=_or(req.presence_penalty, 0.0),
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
        eos_token_ids=tuple(eos_token_ids),
        logit_bias=_logit_bias(req.logit_bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
    )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of a seeded request uses seed + i, so choices differ yet stay reproducible."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
