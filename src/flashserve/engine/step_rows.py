"""A step's rows as the scheduler builds them, and the per-row bookkeeping of their results: the
pieces of `Scheduler.schedule` / `update` that look at one request at a time (grammar masks and
advances, prompt logprobs). Pure Python, called only from the scheduler."""

from __future__ import annotations

from collections.abc import Sequence

from flashserve.engine.outputs import SampledTokens, ScheduledRequest, SchedulerOutput
from flashserve.engine.prefix_cache import PrefixCache
from flashserve.engine.request import FinishReason, Request
from flashserve.engine.speculative import speculative_bitmask
from flashserve.engine.stop import check_stop
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.structured.grammar import TokenBitmask, step_bitmask

NO_PAGES: tuple[int, ...] = ()  # a diff row's pages when its table did not grow (most steps)
NO_DRAFTS: list[int] = []  # never written to


def build_row(request: Request, n: int, drafts: list[int], table: Sequence[int], sent: int | None) -> ScheduledRequest:
    """The request's share of the step: `n` of its tokens (and `drafts` after them); its computed
    tokens (and placeholders) advance by it. Its first row since admission (`sent` is None) is new
    (parameters, tokens and pages), later ones are diffs (the pages after the `sent` first)."""
    rid = request.request_id
    start = request.num_computed_tokens
    end = start + n
    known = request.num_tokens
    in_flight = end > known  # its last token is the one a launched step samples
    tokens = token_slice(request, start, end)
    if in_flight:
        tokens.append(0)  # the runner writes the sampled id here on the device
    sample = end == known + request.num_output_placeholders
    if drafts:
        tokens += drafts
    request.num_computed_tokens = end + len(drafts)
    if sample:
        request.num_output_placeholders += 1
    if sent is None:
        # Copies: the request's lists and table keep changing after this step is built.
        return ScheduledRequest(rid, tokens, start, table[:], sample, request.params, request.prompt_token_ids[:],
                                request.output_token_ids[:], in_flight, num_draft_tokens=len(drafts),
                                lora_int_id=request.lora_int_id)
    return ScheduledRequest(rid, tokens, start, table[sent:] if len(table) > sent else NO_PAGES, sample,
                            last_token_in_flight=in_flight, num_draft_tokens=len(drafts),
                            lora_int_id=request.lora_int_id)


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """all_token_ids[start:end] without concatenating prompt and output on every decode step."""
    p = request.num_prompt_tokens
    if start >= p:
        return request.output_token_ids[start - p : end - p]
    if end <= p:
        return request.prompt_token_ids[start:end]
    return request.prompt_token_ids[start:] + request.output_token_ids[: end - p]


def step_masks(scheduled: Sequence[tuple[Request, int]], rows: Sequence[ScheduledRequest],
               drafts: dict[str, list[int]], vocab_size: int | None) -> TokenBitmask | None:
    """The token bitmask of a step's sampling rows (of each of their positions, in a step with
    draft tokens), if any follows a grammar."""
    sampling = [r for (r, _), s in zip(scheduled, rows) if s.sample]
    if all(r.matcher is None for r in sampling):
        return None
    if vocab_size is None:
        raise ValueError("requests with a grammar need the scheduler's vocab_size")
    if drafts:
        return speculative_bitmask([(r, drafts.get(r.request_id, NO_DRAFTS)) for r in sampling], vocab_size)
    return step_bitmask([r.matcher for r in sampling], [r.params.grammar for r in sampling], vocab_size)


def advance_grammars(out: SchedulerOutput, results: Sequence[SampledTokens],
                     in_flight: dict[str, Request]) -> dict[str, tuple[bool, bool]]:
    """The first new token of every live grammar request, through its matcher in one call:
    request id -> (accepted, terminated)."""
    rows = []
    for scheduled, result in zip(out.requests, results):
        request = in_flight.get(scheduled.request_id)
        if (request is not None and request.matcher is not None and not request.is_finished
                and scheduled.sample and result.error is None and result.token_ids):
            rows.append((request, result.token_ids[0]))
    if not rows:
        return {}
    grammar = rows[0][0].params.grammar
    assert grammar is not None
    states = grammar.advance([r.matcher for r, _ in rows], [t for _, t in rows])  # type: ignore[misc]
    return {r.request_id: state for (r, _), state in zip(rows, states)}


def add_prompt_logprobs(request: Request, scheduled: ScheduledRequest, result: SampledTokens) -> None:
    """Keeps the chunk's prompt logprobs not seen before (a recompute after preemption repeats them)."""
    assert result.prompt_logprobs is not None
    first_target = scheduled.num_computed_tokens + 1  # the prompt position the chunk's first entry is for
    skip = len(request.prompt_logprobs) + 1 - first_target
    if skip >= 0:
        request.prompt_logprobs.extend(result.prompt_logprobs[skip:])


def apply_result(request: Request, scheduled: ScheduledRequest, result: SampledTokens,
                 first: tuple[bool, bool] | None, prefix_cache: PrefixCache,
                 max_model_len: int) -> tuple[FinishReason, str | None] | None:
    """A row's result on its (live) request: prompt logprobs, then the sampled tokens; how the
    request ends (an error, a length, a stop), or None."""
    if result.prompt_logprobs:
        add_prompt_logprobs(request, scheduled, result)
    error = result.error
    if error is None and scheduled.sample and not result.token_ids:
        error = "the sampler returned no token"
    if error is not None:
        return FinishReason.ERROR, error
    if not scheduled.sample:
        return None
    if request.params.max_tokens == 0:  # the prompt only (scoring): its sampled token is dropped
        return FinishReason.LENGTH, None
    return append_tokens(request, result, first, prefix_cache, max_model_len)


def append_tokens(request: Request, result: SampledTokens, first: tuple[bool, bool] | None,
                  prefix_cache: PrefixCache, max_model_len: int) -> tuple[FinishReason, str | None] | None:
    """The step's tokens of a sampling request (several after a verified draft), each through the
    grammar and the stop rules, up to the first that ends it; returns how it ends, or None.
    `first`: the grammar's verdict on the first token, already advanced (`advance_grammars`)."""
    for i, token in enumerate(result.token_ids):
        if request.matcher is not None:
            grammar = request.params.grammar
            assert grammar is not None
            accepted, request.grammar_done = first if i == 0 and first is not None else grammar.advance(
                [request.matcher], [token])[0]
            if not accepted:
                return FinishReason.ERROR, f"the sampled token {token} does not follow the grammar"
        request.output_token_ids.append(token)
        if result.logprobs is not None:
            request.output_logprobs.append(result.logprobs[i])
        prefix_cache.appended(request)
        reason = check_stop(request, max_model_len)
        if reason is not None:
            return reason, None
    return None


def capacity_error(kv_cache: KVCacheManager, request: Request) -> str | None:
    """Why the request can never run even alone in the cache, or None."""
    needed = kv_cache.num_pages_needed(request.num_tokens)
    if needed <= kv_cache.capacity:
        return None
    return (f"request {request.request_id} needs {needed} KV cache pages for {request.num_tokens} tokens, but the "
            f"cache has only {kv_cache.capacity} pages of {kv_cache.page_size} tokens")


def admission_error(request: Request, max_model_len: int, kv_cache: KVCacheManager) -> str | None:
    """Why a new request can never run, or None."""
    if request.num_prompt_tokens == 0:
        return "the prompt is empty"
    if request.num_prompt_tokens > max_model_len:
        return (f"the prompt has {request.num_prompt_tokens} tokens, more than the maximum context length of "
                f"{max_model_len}")
    return capacity_error(kv_cache, request)
