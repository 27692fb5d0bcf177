"""Overload: a bounded queue answers 503 with Retry-After; a request that waits too long ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from flashserve.api.options import APIOptions
from flashserve.client.async_engine import AsyncEngine
from production_helpers import Stack, assert_openai_error, completion, serve_engine, wait_for


@contextmanager
def long_streams(url: str, count: int) -> Iterator[None]:
    """`count` streams that generate until the block ends, each read past its first chunk in a
    thread of its own (a stream only starts once its request has been scheduled)."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=completion(4000, stream=True)) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def engine_counts(stack: Stack) -> tuple[float, float]:
    return stack.metric("flashserve_num_requests_running"), stack.metric("flashserve_num_requests_waiting")


def test_a_full_queue_answers_503_with_retry_after() -> None:
    with serve_engine(max_num_seqs=1, max_waiting=2, delay=0.01) as stack, ExitStack() as streams:
        streams.enter_context(long_streams(stack.url, 1))
        wait_for(lambda: engine_counts(stack) == (1, 0), 5, "one running")
        # Two more queue behind it: their responses start only once scheduled, so in threads.
        waiting = [threading.Thread(target=httpx.post, args=(f"{stack.url}/v1/completions",),
                                    kwargs={"json": completion(1), "timeout": 30}, daemon=True) for _ in range(2)]
        for t in waiting:
            t.start()
        wait_for(lambda: engine_counts(stack) == (1, 2), 5, "two waiting")
        r = httpx.post(f"{stack.url}/v1/completions", json=completion(1))
        assert_openai_error(r, 503, "queue_full")
        assert r.headers["retry-after"] == "1"
        streams.close()  # the long stream leaves; the two waiting ones run and finish
        for t in waiting:
            t.join(10)
        wait_for(lambda: engine_counts(stack) == (0, 0), 5, "the queue drained")
        assert httpx.post(f"{stack.url}/v1/completions", json=completion(1)).status_code == 200


def test_a_request_waiting_past_the_queue_timeout_ends_with_503_and_frees_everything() -> None:
    with serve_engine(max_num_seqs=1, queue_timeout=0.3, delay=0.01) as stack:
        capacity = stack.llm.scheduler.kv_cache.capacity
        with long_streams(stack.url, 1):
            wait_for(lambda: engine_counts(stack) == (1, 0), 5, "one running")
            r = httpx.post(f"{stack.url}/v1/completions", json=completion(5, prompt=[3] * 100), timeout=10)
            error = assert_openai_error(r, 503, "aborted")
            assert "waited more than 0.3 s" in error["message"] and r.headers["retry-after"] == "1"
            assert engine_counts(stack) == (1, 0)
        wait_for(lambda: stack.metric("flashserve_kv_pages_free") == capacity, 2, "every page free")
        assert stack.metric("flashserve_requests_finished_total", finish_reason="abort") == 2
        assert not stack.llm.has_unfinished


def test_a_streaming_request_that_times_out_in_the_queue_gets_503_before_any_chunk() -> None:
    with serve_engine(max_num_seqs=1, queue_timeout=0.2, delay=0.01) as stack, long_streams(stack.url, 1):
        wait_for(lambda: engine_counts(stack) == (1, 0), 5, "one running")
        r = httpx.post(f"{stack.url}/v1/completions", json=completion(5, stream=True), timeout=10)
        assert_openai_error(r, 503, "aborted")


@pytest.mark.parametrize("kw", [{"max_waiting": 0}, {"queue_timeout": 0.0}])
def test_engine_limits_must_be_positive(kw: dict) -> None:
    with pytest.raises(ValueError):
        AsyncEngine(None, 16, **kw)  # type: ignore[arg-type]


def test_a_request_of_more_sequences_than_the_limit_is_400() -> None:
    with serve_engine() as stack:
        r = httpx.post(f"{stack.url}/v1/completions", json=completion(1, prompt=[[1, 2]] * 3, n=100))
        error = assert_openai_error(r, 400, "too_many_sequences")
        assert error["param"] == "n" and "300" in error["message"] and "256" in error["message"]
        assert not stack.llm.has_unfinished


def test_the_sequence_limit_counts_prompts_too() -> None:
    with serve_engine(options=APIOptions(max_sequences_per_request=4)) as stack:
        r = httpx.post(f"{stack.url}/v1/completions", json=completion(1, prompt=[[1, 2]] * 5))
        assert assert_openai_error(r, 400, "too_many_sequences")["param"] == "prompt"
        assert httpx.post(f"{stack.url}/v1/completions", json=completion(1, prompt=[[1, 2]] * 4)).status_code == 200


def test_the_waiting_limit_counts_sequences_not_requests() -> None:
    with serve_engine(max_num_seqs=1, max_waiting=4, delay=0.01) as stack, long_streams(stack.url, 1):
        wait_for(lambda: engine_counts(stack) == (1, 0), 5, "one running")
        r = httpx.post(f"{stack.url}/v1/completions", json=completion(1, n=5), timeout=10)
        assert_openai_error(r, 503, "queue_full")
        wait_for(lambda: engine_counts(stack) == (1, 0), 5, "the refused request left nothing queued")


def test_a_request_that_fans_out_does_not_shut_a_small_one_out() -> None:
    with serve_engine(max_num_seqs=8, delay=0.005) as stack:
        t0 = time.monotonic()
        assert httpx.post(f"{stack.url}/v1/completions", json=completion(1), timeout=10).status_code == 200
        idle = time.monotonic() - t0
        big = threading.Thread(target=httpx.post, args=(f"{stack.url}/v1/completions",), daemon=True,
                               kwargs={"json": completion(50, prompt=[[1, 2, 3]] * 8, n=8), "timeout": 60})
        big.start()
        wait_for(lambda: engine_counts(stack)[0] == 4, 5, "the big request holds its share")
        t0 = time.monotonic()
        assert httpx.post(f"{stack.url}/v1/completions", json=completion(1), timeout=10).status_code == 200
        beside_big = time.monotonic() - t0
        # 64 sequences x 50 tokens at 4 at a time take about 4 s; the small request gets a free slot.
        assert big.is_alive(), "the big request should still be running"
        assert beside_big < idle + 1.0, (idle, beside_big)
        big.join(60)
