"""Faults: a request whose sampling fails ends alone; a dead engine loop is a 503, never a hang."""

from __future__ import annotations

import asyncio
import json

import httpx

from production_helpers import (
    POISON_SEED, PoisonSampler, assert_openai_error, completion, serve_engine, wait_for,
)


async def stream_events(client: httpx.AsyncClient, body: dict) -> tuple[int, list]:
    """(status, events): the JSON payloads of a stream, "[DONE]" as is."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, [r.json()]
        events = [line[len("data: "):] async for line in r.aiter_lines() if line.startswith("data: ")]
    return 200, [e if e == "[DONE]" else json.loads(e) for e in events]


def run_beside_ten_streams(url: str, poisoned: dict) -> tuple[tuple[int, list], list[tuple[int, list]]]:
    async def main() -> tuple[tuple[int, list], list[tuple[int, list]]]:
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=None)) as c:
            normal = [stream_events(c, completion(30, stream=True, seed=i)) for i in range(10)]
            bad, *others = await asyncio.gather(stream_events(c, poisoned), *normal)
        return bad, others

    return asyncio.run(main())


def assert_complete(streams: list[tuple[int, list]], num_tokens: int) -> None:
    for status, events in streams:
        assert status == 200 and events[-1] == "[DONE]"
        chunks = events[:-1]
        assert len(chunks) == num_tokens + 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_sampling_failing_mid_stream_ends_that_stream_with_an_error_event_while_ten_complete() -> None:
    with serve_engine(sampler=PoisonSampler(fail_after=3), delay=0.005) as stack:
        (status, events), others = run_beside_ten_streams(stack.url, completion(30, stream=True, seed=POISON_SEED))
        assert status == 200 and events[-1] == "[DONE]"
        assert len(events) == 3 + 2  # three tokens, the error event, [DONE]
        error = events[-2]["error"]
        assert error["type"] == "server_error" and "injected sampling fault" in error["message"]
        assert_complete(others, 30)
        assert httpx.get(f"{stack.url}/health").status_code == 200
        capacity = stack.llm.scheduler.kv_cache.capacity
        wait_for(lambda: stack.metric("flashserve_kv_pages_free") == capacity, 2, "every page free")
        assert stack.metric("flashserve_requests_finished_total", finish_reason="error") == 1
        assert stack.metric("flashserve_request_errors_total", type="server_error", code="") == 1


def test_sampling_failing_before_the_first_token_is_a_500_while_ten_streams_complete() -> None:
    with serve_engine(sampler=PoisonSampler(fail_after=0), delay=0.005) as stack:
        (status, events), others = run_beside_ten_streams(stack.url, completion(30, stream=True, seed=POISON_SEED))
        assert status == 500 and events[0]["error"]["type"] == "server_error"
        assert_complete(others, 30)
        r = httpx.post(f"{stack.url}/v1/completions", json=completion(30, seed=POISON_SEED))
        assert_openai_error(r, 500)
        assert httpx.post(f"{stack.url}/v1/completions", json=completion(3)).status_code == 200


def test_a_dead_engine_loop_makes_health_and_new_requests_503_without_hanging() -> None:
    with serve_engine(fail_forward=RuntimeError("device lost")) as stack:
        with httpx.Client(base_url=stack.url, timeout=5) as client:  # a hang fails on the timeout
            r = client.post("/v1/completions", json=completion(5))
            assert_openai_error(r, 503, "engine_dead")
            assert "device lost" in r.json()["error"]["message"]
            assert_openai_error(client.get("/health"), 503, "engine_dead")
            assert_openai_error(client.post("/v1/completions", json=completion(5, stream=True)), 503, "engine_dead")
