"""Scheduler: budgets, chunked prefill, preemption, stopping rules, aborts, errors.

The model is a fake executor: every row that samples gets token 1000 (or a scripted token), every
other chunk nothing. Its rows are a runner's (`InputBatch`), kept from the steps' diffs.
"""

from __future__ import annotations

import random
import weakref
from typing import Callable

from flashserve.attention.base import BatchLayout
from flashserve.config import SchedulerConfig
from flashserve.engine.outputs import NOTHING, SampledTokens, ScheduledRequest, SchedulerOutput, sample_error, sampled
from flashserve.engine.request import FinishReason, Request, RequestStatus
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.message.sampling_params import SamplingParams
from flashserve.worker.input_batch import BatchRow, InputBatch, append_sampled

TOKEN = 1000
EOS = 2
Executor = Callable[[BatchRow], SampledTokens]
_batches: weakref.WeakKeyDictionary[Scheduler, InputBatch] = weakref.WeakKeyDictionary()


def fixed_token(r: BatchRow) -> SampledTokens:
    return sampled(TOKEN) if r.sample else NOTHING


def scripted(script: dict[str, list[int]]) -> Executor:
    """Request id -> the tokens it samples, in order; TOKEN once the script runs out."""

    def execute(r: BatchRow) -> SampledTokens:
        if not r.sample:
            return NOTHING
        tokens = script.get(r.request_id, [])
        n = len(r.output_token_ids)
        return sampled(tokens[n] if n < len(tokens) else TOKEN)

    return execute


def make(
    num_pages: int = 64,
    page_size: int = 16,
    max_num_seqs: int = 8,
    max_tokens_per_step: int = 64,
    max_model_len: int = 4096,
    caching: bool = False,  # the requests below share their prompts: caching would change their pages
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_per_step)
    return Scheduler(config, KVCacheManager(num_pages, page_size, caching), max_model_len)


def req(rid: str, prompt_len: int = 8, **params: object) -> Request:
    params.setdefault("eos_token_ids", (EOS,))
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params))


def step(s: Scheduler, execute: Executor = fixed_token) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    rows = _batches.setdefault(s, InputBatch()).update(out)
    # Every step's page tables, as a runner keeps them from the diffs, must describe a valid batch
    # for the attention backend.
    BatchLayout.build(rows, s.kv_cache.page_size)
    results = [execute(r) for r in rows]
    for row, result in zip(rows, results):  # what the runner's collect keeps
        append_sampled([row] * len(result.token_ids), result.token_ids)
    return out, s.update(out, results)


def run(s: Scheduler, execute: Executor = fixed_token, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished:
            return outs
        outs.append(step(s, execute)[0])
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_all_pages_free(s: Scheduler) -> None:
    bm = s.kv_cache
    assert bm.num_free_pages == bm.capacity and bm.num_used_pages == 0


# Budgets and chunked prefill


def test_token_budget_is_respected_every_step() -> None:
    s = make(max_tokens_per_step=20)
    for i in range(6):
        s.add_request(req(f"r{i}", prompt_len=13, max_tokens=5))
    outs = run(s)
    assert all(0 < o.num_batched_tokens <= 20 for o in outs)
    assert any(o.num_batched_tokens == 20 for o in outs)  # the budget is also used up


def test_sequence_cap_is_respected() -> None:
    s = make(max_num_seqs=3)
    for i in range(7):
        s.add_request(req(f"r{i}", max_tokens=4))
    for o in run(s):
        assert len(o.requests) <= 3
        assert s.num_running <= 3


def test_long_prompt_is_prefilled_in_chunks_and_only_the_last_chunk_samples() -> None:
    s = make(max_tokens_per_step=16)
    r = req("long", prompt_len=40, max_tokens=2)
    s.add_request(r)
    chunks = [step(s)[0].requests[0] for _ in range(3)]
    assert [c.num_new_tokens for c in chunks] == [16, 16, 8]
    assert [c.num_computed_tokens for c in chunks] == [0, 16, 32]
    assert [c.sample for c in chunks] == [False, False, True]
    assert sum((c.new_token_ids for c in chunks), []) == r.prompt_token_ids
    assert r.output_token_ids == [TOKEN] and r.num_computed_tokens == 40


def test_a_step_mixes_decode_tokens_and_a_prefill_chunk() -> None:
    s = make(max_tokens_per_step=10)
    s.add_request(req("a", prompt_len=4, max_tokens=10))
    step(s)
    s.add_request(req("b", prompt_len=30, max_tokens=10))
    out, _ = step(s)
    (a, b) = out.requests
    assert (a.request_id, a.num_new_tokens, a.sample) == ("a", 1, True)
    assert (b.request_id, b.num_new_tokens, b.sample) == ("b", 9, False)  # the rest of the budget


def test_decode_token_is_the_last_sampled_one_at_its_position() -> None:
    s = make()
    s.add_request(req("a", prompt_len=5, max_tokens=3))
    step(s, scripted({"a": [7, 8]}))
    out, _ = step(s, scripted({"a": [7, 8]}))
    (d,) = out.requests
    assert (d.new_token_ids, d.num_computed_tokens, d.kv_len) == ([7], 5, 6)


# Abort and finish from the engine


def test_abort_frees_pages_immediately() -> None:
    s = make()
    r = req("a", prompt_len=40)
    s.add_request(r)
    step(s)
    assert s.kv_cache.num_used_pages == 3
    assert s.abort("a") is r
    assert r.finish_reason is FinishReason.ABORT and r.is_finished
    assert_all_pages_free(s)
    assert not s.has_unfinished
    assert s.schedule().is_empty  # nothing to run: the runner learns of "a" with the next step
    s.add_request(req("b"))
    assert s.schedule().finished_ids == ["a"]


def test_abort_of_unknown_or_finished_request_returns_none() -> None:
    s = make()
    s.add_request(req("a", max_tokens=1))
    run(s)
    assert s.abort("a") is None
    assert s.abort("nope") is None


def test_abort_between_schedule_and_update_is_safe() -> None:
    s = make()
    a, b = req("a", max_tokens=3), req("b", max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    _batches.setdefault(s, InputBatch()).update(out)  # launched: the runner has both rows
    s.abort("a")
    touched = s.update(out, [fixed_token(r) for r in out.requests])
    assert touched == [b]
    assert a.output_token_ids == [] and a.finish_reason is FinishReason.ABORT
    run(s)
    assert b.num_output_tokens == 3
    assert_all_pages_free(s)


def test_abort_of_a_waiting_request_removes_it_from_the_queue() -> None:
    s = make(max_num_seqs=1)
    s.add_request(req("a", max_tokens=3))
    s.add_request(req("b", max_tokens=3))
    step(s)
    assert s.num_waiting == 1
    s.abort("b")
    assert s.num_waiting == 0
    assert [o.requests[0].request_id for o in run(s)] == ["a", "a"]


def test_engine_finish_with_stop_string_ends_the_request_and_update_skips_it() -> None:
    s = make()
    r = req("a", max_tokens=10)
    s.add_request(r)
    out = s.schedule()
    assert s.finish("a", FinishReason.STOP) is r
    assert s.update(out, [sampled(TOKEN)]) == []
    assert r.finish_reason is FinishReason.STOP and not s.has_unfinished
    assert_all_pages_free(s)


# Preemption


def test_preemption_takes_the_newest_request_which_resumes_and_finishes() -> None:
    # 6 usable pages of 4 tokens; three 8-token prompts take 6 pages, so the first decode
    # step needs a page that does not exist.
    s = make(num_pages=7, page_size=4, max_tokens_per_step=64)
    reqs = [req(f"r{i}", prompt_len=8, max_tokens=6) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    step(s)
    assert s.kv_cache.num_free_pages == 0
    out, _ = step(s)
    assert out.preempted_ids == ["r2"] and not out.finished_ids
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert reqs[2].status is RequestStatus.WAITING and reqs[2].num_preemptions == 1
    assert reqs[2].num_computed_tokens == 0
    run(s)
    assert [r.num_output_tokens for r in reqs] == [6, 6, 6]
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert reqs[0].num_preemptions == 0
    assert_all_pages_free(s)


def test_a_preempted_request_recomputes_prompt_and_output_so_far() -> None:
    s = make(num_pages=7, page_size=4)
    reqs = [req(f"r{i}", prompt_len=8, max_tokens=6) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    script = {"r2": [501, 502, 503, 504, 505, 506]}
    step(s, scripted(script))  # r2 samples 501
    step(s, scripted(script))  # r2 is preempted
    for _ in range(50):
        out, _ = step(s, scripted(script))
        resumed = [x for x in out.requests if x.request_id == "r2"]
        if resumed:
            break
    (r2,) = resumed
    assert r2.num_computed_tokens == 0
    assert r2.new_token_ids == reqs[2].prompt_token_ids + [501]
    assert r2.sample
    run(s, scripted(script))
    assert reqs[2].output_token_ids == script["r2"]


def test_a_running_request_that_is_itself_the_newest_preempts_itself() -> None:
    # 4 usable pages of 4 tokens. After the prefill a holds 1 page, b 2, one is free; at the first
    # decode a takes the free page, and b, the newest, needs a third page: it gives up its own.
    s = make(num_pages=5, page_size=4)
    a, b = req("a", prompt_len=4, max_tokens=6), req("b", prompt_len=8, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["a"] and out.preempted_ids == ["b"]
    assert b.num_preemptions == 1 and b.status is RequestStatus.WAITING
    run(s)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 3
    assert a.num_preemptions == 0
    assert_all_pages_free(s)


def test_every_request_finishes_and_all_pages_are_free_under_pressure() -> None:
    s = make(num_pages=20, page_size=4, max_num_seqs=6, max_tokens_per_step=24, max_model_len=64)
    reqs = [req(f"r{i}", prompt_len=3 + (7 * i) % 20, max_tokens=1 + (5 * i) % 17) for i in range(25)]
    for r in reqs:
        s.add_request(r)
    outs = run(s, max_steps=2000)
    assert all(r.is_finished and r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [r.params.max_tokens for r in reqs]
    assert sum(r.num_preemptions for r in reqs) > 0
    assert all(o.num_batched_tokens <= 24 and len(o.requests) <= 6 for o in outs)
    assert_all_pages_free(s)
    assert s.num_running == s.num_waiting == 0


# Stopping rules


def test_eos_stops_the_request() -> None:
    s = make()
    r = req("a", max_tokens=10)
    s.add_request(r)
    run(s, scripted({"a": [5, 6, EOS, 7]}))
    assert r.output_token_ids == [5, 6, EOS]
    assert r.finish_reason is FinishReason.STOP


def test_stop_token_id_stops_the_request() -> None:
    s = make()
    r = req("a", max_tokens=10, stop_token_ids=(42,))
    s.add_request(r)
    run(s, scripted({"a": [5, 42, 7]}))
    assert r.output_token_ids == [5, 42] and r.finish_reason is FinishReason.STOP


def test_max_tokens_ends_with_length() -> None:
    s = make()
    r = req("a", max_tokens=4)
    s.add_request(r)
    run(s)
    assert r.output_token_ids == [TOKEN] * 4 and r.finish_reason is FinishReason.LENGTH


def test_max_model_len_ends_with_length() -> None:
    s = make(max_model_len=12)
    r = req("a", prompt_len=8, max_tokens=100)
    s.add_request(r)
    run(s)
    assert r.num_tokens == 12 and r.finish_reason is FinishReason.LENGTH


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    s = make()
    r = req("a", max_tokens=2)
    s.add_request(r)
    run(s, scripted({"a": [5, EOS]}))
    assert r.finish_reason is FinishReason.STOP


def test_ignore_eos_keeps_generating_past_eos_but_not_past_stop_ids() -> None:
    s = make()
    a = req("a", max_tokens=4, ignore_eos=True)
    b = req("b", max_tokens=4, ignore_eos=True, stop_token_ids=(42,))
    s.add_request(a)
    s.add_request(b)
    run(s, scripted({"a": [EOS, EOS, 5, 6], "b": [EOS, 42]}))
    assert a.output_token_ids == [EOS, EOS, 5, 6] and a.finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == [EOS, 42] and b.finish_reason is FinishReason.STOP


def test_min_tokens_holds_back_eos() -> None:
    s = make()
    r = req("a", max_tokens=10, min_tokens=3)
    s.add_request(r)
    run(s, scripted({"a": [EOS, 5, EOS, EOS]}))
    assert r.output_token_ids == [EOS, 5, EOS, EOS]  # the first EOS that may stop is the 4th token
    assert r.finish_reason is FinishReason.STOP


# Errors


def test_sample_error_fails_one_request_while_others_continue() -> None:
    s = make()
    a, b = req("a", max_tokens=3), req("b", max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s)

    def fail_b(r: ScheduledRequest) -> SampledTokens:
        return sample_error("nan in logits") if r.request_id == "b" else fixed_token(r)

    _, touched = step(s, fail_b)
    assert touched == [a, b]
    assert b.finish_reason is FinishReason.ERROR and b.error == "nan in logits"
    run(s)
    assert a.num_output_tokens == 3 and a.finish_reason is FinishReason.LENGTH
    assert_all_pages_free(s)


def test_request_that_can_never_fit_ends_with_an_error() -> None:
    s = make(num_pages=5, page_size=4)  # 4 usable pages: 16 tokens
    r, ok = req("big", prompt_len=17), req("ok", prompt_len=4, max_tokens=2)
    s.add_request(r)
    s.add_request(ok)
    assert r.finish_reason is FinishReason.ERROR and "pages" in (r.error or "")
    _, touched = step(s)
    assert touched[0] is r  # reported by the next update
    run(s)
    assert ok.num_output_tokens == 2


def test_request_that_outgrows_the_whole_cache_ends_with_an_error() -> None:
    s = make(num_pages=3, page_size=4)  # 2 usable pages: 8 tokens
    r = req("a", prompt_len=6, max_tokens=100)
    s.add_request(r)
    run(s)
    assert r.finish_reason is FinishReason.ERROR and "pages" in (r.error or "")
    assert r.num_output_tokens == 3  # tokens 7 and 8 fit; the 9th would need a third page
    assert_all_pages_free(s)


def test_prompt_longer_than_max_model_len_ends_with_an_error() -> None:
    s = make(max_model_len=8)
    r = req("a", prompt_len=9)
    s.add_request(r)
    out, touched = step(s)
    assert out.is_empty and touched == [r]
    assert r.finish_reason is FinishReason.ERROR and "context length" in (r.error or "")


# Order


def test_tokens_are_appended_in_sampling_order() -> None:
    s = make()
    r = req("a", max_tokens=5)
    s.add_request(r)
    run(s, scripted({"a": [11, 12, 13, 14, 15]}))
    assert r.output_token_ids == [11, 12, 13, 14, 15]


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    s = make(max_num_seqs=2, max_tokens_per_step=64)
    for i in range(5):
        s.add_request(req(f"r{i}", max_tokens=2))
    first_seen: list[str] = []
    for o in run(s):
        first_seen += [r.request_id for r in o.requests if r.request_id not in first_seen]
    assert first_seen == ["r0", "r1", "r2", "r3", "r4"]


def test_update_returns_requests_in_schedule_order() -> None:
    s = make()
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, max_tokens=2))
    out, touched = step(s)
    assert [r.request_id for r in touched] == [r.request_id for r in out.requests] == ["a", "b", "c"]


def test_finished_ids_list_finished_requests_once() -> None:
    s = make()
    s.add_request(req("a", max_tokens=1))
    s.add_request(req("b", max_tokens=3))
    step(s)
    assert step(s)[0].finished_ids == ["a"]
    assert step(s)[0].finished_ids == []


def test_random_workload_with_aborts_keeps_pages_consistent_and_ends_clean() -> None:
    rng = random.Random(0)
    s = make(num_pages=24, page_size=4, max_num_seqs=5, max_tokens_per_step=16, max_model_len=48)
    reqs = [req(f"r{i}", prompt_len=rng.randint(1, 30), max_tokens=rng.randint(1, 15)) for i in range(40)]
    pending = list(reqs)
    batch = InputBatch()

    def execute(r: ScheduledRequest) -> SampledTokens:
        return sampled(EOS if rng.random() < 0.05 else TOKEN) if r.sample else NOTHING

    for _ in range(3000):
        if pending and rng.random() < 0.5:
            s.add_request(pending.pop(0))
        if not (s.has_unfinished or pending):
            break
        out = s.schedule()
        BatchLayout.build(batch.update(out), 4)
        if out.requests and rng.random() < 0.1:
            s.abort(rng.choice(out.requests).request_id)
        s.update(out, [execute(r) for r in out.requests])
        held = sum(len(s.kv_cache.pages(r.request_id)) for r in s.running)
        assert held == s.kv_cache.num_used_pages
        assert all(not s.kv_cache.pages(r.request_id) for r in s.waiting)
    assert not pending and not s.has_unfinished
    assert all(r.is_finished for r in reqs)
    assert_all_pages_free(s)


# Fair share between API requests


def grouped(group: str, count: int, **params: object) -> list[Request]:
    requests = [req(f"{group}-{i}", **params) for i in range(count)]
    for r in requests:
        r.group = group
    return requests


def test_one_group_holds_at_most_half_the_running_slots() -> None:
    s = make(max_num_seqs=8, max_tokens_per_step=512)
    for r in grouped("big", 12, max_tokens=50):
        s.add_request(r)
    step(s)
    assert s.num_running == 4 and s.num_waiting == 8


def test_a_later_request_overtakes_a_group_holding_its_share() -> None:
    s = make(max_num_seqs=8, max_tokens_per_step=512)
    for r in grouped("big", 12, max_tokens=50):
        s.add_request(r)
    step(s)
    small = req("small", max_tokens=1)
    s.add_request(small)
    out, _ = step(s)
    assert "small" in [r.request_id for r in out.requests]
    assert small.is_finished


def test_a_group_gets_a_slot_back_when_one_of_its_requests_ends() -> None:
    s = make(max_num_seqs=4, max_tokens_per_step=512)
    first, *rest = grouped("big", 3, max_tokens=50)
    first.params = SamplingParams(max_tokens=1)
    for r in (first, *rest):
        s.add_request(r)
    step(s)  # admits two, the first ends
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["big-1", "big-2"]


def test_requests_without_a_group_are_not_capped() -> None:
    s = make(max_num_seqs=8, max_tokens_per_step=512)
    for i in range(8):
        s.add_request(req(f"r{i}", max_tokens=50))
    step(s)
    assert s.num_running == 8


# Scheduling ahead: the next step scheduled before the last one's results are applied


def test_a_step_scheduled_ahead_gives_a_sampling_request_a_decode_row_whose_token_is_in_flight() -> None:
    s = make()
    s.add_request(req("a", prompt_len=8))
    first = s.schedule()
    ahead = s.schedule()  # before update(first)
    (row,) = ahead.requests
    assert row.last_token_in_flight and row.sample
    assert row.num_computed_tokens == 8 and row.num_new_tokens == 1
    assert s.get("a").output_token_ids == []  # the token in flight is not on the host yet
    s.update(first, [sampled(TOKEN)])
    s.update(ahead, [sampled(TOKEN + 1)])
    assert s.get("a").output_token_ids == [TOKEN, TOKEN + 1]


def test_a_prefill_chunk_scheduled_ahead_is_the_next_chunk_and_has_no_token_in_flight() -> None:
    s = make(max_tokens_per_step=8)
    s.add_request(req("a", prompt_len=20))
    first = s.schedule()
    ahead = s.schedule()
    (row,) = ahead.requests
    assert not row.last_token_in_flight and not row.sample
    assert row.num_computed_tokens == 8 and row.new_token_ids == list(range(18, 26))


def test_a_request_whose_token_in_flight_reaches_max_tokens_is_not_scheduled_ahead() -> None:
    s = make()
    s.add_request(req("a", max_tokens=1))
    s.add_request(req("b", max_tokens=5))
    first = s.schedule()
    ahead = s.schedule()
    assert [r.request_id for r in ahead.requests] == ["b"]
    touched = s.update(first, [sampled(TOKEN), sampled(TOKEN)])
    assert [r.request_id for r in touched if r.is_finished] == ["a"]
    s.update(ahead, [sampled(TOKEN)])
    assert s.get("b").output_token_ids == [TOKEN, TOKEN]
