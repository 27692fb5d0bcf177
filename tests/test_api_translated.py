"""/v1/responses and /v1/messages over a fake engine: what they hand the engine, how they end when
the engine fails, and requests generated from their schemas (no 5xx, every error in its API's shape)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from fake_engine import MODEL, FakeEngine, post
from flashserve.api.server import build_app


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.anyio
async def test_responses_hand_the_engine_the_chat_sampling_params(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                                                         "temperature": 0.5, "top_p": 0.9})
    assert r.status_code == 200
    (params,) = engine.params.values()
    assert (params.max_tokens, params.temperature, params.top_p) == (3, 0.5, 0.9)
    assert r.json()["output"][0]["content"][0]["text"] == "Hello, world"
    assert r.json()["status"] == "incomplete"


@pytest.mark.anyio
async def test_messages_hand_the_engine_max_tokens_and_stop_sequences(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/messages", {"model": MODEL, "max_tokens": 2, "stop_sequences": ["!"],
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    (params,) = engine.params.values()
    assert (params.max_tokens, params.stop) == (2, ("!",))
    assert r.json()["stop_reason"] == "max_tokens" and r.json()["content"] == [{"type": "text", "text": "Hello,"}]


def one_call_grammar(engine: FakeEngine) -> bool:
    (params,) = engine.params.values()
    return json.loads(params.grammar.spec.value).get("maxItems") == 1


@pytest.mark.anyio
async def test_responses_parallel_tool_calls_false_asks_for_one_call(tokenizer: Any) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi", "tools": [tool],
                                                         "tool_choice": "required", "parallel_tool_calls": False})
    assert r.status_code == 200 and r.json()["parallel_tool_calls"] is False and one_call_grammar(engine)


@pytest.mark.anyio
async def test_messages_disable_parallel_tool_use_asks_for_one_call(tokenizer: Any) -> None:
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/messages", {
        "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "tools": [tool],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert r.status_code == 200 and one_call_grammar(engine)


@pytest.mark.anyio
async def test_a_responses_stream_that_fails_ends_failed_and_frees_the_request(tokenizer: Any) -> None:
    engine = FakeEngine(error_after=2)
    r = await post(engine, tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi", "stream": True})
    events = sse_events(r.text)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["message"] == "boom"
    assert engine.request_ids and set(engine.request_ids) <= set(engine.finished + engine.closed)


@pytest.mark.anyio
async def test_a_messages_stream_that_fails_ends_with_an_anthropic_error_event(tokenizer: Any) -> None:
    engine = FakeEngine(error_after=2)
    r = await post(engine, tokenizer, "/v1/messages", {"model": MODEL, "max_tokens": 8, "stream": True,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    last = sse_events(r.text)[-1]
    assert last == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


@pytest.mark.anyio
async def test_a_dead_engine_is_a_503_in_each_apis_shape(tokenizer: Any) -> None:
    r = await post(FakeEngine(dead=True), tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = await post(FakeEngine(dead=True), tokenizer, "/v1/messages",
                   {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 503 and r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"


@pytest.mark.anyio
async def test_a_bad_text_format_is_a_400_naming_the_responses_field(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/responses",
                   {"model": MODEL, "input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"


@pytest.mark.anyio
async def test_a_bad_max_output_tokens_is_a_400_naming_the_responses_field(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_generated_requests_get_no_server_error_and_errors_in_the_apis_shape(
    smollm2_tokenizer: Any, path: str, mode: GenerationMode
) -> None:
    app = build_app(FakeEngine(), smollm2_tokenizer, [MODEL], 2048)
    operation = schemathesis.openapi.from_asgi("/openapi.json", app)[path]["POST"]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case: Any) -> None:
        response = case.call()
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            body = response.json()
            error = body["error"]
            if path == "/v1/messages":
                assert body["type"] == "error" and set(error) == {"type", "message"} and error["message"]
            else:
                assert set(error) == {"message", "type", "param", "code"} and error["message"]

    check()
