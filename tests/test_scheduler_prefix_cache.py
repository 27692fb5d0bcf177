"""Scheduler with automatic prefix caching, over a fake executor (token 1000 for every sample).

Pages hold 16 tokens; a request reuses the full pages another request computed, computes the rest
(always at least its last prompt token), and requests that arrive together with one uncached
prefix compute it once.
"""

from __future__ import annotations

from flashserve.engine.outputs import SchedulerOutput
from flashserve.engine.request import Request
from flashserve.message.sampling_params import SamplingParams
from test_scheduler import assert_all_pages_free, make, run, step

PAGE = 16


def prompt_req(rid: str, tokens: list[int], salt: str | None = None, **params: object) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(rid, list(tokens), SamplingParams(**params), cache_salt=salt)


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def chunk_of(out: SchedulerOutput, rid: str) -> tuple[int, int]:
    """(num_computed_tokens, new tokens) of a request in a step."""
    r = next(r for r in out.requests if r.request_id == rid)
    return r.num_computed_tokens, r.num_new_tokens


def cached(max_tokens_per_step: int = 512, **kw: object):
    return make(max_tokens_per_step=max_tokens_per_step, caching=True, **kw)  # type: ignore[arg-type]


def test_a_hit_cuts_the_tokens_computed() -> None:
    s = cached()
    s.add_request(prompt_req("a", tokens(40)))
    run(s)
    s.add_request(prompt_req("b", tokens(40)))
    out, _ = step(s)
    assert chunk_of(out, "b") == (32, 8)


def test_the_last_prompt_token_is_always_computed() -> None:
    s = cached()
    s.add_request(prompt_req("a", tokens(32)))
    run(s)
    s.add_request(prompt_req("b", tokens(32)))
    out, _ = step(s)
    assert chunk_of(out, "b") == (16, 16)  # page 2 is cached too, but its last token gives the logits


def test_a_prompt_that_diverges_mid_page_reuses_only_the_full_pages_before() -> None:
    s = cached()
    s.add_request(prompt_req("a", tokens(48)))
    run(s)
    s.add_request(prompt_req("b", tokens(40) + tokens(20, start=7000)))
    out, _ = step(s)
    assert chunk_of(out, "b") == (32, 28)


def test_chunked_prefill_continues_after_a_partial_hit() -> None:
    s = cached(max_tokens_per_step=8)
    s.add_request(prompt_req("a", tokens(32)))
    run(s)
    s.add_request(prompt_req("b", tokens(32) + tokens(20, start=5000)))
    chunks = [chunk_of(out, "b") for out in run(s) if any(r.request_id == "b" for r in out.requests)]
    assert chunks[:4] == [(32, 8), (40, 8), (48, 4), (52, 1)]


def test_different_salts_never_share_pages() -> None:
    s = cached()
    s.add_request(prompt_req("a", tokens(40), salt="tenant-1"))
    run(s)
    for rid, salt in (("b", "tenant-2"), ("c", None)):
        s.add_request(prompt_req(rid, tokens(40), salt=salt))
        out, _ = step(s)
        assert chunk_of(out, rid) == (0, 40)
        run(s)
    s.add_request(prompt_req("d", tokens(40), salt="tenant-1"))
    out, _ = step(s)
    assert chunk_of(out, "d") == (32, 8)


def test_requests_arriving_together_compute_their_common_prefix_once() -> None:
    s = cached()
    for rid in ("a", "b", "c"):
        s.add_request(prompt_req(rid, tokens(64) + [9000 + ord(rid)]))
    first, _ = step(s)
    assert [r.request_id for r in first.requests] == ["a"]
    second, _ = step(s)
    assert chunk_of(second, "b") == (64, 1) and chunk_of(second, "c") == (64, 1)
    assert s.prefix_cache.num_hits == 128


def test_waiting_for_a_prefix_lets_other_requests_go_first() -> None:
    s = cached()
    s.add_request(prompt_req("a", tokens(64)))
    s.add_request(prompt_req("b", tokens(64)))
    s.add_request(prompt_req("other", tokens(20, start=3000)))
    out, _ = step(s)
    assert sorted(r.request_id for r in out.requests) == ["a", "other"]


def test_choices_of_one_prompt_share_its_pages() -> None:
    s = cached()
    choices = [prompt_req(f"c{i}", tokens(50), max_tokens=3) for i in range(4)]
    for r in choices:
        s.add_request(r)
    run(s)
    assert [r.num_cached_tokens for r in choices] == [0, 48, 48, 48]
    assert s.prefix_cache.num_queries == 4 * 50 and s.prefix_cache.num_hits == 3 * 48


def test_output_pages_are_cached_for_a_follow_up_turn() -> None:
    s = cached()
    a = prompt_req("a", tokens(30), max_tokens=20)
    s.add_request(a)
    run(s)
    s.add_request(prompt_req("b", a.all_token_ids + tokens(5, start=8000)))
    out, _ = step(s)
    assert chunk_of(out, "b") == (48, 7)  # 30 prompt + 20 output: three full pages


def test_a_preempted_request_recomputes_from_its_cached_pages() -> None:
    s = cached(num_pages=7, max_tokens_per_step=64)  # 6 pages of 16 tokens
    a = prompt_req("a", tokens(40), max_tokens=30)
    b = prompt_req("b", tokens(40, start=2000), max_tokens=30)
    s.add_request(a)
    s.add_request(b)
    resumed_at = None
    for _ in range(200):
        if not s.has_unfinished:
            break
        out, _ = step(s)
        if b.num_preemptions and resumed_at is None and any(r.request_id == "b" for r in out.requests):
            resumed_at = chunk_of(out, "b")[0]
    assert b.num_preemptions >= 1 and resumed_at is not None and resumed_at > 0
    assert a.output_token_ids == b.output_token_ids == [1000] * 30
    assert_all_pages_free(s)


def test_every_page_is_free_or_cached_once_idle() -> None:
    s = cached(num_pages=20)
    for i in range(6):
        s.add_request(prompt_req(f"r{i}", tokens(24) + tokens(i * 7 + 3, start=4000 + 100 * i), max_tokens=9))
    s.abort("r5")
    run(s)
    kv = s.kv_cache
    assert kv.num_used_pages == 0 and kv.num_free_pages == kv.capacity
    assert kv.num_cached_pages > 0


def test_caching_off_computes_every_token() -> None:
    s = make(max_tokens_per_step=512)
    s.add_request(prompt_req("a", tokens(40)))
    run(s)
    s.add_request(prompt_req("b", tokens(40)))
    out, _ = step(s)
    assert chunk_of(out, "b") == (0, 40)
    assert s.prefix_cache.num_queries == 0
