"""The real server process on the embedded SmolLM2, driven by the official OpenAI client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from live_server import live_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with live_server() as (base, _proc):
        yield base


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_non_streaming_chat_gives_the_models_answer_and_usage(server):
    resp = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_chat_matches_non_streaming_and_reports_usage(server):
    c = client(server)
    messages = [{"role": "user", "content": "Name a colour of the rainbow."}]
    full = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_accepts_token_id_prompts(server):
    resp = client(server).completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=5, temperature=0)
    assert resp.usage.prompt_tokens == 3
    assert resp.usage.completion_tokens == 5
    assert resp.choices[0].finish_reason == "length"


def test_sixteen_concurrent_streams_complete_while_bad_requests_get_errors(server):
    async def stream_one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            max_tokens=32, temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
        text, usage = "", 0
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
            if ch.usage:
                usage = ch.usage.completion_tokens
        return text, usage

    async def bad_requests(base: str) -> list[int]:
        codes = []
        async with httpx.AsyncClient(base_url=base, timeout=60) as h:
            for body in (b"{not json", b'{"model": "%s", "messages": []}' % MODEL.encode(),
                         b'{"model": "%s", "prompt": "x", "max_tokens": -3}' % MODEL.encode(),
                         b'{"model": "nope", "prompt": "x"}'):
                path = "/v1/chat/completions" if b"messages" in body or b"not" in body else "/v1/completions"
                r = await h.post(path, content=body, headers={"Content-Type": "application/json"})
                assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
                codes.append(r.status_code)
        return codes

    async def main():
        # Closed here, on its own loop: left to the garbage collector, its pooled connections
        # would be closed later on another test's loop, failing that test.
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*[stream_one(c, i) for i in range(16)], bad_requests(server))

    *streams, codes = asyncio.run(main())
    assert codes == [400, 400, 400, 404]
    for text, usage in streams:
        assert text and usage > 0
    assert httpx.get(f"{server}/health").status_code == 200
