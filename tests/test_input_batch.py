"""The runner's persistent batch, kept from the scheduler's diffs alone, equals a batch rebuilt from
scratch out of the scheduler's own state after any run of admissions, chunked prefills, preemptions,
aborts, finishes and steps scheduled ahead."""

from __future__ import annotations

import pickle
import random
from collections import deque

import pytest

from flashserve.attention.base import BatchLayout
from flashserve.config import SchedulerConfig
from flashserve.engine.outputs import NOTHING, SampledTokens, ScheduledRequest, SchedulerOutput, sampled
from flashserve.engine.request import Request
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.message.sampling_params import SamplingParams
from flashserve.worker.input_batch import BatchRow, InputBatch, append_sampled

EOS = 2


def rebuilt(s: Scheduler) -> dict[str, tuple[list[int], list[int], list[int], SamplingParams]]:
    """What a runner must know of every running request, from the scheduler's state."""
    return {r.request_id: (list(r.prompt_token_ids), list(r.output_token_ids), list(s.kv_cache.pages(r.request_id)),
                           r.params) for r in s.running}


def kept(batch: InputBatch) -> dict[str, tuple[list[int], list[int], list[int], SamplingParams]]:
    return {rid: (list(r.prompt_token_ids), list(r.output_token_ids), list(r.page_ids), r.params)
            for rid, r in batch.rows.items()}


def launch(batch: InputBatch, out: SchedulerOutput, rng: random.Random) -> tuple[list[BatchRow], list[SampledTokens]]:
    """A fake runner's launch: the diffs applied (through pickle, as the other ranks take them),
    a token drawn for every sampling row."""
    rows = batch.update(pickle.loads(pickle.dumps(out.for_ranks())))
    assert [r.request_id for r in rows] == [r.request_id for r in out.requests]
    BatchLayout.build(rows, 4)  # the kept page tables hold every row's tokens
    results = [sampled(EOS if rng.random() < 0.04 else 100 + r.num_prior_outputs) if r.sample else NOTHING
               for r in rows]
    return rows, results


def collect(rows: list[BatchRow], results: list[SampledTokens]) -> None:
    for row, result in zip(rows, results):
        append_sampled([row] * len(result.token_ids), result.token_ids)


@pytest.mark.parametrize("seed", range(6))
def test_the_batch_kept_from_diffs_equals_a_rebuild_after_any_run_of_steps(seed: int) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 16, 40]))
    s = Scheduler(config, KVCacheManager(rng.choice([16, 20, 24]), 4, enable_caching=seed % 2 == 0), 60)
    shared = [rng.randrange(3, 50) for _ in range(12)]  # common prefixes: cached pages shared
    pending = [Request(f"r{i}", (shared[: rng.randint(0, 12)] + [rng.randrange(3, 50) for _ in range(rng.randint(1, 20))]),
                       SamplingParams(max_tokens=rng.randint(1, 20), eos_token_ids=(EOS,), seed=i,
                                      repetition_penalty=1.2 if i % 3 == 0 else 1.0))
               for i in range(40)]
    batch = InputBatch()
    launched: deque[tuple[SchedulerOutput, list[BatchRow], list[SampledTokens]]] = deque()
    checked = 0
    for _ in range(3000):
        if pending and rng.random() < 0.4:
            s.add_request(pending.pop(0))
        if not (s.has_unfinished or pending or launched):
            break
        if s.running and rng.random() < 0.05:
            s.abort(rng.choice(s.running).request_id)
        ahead = bool(launched) and rng.random() < 0.5 and all(r.params.schedules_ahead for r in s.running)
        if launched and not ahead:
            out, rows, results = launched.popleft()
            collect(rows, results)
            s.update(out, results)
        out = s.schedule()
        if out.is_empty:
            s.update(out, [])
        else:
            rows, results = launch(batch, out, rng)
            assert kept(batch) == rebuilt(s)
            checked += 1
            launched.append((out, rows, results))
        if ahead:
            out, rows, results = launched.popleft()
            collect(rows, results)
            s.update(out, results)
    assert not s.has_unfinished and not pending and checked > 50
    assert s.num_preemptions > 0  # the pages ran short: rows were dropped and came back whole


def test_a_decode_row_after_the_first_carries_only_its_new_token_and_pages() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), KVCacheManager(16, 4, False), 64)
    s.add_request(Request("a", [5, 6, 7, 8], SamplingParams(max_tokens=8)))
    first = s.schedule()
    (new,) = first.requests
    assert new.is_new and list(new.page_ids) == list(s.kv_cache.pages("a")) and new.prompt_token_ids == [5, 6, 7, 8]
    s.update(first, [sampled(9)])
    second = s.schedule()
    (diff,) = second.requests
    assert not diff.is_new and diff.new_token_ids == [9] and list(diff.page_ids) == [s.kv_cache.pages("a")[-1]]
    s.update(second, [sampled(10)])
    (third,) = s.schedule().requests
    assert third.new_token_ids == [10] and not third.page_ids  # its last page has room


def test_a_row_is_rebuilt_from_a_new_row_that_reuses_its_id() -> None:
    batch = InputBatch()
    params = SamplingParams()
    batch.update(SchedulerOutput([ScheduledRequest("a", [1, 2], 0, [3], True, params, [1, 2])]))
    append_sampled([batch.rows["a"]], [7])
    (row,) = batch.update(SchedulerOutput([ScheduledRequest("a", [4], 0, [5], True, params, [4], [8])]))
    assert (list(row.prompt_token_ids), list(row.output_token_ids), list(row.page_ids)) == ([4], [8], [5])


def test_a_diff_for_a_request_without_a_row_is_refused() -> None:
    with pytest.raises(ValueError, match="no row"):
        InputBatch().update(SchedulerOutput([ScheduledRequest("a", [1], 3, (), True)]))
