"""The prefill-only budget: a step that no running stream waits on may take a whole prompt; as soon
as a stream is running, steps go back to the step budget. `max_prefill_tokens`: prompts that
arrive together start in turn once together they pass it."""

from __future__ import annotations

from test_scheduler import fixed_token, req, step

from flashserve.config import SchedulerConfig
from flashserve.engine.outputs import SchedulerOutput
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.worker.step_budget import default_max_prefill_tokens


def scheduler(**config: object) -> Scheduler:
    """A scheduler of 8 sequences over 64 pages of 16 tokens, with `config`'s budgets."""
    return Scheduler(SchedulerConfig(max_num_seqs=8, **config), KVCacheManager(64, 16, False), 4096)  # type: ignore[arg-type]


def new_tokens(out: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's new tokens in the step `out`."""
    return {r.request_id: r.num_new_tokens for r in out.requests}


def with_a_stream(s: Scheduler) -> Scheduler:
    """`s` once a stream has its first token (it decodes in every later step)."""
    s.add_request(req("stream", prompt_len=8, max_tokens=100))
    step(s)
    return s


def make(prefill_only: int | None) -> Scheduler:
    return scheduler(max_num_batched_tokens=32, prefill_only_budget=prefill_only)


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
    assert new_tokens(out) == {"stream": 1, "long": 31}


def test_two_prompts_arriving_together_share_one_prefill_only_step() -> None:
    s = make(prefill_only=512)
    s.add_request(req("a", prompt_len=200))
    s.add_request(req("b", prompt_len=200))
    out, _ = step(s)
    assert out.num_batched_tokens == 400


def capped(max_prefill: int) -> Scheduler:
    return scheduler(max_num_batched_tokens=512, max_prefill_tokens=max_prefill)


def test_prompts_arriving_together_start_in_turn_when_together_they_pass_max_prefill_tokens() -> None:
    s = capped(max_prefill=256)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, prompt_len=200))
    steps = [new_tokens(step(s)[0]) for _ in range(3)]
    assert steps == [{"a": 200}, {"a": 1, "b": 200}, {"a": 1, "b": 1, "c": 200}]


def test_short_prompts_share_a_step_up_to_max_prefill_tokens() -> None:
    s = capped(max_prefill=256)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, prompt_len=100))
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["a", "b"]


def test_a_prompt_alone_takes_the_whole_step_budget_beyond_max_prefill_tokens() -> None:
    s = capped(max_prefill=256)
    s.add_request(req("long", prompt_len=500))
    out, _ = step(s)
    assert out.num_batched_tokens == 500


def test_a_running_prompts_chunk_holds_later_prompts_back_past_max_prefill_tokens() -> None:
    s = scheduler(max_num_batched_tokens=256, max_prefill_tokens=32)
    s.add_request(req("long", prompt_len=300))
    step(s)  # its first chunk: 256 tokens
    s.add_request(req("short", prompt_len=8))
    out, _ = step(s)
    assert new_tokens(out) == {"long": 44}


def test_max_prefill_tokens_defaults_to_2048_on_a_gpu_and_no_bound_on_a_cpu() -> None:
    assert (default_max_prefill_tokens("cuda"), default_max_prefill_tokens("cpu")) == (2048, 0)


def test_max_prefill_tokens_zero_admits_while_the_step_budget_lasts() -> None:
    s = capped(max_prefill=0)
    for rid in ("a", "b"):
        s.add_request(req(rid, prompt_len=200))
    out, _ = step(s)
    assert out.num_batched_tokens == 400


def test_a_negative_max_prefill_tokens_is_refused_with_its_name() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_prefill_tokens"):
        SchedulerConfig(max_prefill_tokens=-1)


def chunked(size: int) -> Scheduler:
    return scheduler(max_num_batched_tokens=512, chunked_prefill_size=size)


def test_while_a_stream_decodes_a_long_prompt_is_chunked_at_chunked_prefill_size() -> None:
    s = with_a_stream(chunked(size=64))
    s.add_request(req("long", prompt_len=150))
    chunks = [new_tokens(step(s)[0]) for _ in range(3)]
    assert chunks == [{"stream": 1, "long": 64}, {"stream": 1, "long": 64}, {"stream": 1, "long": 22}]


def test_prompts_queued_behind_a_stream_share_chunked_prefill_size_first_come_first_served() -> None:
    s = with_a_stream(chunked(size=64))
    for rid in ("a", "b"):
        s.add_request(req(rid, prompt_len=40))
    first, _ = step(s)
    second, _ = step(s)
    assert new_tokens(first) == {"stream": 1, "a": 40, "b": 24}
    assert new_tokens(second) == {"stream": 1, "a": 1, "b": 16}


def test_a_prompt_that_no_stream_waits_on_is_not_bounded_by_chunked_prefill_size() -> None:
    s = chunked(size=64)
    s.add_request(req("long", prompt_len=300))
    out, _ = step(s)
    assert out.num_batched_tokens == 300


def test_chunked_prefill_size_zero_leaves_a_streams_step_to_the_step_budget() -> None:
    s = with_a_stream(chunked(size=0))
    s.add_request(req("long", prompt_len=300))
    out, _ = step(s)
    assert new_tokens(out) == {"stream": 1, "long": 300}


def test_a_negative_chunked_prefill_size_is_refused_with_its_name() -> None:
    import pytest

    with pytest.raises(ValueError, match="chunked_prefill_size"):
        SchedulerConfig(chunked_prefill_size=-1)
