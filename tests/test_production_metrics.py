"""GET /metrics (Prometheus) and the one log line per finished request."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import pytest

from fake_engine import FakeEngine, api_client, post
from flashserve.api.options import APIOptions
from flashserve.api.server import build_app
from flashserve.metrics import Metrics
from production_helpers import MODEL, completion, metric, serve_engine, wait_for


def test_metrics_count_tokens_latencies_and_finish_reasons_of_served_requests() -> None:
    with serve_engine() as stack:
        for prompt_len in (3, 20, 40):
            r = httpx.post(f"{stack.url}/v1/completions", json=completion(5, prompt=[1] * prompt_len))
            assert r.status_code == 200, r.text
        text = httpx.get(f"{stack.url}/metrics").text
        capacity = stack.llm.scheduler.kv_cache.capacity
    assert metric(text, "flashserve_prompt_tokens_total") == 63
    assert metric(text, "flashserve_generation_tokens_total") == 15
    assert metric(text, "flashserve_requests_finished_total", finish_reason="length") == 3
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert metric(text, f"flashserve_{histogram}_seconds_count") == 3
    assert metric(text, "flashserve_inter_token_latency_seconds_count") == 3 * 4
    assert metric(text, "flashserve_kv_pages_free") == capacity
    assert metric(text, "flashserve_kv_pages_used") == 0
    assert metric(text, "flashserve_num_requests_running") == 0
    assert metric(text, "flashserve_num_preemptions_total") == 0


def test_queue_times_of_concurrent_requests_that_wake_an_idle_server_are_not_below_zero() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with serve_engine() as stack:
        time.sleep(0.2)  # the engine loop waits for work, idle
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(lambda _: httpx.post(f"{stack.url}/v1/completions", json=completion(3)).status_code,
                                     range(4)))
        text = httpx.get(f"{stack.url}/metrics").text
    assert statuses == [200] * 4
    for name in ("flashserve_request_queue_time_seconds", "vllm:request_queue_time_seconds"):
        assert metric(text, f"{name}_count") == 4
        assert metric(text, f"{name}_sum") >= 0


def test_metrics_count_errors_by_openai_type() -> None:
    with serve_engine() as stack:
        httpx.post(f"{stack.url}/v1/completions", json=completion(-1))
        httpx.post(f"{stack.url}/v1/completions", json={**completion(1), "model": "nope"})
        text = httpx.get(f"{stack.url}/metrics").text
    assert metric(text, "flashserve_request_errors_total", type="invalid_request_error", code="") == 1
    assert metric(text, "flashserve_request_errors_total", type="invalid_request_error", code="model_not_found") == 1


def test_each_app_has_its_own_registry() -> None:
    first, second = Metrics(), Metrics()
    first.generation_tokens.inc(5)
    assert metric(second.render().decode(), "flashserve_generation_tokens_total") == 0


def test_disconnecting_twenty_streams_frees_their_pages_within_a_second_while_another_completes() -> None:
    async def leave_after_first_chunk(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json=completion(2000, stream=True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection mid-generation

    async def normal(client: httpx.AsyncClient) -> tuple[list[str], float]:
        start = time.monotonic()
        async with client.stream("POST", "/v1/completions", json=completion(80, stream=True)) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        return lines, time.monotonic() - start

    async def seconds_until_only_one_runs(client: httpx.AsyncClient) -> float:
        start = time.monotonic()
        while metric((await client.get("/metrics")).text, "flashserve_num_requests_running") != 1:
            assert time.monotonic() - start < 5, "the disconnected streams are still running"
            await asyncio.sleep(0.01)
        return time.monotonic() - start

    async def main(url: str) -> tuple[float, list[str], float]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            other = asyncio.ensure_future(normal(client))
            await asyncio.gather(*[leave_after_first_chunk(client) for _ in range(20)])
            gone_after = await seconds_until_only_one_runs(client)
            assert not other.done(), "the normal stream should still be running"
            return gone_after, *(await other)

    with serve_engine(delay=0.02) as stack:
        capacity = stack.llm.scheduler.kv_cache.capacity
        gone_after, lines, seconds = asyncio.run(main(stack.url))
        wait_for(lambda: stack.metric("flashserve_num_requests_running") == 0, 1.0)
        assert stack.metric("flashserve_kv_pages_free") == capacity
        assert stack.metric("flashserve_requests_finished_total", finish_reason="abort") == 20
    assert gone_after < 1.0
    assert lines[-1] == "data: [DONE]" and len(lines) == 80 + 2  # 80 tokens, the finish chunk, [DONE]
    assert seconds < 80 * 0.02 * 3  # not slowed down: a few steps' delay per token at most


def test_aborted_streams_are_gone_from_the_metrics_within_a_second() -> None:
    with serve_engine(delay=0.02) as stack:
        capacity = stack.llm.scheduler.kv_cache.capacity
        with httpx.Client(base_url=stack.url, timeout=10) as client:
            with client.stream("POST", "/v1/completions", json=completion(2000, stream=True)) as r:
                lines = r.iter_lines()  # held: a dropped iterator closes the connection
                next(lines)
                assert stack.metric("flashserve_kv_pages_used") > 0
        took = wait_for(lambda: stack.metric("flashserve_kv_pages_free") == capacity, 1.0, "pages freed")
    assert took < 1.0


# ---- the request log line -------------------------------------------------------------------------

SECRET = "zebra-platypus-quokka"


def request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flashserve.requests"]


@pytest.mark.anyio
async def test_a_finished_request_logs_one_line_with_tokens_timings_and_finish_reason(
    smollm2_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="flashserve.requests")
    r = await post(FakeEngine(), smollm2_tokenizer, "/v1/completions", {"prompt": f"say {SECRET}"})
    (line,) = request_lines(caplog)
    assert f"request {r.json()['id']} finished:" in line
    for field in ("prompt_tokens=", "completion_tokens=4", "ttft=", "latency=", "prompt_tokens_per_s=",
                  "generation_tokens_per_s=", "finish_reason=stop"):
        assert field in line, line
    assert SECRET not in caplog.text


@pytest.mark.anyio
async def test_log_requests_adds_the_prompt_to_the_log(smollm2_tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flashserve.requests")
    app = build_app(FakeEngine(), smollm2_tokenizer, [MODEL], 2048, options=APIOptions(log_requests=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": SECRET}]})
    assert SECRET in caplog.text and len(request_lines(caplog)) == 2


@pytest.mark.anyio
async def test_metrics_endpoint_needs_no_engine_state_to_render(smollm2_tokenizer: Any) -> None:
    async with api_client(FakeEngine(), smollm2_tokenizer) as client:
        r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "flashserve_time_to_first_token_seconds_bucket" in r.text


def test_buffered_observations_count_as_the_same_single_ones_once_flushed() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    from flashserve.metrics import ITL_BUCKETS, HistogramBuffer

    # A value in the first bucket, on a bound, in a middle one and past the last, some repeated.
    observations = [(0.0004, 1), (ITL_BUCKETS[3], 2), (0.02, 7), (1e9, 3)]
    one_by_one, buffered = CollectorRegistry(), CollectorRegistry()
    single = Histogram("h", "h", buckets=ITL_BUCKETS, registry=one_by_one)
    for value, count in observations:
        for _ in range(count):
            single.observe(value)
    buffer = HistogramBuffer(Histogram("h", "h", buckets=ITL_BUCKETS, registry=buffered))
    for value, count in observations:
        buffer.observe(value, count)
    assert buffered.get_sample_value("h_count") == 0  # nothing is added before the flush
    buffer.flush()
    for bound in [*map(str, ITL_BUCKETS), "+Inf"]:
        labels = {"le": bound}
        expected = one_by_one.get_sample_value("h_bucket", labels)
        assert expected is not None and buffered.get_sample_value("h_bucket", labels) == expected
    assert buffered.get_sample_value("h_count") == one_by_one.get_sample_value("h_count") == 13
    assert buffered.get_sample_value("h_sum") == pytest.approx(one_by_one.get_sample_value("h_sum"), rel=1e-12)


def test_a_long_streams_token_gaps_reach_the_histogram_before_it_ends() -> None:
    from flashserve.metrics import ITL_FLUSH_TOKENS, Metrics, RequestRecord

    metrics = Metrics()
    record = RequestRecord(metrics, "r", num_prompt_tokens=3, num_choices=1)
    count = lambda: metrics.registry.get_sample_value("flashserve_inter_token_latency_seconds_count")  # noqa: E731
    for n in range(1, ITL_FLUSH_TOKENS + 2):  # the first token has no gap before it
        record.tokens(0, 1, n)
    assert count() == ITL_FLUSH_TOKENS  # added while the stream runs, not only at its end
    record.tokens(0, 1, ITL_FLUSH_TOKENS + 2)
    record.close()
    assert count() == ITL_FLUSH_TOKENS + 1
