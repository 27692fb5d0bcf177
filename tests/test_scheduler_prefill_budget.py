"""The prefill-only budget: a step that no running stream waits on may take a whole prompt; as soon
as a stream is running, steps go back to the step budget."""

from __future__ import annotations

from test_scheduler import fixed_token, req, step

from flashserve.config import SchedulerConfig
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager


def make(prefill_only: int | None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, prefill_only_budget=prefill_only)
    return Scheduler(config, KVCacheManager(64, 16, False), 4096)


def test_a_lone_prompt_prefills_in_one_step_under_the_prefill_only_budget() -> None:
    s = make(prefill_only=512)
    s.add_request(req("long", prompt_len=300))
    out, _ = step(s)
    assert out.num_batched_tokens == 300 and out.requests[0].sample


def test_without_a_prefill_only_budget_a_lone_prompt_is_chunked() -> None:
    s = make(prefill_only=None)
    s.add_request(req("long", prompt_len=300))
    out, _ = step(s)
    assert out.num_batched_tokens == 32


def test_a_running_stream_keeps_steps_at_the_step_budget() -> None:
    s = make(prefill_only=512)
    s.add_request(req("stream", prompt_len=8, max_tokens=100))
    step(s)  # the stream has its first token
    s.add_request(req("long", prompt_len=300))
    out, _ = step(s, fixed_token)
    assert out.num_batched_tokens == 32  # 1 decode token + a 31-token chunk
    assert {r.request_id: r.num_new_tokens for r in out.requests} == {"stream": 1, "long": 31}


def test_two_prompts_arriving_together_share_one_prefill_only_step() -> None:
    s = make(prefill_only=512)
    s.add_request(req("a", prompt_len=200))
    s.add_request(req("b", prompt_len=200))
    out, _ = step(s)
    assert out.num_batched_tokens == 400
