"""/v1/responses and /v1/messages over a fake engine: what they hand the engine, and how they end
when the engine fails."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fake_engine import MODEL, FakeEngine, post

pytestmark = pytest.mark.anyio


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


async def test_responses_hand_the_engine_the_chat_sampling_params(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                                                         "temperature": 0.5, "top_p": 0.9})
    assert r.status_code == 200
    (params,) = engine.params.values()
    assert (params.max_tokens, params.temperature, params.top_p) == (3, 0.5, 0.9)
    assert r.json()["output"][0]["content"][0]["text"] == "Hello, world"
    assert r.json()["status"] == "incomplete"


async def test_messages_hand_the_engine_max_tokens_and_stop_sequences(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/messages", {"model": MODEL, "max_tokens": 2, "stop_sequences": ["!"],
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    (params,) = engine.params.values()
    assert (params.max_tokens, params.stop) == (2, ("!",))
    assert r.json()["stop_reason"] == "max_tokens" and r.json()["content"] == [{"type": "text", "text": "Hello,"}]


async def test_a_responses_stream_that_fails_ends_failed_and_frees_the_request(tokenizer: Any) -> None:
    engine = FakeEngine(error_after=2)
    r = await post(engine, tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi", "stream": True})
    events = sse_events(r.text)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["message"] == "boom"
    assert engine.request_ids and set(engine.request_ids) <= set(engine.finished + engine.closed)


async def test_a_messages_stream_that_fails_ends_with_an_anthropic_error_event(tokenizer: Any) -> None:
    engine = FakeEngine(error_after=2)
    r = await post(engine, tokenizer, "/v1/messages", {"model": MODEL, "max_tokens": 8, "stream": True,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    last = sse_events(r.text)[-1]
    assert last == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


async def test_a_dead_engine_is_a_503_in_each_apis_shape(tokenizer: Any) -> None:
    r = await post(FakeEngine(dead=True), tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = await post(FakeEngine(dead=True), tokenizer, "/v1/messages",
                   {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 503 and r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"


async def test_a_bad_text_format_is_a_400_naming_the_responses_field(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/responses",
                   {"model": MODEL, "input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"


async def test_a_bad_max_output_tokens_is_a_400_naming_the_responses_field(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
