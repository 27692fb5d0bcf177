"""The server process on the GPU (dummy Llama-3.2-1B weights, token-id prompts), over plain HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from live_server import live_server

MODEL = "llama-3.2-1b"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    args = ["--model", MODEL, "--load-format", "dummy", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "32"]
    with live_server(args, timeout_s=300) as (base, _proc):
        yield base


def complete(base: str, **body) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "ignore_eos": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


async def stream(c: httpx.AsyncClient, **body) -> list[dict]:
    """The `data:` events of a streamed completion, [DONE] excluded (asserted last)."""
    events = []
    body = {"model": MODEL, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **body}
    async with c.stream("POST", "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_token_id_completion_reports_usage(server):
    resp = complete(server, prompt=list(range(100, 164)), max_tokens=12, temperature=0)
    assert resp["usage"]["prompt_tokens"] == 64 and resp["usage"]["completion_tokens"] == 12
    assert resp["choices"][0]["finish_reason"] == "length"


def test_streaming_completion_ends_with_usage_and_done(server):
    async def main():
        async with httpx.AsyncClient(base_url=server) as c:
            return await stream(c, prompt=[5, 6, 7], max_tokens=10, temperature=0.8, seed=3)

    chunks = asyncio.run(main())
    assert chunks[-1]["usage"]["completion_tokens"] == 10 and chunks[-1]["choices"] == []
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_sixteen_concurrent_streams_and_a_bad_request(server):
    async def main():
        async with httpx.AsyncClient(base_url=server) as c:
            streams = [stream(c, prompt=[i + 1] * (20 + 10 * i), max_tokens=32, temperature=0.7, seed=i)
                       for i in range(16)]
            bad = c.post("/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": -1})
            return await asyncio.gather(*streams, bad)

    *results, bad = asyncio.run(main())
    assert [r[-1]["usage"]["completion_tokens"] for r in results] == [32] * 16
    assert bad.status_code == 400 and "error" in bad.json()
    assert httpx.get(f"{server}/health").status_code == 200
