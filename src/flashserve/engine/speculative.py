"""The scheduler's side of speculative decoding: draft tokens in, accepted tokens out.

A decoding request whose next token is the only one it has to compute may get up to k draft tokens
from a proposer (`spec_decode/`): its row becomes prefill-shaped, its last known token and the
drafts, and the step allocates pages for all of them. The runner computes logits at each of the
k + 1 positions and accepts a prefix of the drafts plus one token of its own
(`sample/rejection.py`). `verified` then rolls the request's computed tokens back over the
rejected drafts: their K/V stays in pages the request holds (the next step overwrites it) and is
never registered in the prefix cache, which only takes pages up to the rolled-back length.

Overlap: a speculative step is not scheduled ahead. The next step of a request depends on how many
drafts it accepted (its positions and its next n-gram), which the host learns only from the
step's results; and a request whose last token is still in flight has nothing on the host to
look its n-grams up in. So while speculation is on for a step (`active`), the step waits for its
results before the next one is scheduled; above `disable_by_batch_size`, or when every request
in the step stopped proposing, steps overlap again.

Grammars: drafts are cut to the longest prefix the request's grammar allows (a draft that would
end the grammar is left out: the grammar itself ends the request there), and the step's masks
are filled at schedule time for every position (the matcher is advanced over the drafts and
rolled back); `update` then advances the matcher over the tokens actually accepted.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence

import numpy as np

from flashserve.engine.outputs import SampledTokens, ScheduledRequest
from flashserve.engine.request import Request
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.spec_decode.config import SpeculativeConfig
from flashserve.spec_decode.ngram import NgramProposer
from flashserve.spec_decode.stats import SpecDecodeStats
from flashserve.structured.grammar import TokenBitmask, bitmask_words

logger = logging.getLogger(__name__)
LOG_INTERVAL_S = 10.0  # how often the log reports acceptance while requests speculate


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # A draft model proposes in the runner (`worker/drafter.py`): the scheduler reserves its slots.
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.method == "ngram" else None
        self.stats = SpecDecodeStats()
        self._logged = SpecDecodeStats()  # the counts as of the last log line
        self._log_at = time.monotonic() + LOG_INTERVAL_S
        # Each request's tokens as an array the proposer searches, extended by its new tokens only
        # (rebuilding it from the request's lists would cost its whole length every step).
        self._arrays: weakref.WeakKeyDictionary[Request, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    def active(self, num_running: int) -> bool:
        """Whether a step with this many running requests proposes at all."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def wants(self, request: Request) -> bool:
        """The request still proposes: its acceptance has not stayed low."""
        return not request.spec_disabled

    def propose(self, request: Request, budget: int, max_model_len: int) -> list[int]:
        """Draft tokens for a decoding request (its last known token is the one to compute), at
        most `budget` of them and never past its max_tokens or the context length; often []."""
        if request.spec_disabled:
            return []
        k = min(self.config.num_speculative_tokens, budget, request.params.max_tokens - request.num_output_tokens - 1,
                max_model_len - request.num_tokens - 1)
        if k < 1:
            return []
        if self.proposer is None:  # the draft model's tokens, written by the runner; no grammar to check them
            return [] if request.matcher is not None else [0] * k
        drafts = self.proposer.propose(self._tokens(request), k)
        if drafts and request.matcher is not None:
            drafts = _grammar_prefix(request, drafts)
        return drafts

    def _tokens(self, request: Request) -> np.ndarray:
        """The request's prompt and output so far (int64), kept per request and extended."""
        n, p = request.num_tokens, request.num_prompt_tokens
        buf, have = self._arrays.get(request, (None, 0))
        if buf is None or have > n:
            buf, have = np.empty(max(64, 2 * n), dtype=np.int64), 0
        elif n > len(buf):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        if have < p:
            buf[have:p] = request.prompt_token_ids[have:]
            have = p
        buf[have:n] = request.output_token_ids[have - p : n - p]
        self._arrays[request] = (buf, n)
        return buf[:n]

    def draft(self, request: Request, budget: int, kv_cache: KVCacheManager, max_model_len: int) -> list[int]:
        """`propose`, with pages for the drafts allocated; [] when none are free (drafts never
        preempt a request)."""
        drafts = self.propose(request, budget, max_model_len)
        if drafts and not kv_cache.allocate(request.request_id, request.num_computed_tokens + 1 + len(drafts)):
            return []
        return drafts

    def verified(self, request: Request, scheduled: ScheduledRequest, result: SampledTokens) -> int:
        """A verified row's results came back: counts its acceptance and rolls the request's
        computed tokens back over the rejected drafts; returns how many were rejected."""
        drafted = scheduled.num_draft_tokens
        accepted = max(0, min(drafted, len(result.token_ids) - 1)) if result.error is None else 0
        self.stats.record(drafted, accepted)
        request.num_spec_draft_tokens += drafted
        request.num_spec_accepted_tokens += accepted
        if (self.config.min_acceptance_rate > 0 and request.num_spec_draft_tokens >= self.config.acceptance_window
                and request.num_spec_accepted_tokens < self.config.min_acceptance_rate * request.num_spec_draft_tokens):
            request.spec_disabled = True  # each rejected draft costs a row of the step: stop paying for it
        request.num_computed_tokens -= drafted - accepted
        if time.monotonic() >= self._log_at:
            self._log()
        return drafted - accepted

    def _log(self) -> None:
        """Acceptance since the last line: mean accepted length and the rate at each position."""
        now, before = self.stats, self._logged
        window = SpecDecodeStats(now.num_drafts - before.num_drafts, now.num_draft_tokens - before.num_draft_tokens,
                                 now.num_accepted_tokens - before.num_accepted_tokens,
                                 [a - b for a, b in zip(now.accepted_per_pos, before.accepted_per_pos
                                                         + [0] * len(now.accepted_per_pos))])
        logger.info("speculative decoding: mean accepted length %.2f, acceptance %.1f%% (%d of %d draft tokens), "
                    "per position %s", window.mean_accepted_length, 100 * window.acceptance_rate,
                    window.num_accepted_tokens, window.num_draft_tokens,
                    ", ".join(f"{rate:.2f}" for rate in window.acceptance_per_position()))
        self._logged = SpecDecodeStats(now.num_drafts, now.num_draft_tokens, now.num_accepted_tokens,
                                       list(now.accepted_per_pos))
        self._log_at = time.monotonic() + LOG_INTERVAL_S


def _grammar_prefix(request: Request, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` the request's grammar allows, leaving out a token that ends it."""
    matcher = request.matcher
    assert matcher is not None
    advanced = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        advanced += 1
        if matcher.is_terminated():
            break
    kept = advanced - 1 if advanced and matcher.is_terminated() else advanced
    if advanced:
        matcher.rollback(advanced)
    return drafts[:kept]


def speculative_bitmask(rows: Sequence[tuple[Request, Sequence[int]]], vocab_size: int) -> TokenBitmask | None:
    """The masks of a step with draft tokens: `rows` are its sampling requests with their drafts;
    a mask row for every position (1 + drafts) of a row that follows a grammar, indexed by the
    position's place among all the step's positions. Filled now: each matcher walks over its
    drafts and back."""
    positions: list[int] = []
    entries: list[tuple[Request, int, Sequence[int]]] = []  # request, its first mask row, its drafts
    offset = 0
    for request, drafts in rows:
        if request.matcher is not None:
            entries.append((request, len(positions), drafts))
            positions.extend(range(offset, offset + len(drafts) + 1))
        offset += len(drafts) + 1
    if not entries:
        return None
    bitmask = np.zeros((len(positions), bitmask_words(vocab_size)), dtype=np.int32)
    for request, first, drafts in entries:
        matcher, grammar = request.matcher, request.params.grammar
        assert matcher is not None and grammar is not None
        for j in range(len(drafts) + 1):
            grammar.fill_bitmasks([matcher], bitmask[first + j : first + j + 1])
            if j < len(drafts) and not matcher.accept_token(drafts[j]):
                raise ValueError(f"draft token {drafts[j]} does not follow the grammar it was checked against")
        if drafts:
            matcher.rollback(len(drafts))
    return TokenBitmask(positions, bitmask)
