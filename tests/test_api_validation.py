"""Mistakes real clients make, each answered with a 400 or 404 that names what is wrong, over a fake
engine: tool results that answer no call, bad token ids in a prompt, an empty body, endpoints this
server does not serve, and too many or too long stop strings."""

from __future__ import annotations

from typing import Any

import pytest

from fake_engine import MODEL, FakeEngine, api_client, post
from flashserve.api.request_checks import MAX_STOP_CHARS, MAX_STOP_STRINGS
from production_helpers import assert_openai_error

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "Hi"}]
JSON = {"content-type": "application/json"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}


def output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "rain"}


# ---- a tool result must answer a call ------------------------------------------------------------


async def test_a_function_call_output_answering_no_call_is_a_400_naming_the_call_id(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/responses", {"model": MODEL, "input": [*HI, CALL, output("call_2")]})
    error = assert_openai_error(r, 400)
    assert error["param"] == "input" and "call_2" in error["message"] and "input[2]" in error["message"]
    assert engine.request_ids == []


async def test_a_function_call_output_may_answer_a_call_of_the_previous_response(tokenizer: Any) -> None:
    async with api_client(FakeEngine(), tokenizer) as client:
        first = await client.post("/v1/responses", json={"model": MODEL, "input": [*HI, CALL]})
        r = await client.post("/v1/responses", json={"model": MODEL, "input": [output("call_1")],
                                                     "previous_response_id": first.json()["id"]})
    assert r.status_code == 200, r.text


async def test_a_function_call_output_answering_no_call_of_the_previous_response_is_a_400(tokenizer: Any) -> None:
    async with api_client(FakeEngine(), tokenizer) as client:
        first = await client.post("/v1/responses", json={"model": MODEL, "input": [*HI, CALL]})
        r = await client.post("/v1/responses", json={"model": MODEL, "input": [output("call_9")],
                                                     "previous_response_id": first.json()["id"]})
    error = assert_openai_error(r, 400)
    assert error["param"] == "input" and "call_9" in error["message"] and "input[0]" in error["message"]


async def test_a_tool_result_answering_no_tool_use_is_a_400_naming_the_id(tokenizer: Any) -> None:
    engine = FakeEngine()
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_2", "content": "rain"}
    r = await post(engine, tokenizer, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
        *HI, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "toolu_2" in r.json()["error"]["message"] and "messages[2].content[0]" in r.json()["error"]["message"]
    assert engine.request_ids == []


# ---- errors that name what is wrong --------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "named"), [
    ("[-1]", ["token id -1 at index 0", "negative"]),
    ("[5, 1180591620717411303424]", ["token id 1180591620717411303424 at index 1", "out of range"]),
    ("[[1, 2], [3, -4]]", ["token id -4 at index 1 of prompt[1]", "negative"]),
    ("[1, 2.5]", ["token id 2.5 at index 1", "not an integer"]),
])
async def test_a_bad_token_id_in_a_prompt_is_a_400_naming_the_id_and_why(prompt: str, named: list[str]) -> None:
    async with api_client(FakeEngine(), None) as client:
        r = await client.post("/v1/completions", content=f'{{"model": "{MODEL}", "prompt": {prompt}}}', headers=JSON)
    error = assert_openai_error(r, 400)
    assert error["param"] == "prompt"
    assert all(part in error["message"] for part in named), error["message"]


@pytest.mark.parametrize(("path", "field"), [
    ("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"), ("/v1/responses", "input"),
])
async def test_an_empty_body_is_a_400_naming_the_required_field(path: str, field: str) -> None:
    async with api_client(FakeEngine(), None) as client:
        r = await client.post(path, content=b"", headers=JSON)
    error = assert_openai_error(r, 400)
    assert error["param"] == field and field in error["message"] and "empty" in error["message"]


@pytest.mark.parametrize(("path", "what"), [
    ("/v1/embeddings", "embeddings"), ("/embeddings", "embeddings"), ("/v1/audio/transcriptions", "audio"),
    ("/v1/images/generations", "images"), ("/v2/rerank", "reranking"),
])
async def test_an_endpoint_this_server_does_not_serve_is_a_404_saying_so(path: str, what: str) -> None:
    async with api_client(FakeEngine(), None) as client:
        r = await client.post(path, json={"model": MODEL, "input": "Hi"})
    error = assert_openai_error(r, 404, "unsupported_endpoint")
    assert f"does not serve {what}" in error["message"] and "/v1/chat/completions" in error["message"]


async def test_an_unknown_path_is_still_a_plain_404() -> None:
    async with api_client(FakeEngine(), None) as client:
        r = await client.post("/v1/embedding-typo", json={})
    assert assert_openai_error(r, 404)["code"] is None


# ---- a bound on stop strings ---------------------------------------------------------------------


def chat_or_completion(path: str, **fields: Any) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"model": MODEL, "messages": HI, **fields}
    return {"model": MODEL, "prompt": "Hi", **fields}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_more_stop_strings_than_the_limit_is_a_400_naming_stop(tokenizer: Any, path: str) -> None:
    engine = FakeEngine()
    stop = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    error = assert_openai_error(await post(engine, tokenizer, path, chat_or_completion(path, stop=stop)), 400)
    assert error["param"] == "stop" and f"at most {MAX_STOP_STRINGS}" in error["message"]
    assert engine.request_ids == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stop_strings_up_to_the_limit_reach_the_engine(tokenizer: Any, path: str) -> None:
    engine = FakeEngine()
    stop = [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["x" * MAX_STOP_CHARS]
    r = await post(engine, tokenizer, path, chat_or_completion(path, stop=stop))
    assert r.status_code == 200, r.text
    (params,) = engine.params.values()
    assert params.stop == tuple(stop)


async def test_a_stop_string_longer_than_the_limit_is_a_400_naming_stop(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/completions", chat_or_completion("/v1/completions",
                                                                                  stop="x" * (MAX_STOP_CHARS + 1)))
    error = assert_openai_error(r, 400)
    assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"]


async def test_more_stop_sequences_than_the_limit_is_a_400_naming_stop_sequences(tokenizer: Any) -> None:
    stop = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    r = await post(FakeEngine(), tokenizer, "/v1/messages",
                   {"model": MODEL, "max_tokens": 4, "messages": HI, "stop_sequences": stop})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "stop_sequences" in r.json()["error"]["message"]
