"""The scheduler's side of grammars and logprobs: matchers advance with every token, a grammar's end
stops its request, a step carries the bitmask of its grammar rows only, and logprobs reach outputs."""

from __future__ import annotations

from test_scheduler import EOS, TOKEN, make, req, step

from flashserve.engine.outputs import SampledTokens, sampled
from flashserve.engine.request import FinishReason
from flashserve.message.outputs import TokenLogprob


class AnyGrammar:
    advance_calls = 0

    def new_matcher(self) -> "CountingMatcher":
        return CountingMatcher()

    def advance(self, matchers, token_ids) -> list[tuple[bool, bool]]:  # noqa: ANN001
        AnyGrammar.advance_calls += 1
        return [(m.accept_token(t), m.is_terminated()) for m, t in zip(matchers, token_ids)]

    def fill_bitmasks(self, matchers, bitmask) -> None:  # noqa: ANN001
        for j, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, j)


def with_grammar(r):  # noqa: ANN001, ANN201
    """The request follows a grammar whose matcher is `r.matcher` (set by the test)."""
    import dataclasses

    r.params = dataclasses.replace(r.params, grammar=AnyGrammar())
    return r


class CountingMatcher:
    """Allows any token; terminates after accepting `end`; rejects `bad`."""

    def __init__(self, end: int = EOS, bad: int = -5) -> None:
        self.end, self.bad = end, bad
        self.accepted: list[int] = []
        self.filled = 0

    def accept_token(self, token_id: int) -> bool:
        if token_id == self.bad:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == self.end

    def fill_next_token_bitmask(self, bitmask, index: int) -> None:  # noqa: ANN001
        self.filled += 1
        bitmask[index, :] = 0
        bitmask[index, 0] = 1  # only token 0


def test_a_step_carries_a_bitmask_for_grammar_rows_only() -> None:
    s = make()
    s.vocab_size = 64
    plain, constrained = req("plain"), with_grammar(req("json"))
    constrained.matcher = CountingMatcher()
    s.add_request(plain)
    s.add_request(constrained)
    out = s.schedule()
    assert out.token_bitmask is not None and out.token_bitmask.rows == [1]
    assert constrained.matcher.filled == 0  # filled when the runner reads it, after the forward
    array = out.token_bitmask.array()
    assert array.shape[0] == 1 and array[0, 0] == 1 and constrained.matcher.filled == 1


def test_update_advances_every_grammar_row_of_a_step_in_one_call() -> None:
    s = make()
    s.vocab_size = 64
    constrained = [with_grammar(req(f"json{i}")) for i in range(3)]
    for r in constrained:
        r.matcher = CountingMatcher()
        s.add_request(r)
    s.add_request(req("plain"))
    before = AnyGrammar.advance_calls
    step(s, lambda sr: sampled(TOKEN) if sr.sample else SampledTokens())
    assert AnyGrammar.advance_calls == before + 1
    assert all(r.matcher.accepted == [TOKEN] for r in constrained)


def test_a_step_without_grammar_rows_has_no_bitmask() -> None:
    s = make()
    s.add_request(req("plain"))
    assert s.schedule().token_bitmask is None


def test_the_grammar_end_stops_the_request_even_with_ignore_eos() -> None:
    s = make()
    s.vocab_size = 64
    r = with_grammar(req("json", ignore_eos=True, max_tokens=50))
    r.matcher = CountingMatcher(end=EOS)
    s.add_request(r)
    step(s, lambda sr: sampled(TOKEN) if sr.sample else SampledTokens())
    step(s, lambda sr: sampled(EOS) if sr.sample else SampledTokens())
    assert r.finish_reason is FinishReason.STOP
    assert r.matcher.accepted == [TOKEN, EOS]


def test_a_token_the_grammar_rejects_fails_only_that_request() -> None:
    s = make()
    s.vocab_size = 64
    r = with_grammar(req("json"))
    r.matcher = CountingMatcher(bad=TOKEN)
    s.add_request(r)
    s.add_request(req("plain"))
    step(s)
    assert r.finish_reason is FinishReason.ERROR and "grammar" in r.error
    assert s.get("plain") is not None


def test_logprobs_are_kept_one_per_output_token() -> None:
    s = make()
    r = req("a", logprobs=1, max_tokens=2)
    s.add_request(r)
    lp = TokenLogprob(TOKEN, -0.5, ((TOKEN, -0.5),))
    for _ in range(2):
        step(s, lambda sr: SampledTokens([TOKEN], [lp]) if sr.sample else SampledTokens())
    assert r.output_logprobs == [lp, lp]


def test_requests_that_ask_for_prompt_logprobs_compute_their_whole_prompt() -> None:
    s = make(caching=True)
    first = req("first", prompt_len=40)
    s.add_request(first)
    while s.get("first") is not None:
        step(s)
    again = req("again", prompt_len=40, prompt_logprobs=0)
    s.add_request(again)
    out, _ = step(s)
    assert out.requests[0].num_computed_tokens == 0 and again.num_cached_tokens == 0


def prompt_scores(sr) -> SampledTokens:  # noqa: ANN001
    """A runner's result for a request that asks for prompt logprobs: one entry per position of the
    chunk that has a next prompt token, and a sampled token where the chunk samples."""
    last = len(sr.new_token_ids) - (1 if sr.sample else 0)
    entries = [TokenLogprob(TOKEN, -1.0, ()) for _ in range(last)]
    return SampledTokens([TOKEN] if sr.sample else [], None, entries)


def test_max_tokens_0_ends_after_the_prompt_by_length_with_its_logprobs_no_token_and_no_pages() -> None:
    s = make(max_tokens_per_step=16)
    r = req("score", prompt_len=40, max_tokens=0, prompt_logprobs=1)
    s.add_request(r)
    touched = []
    while s.has_unfinished:
        touched += step(s, prompt_scores)[1]
    assert touched == [r] and r.finish_reason is FinishReason.LENGTH
    assert r.output_token_ids == [] and len(r.prompt_logprobs) == 39
    assert s.kv_cache.num_used_pages == 0 and s.num_running == 0


def test_max_tokens_0_is_not_scheduled_again_behind_its_prompts_last_chunk() -> None:
    s = make()
    r = req("score", max_tokens=0)
    s.add_request(r)
    s.add_request(req("other", max_tokens=4))
    first = s.schedule()
    ahead = s.schedule()  # before update(first), as with overlap scheduling
    assert [row.request_id for row in ahead.requests] == ["other"]
    s.update(first, [sampled(TOKEN), sampled(TOKEN)])
    assert r.is_finished and r.output_token_ids == []
