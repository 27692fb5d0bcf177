"""What real clients send, over a fake engine: the completions default of max_tokens, messages
OpenAI refuses, the developer role, tools shown to a model whose template cannot show them, and the
token ids of `return_token_ids` (always, without a tokenizer)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from fake_engine import SCRIPT, FakeEngine, api_client, ask, complete
from test_api_streaming import events, stream

pytestmark = pytest.mark.anyio

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def only_params(engine: FakeEngine):
    (params,) = engine.params.values()
    return params


def prompt_text(engine: FakeEngine, tokenizer: Any) -> str:
    (prompt,) = engine.prompts.values()
    return tokenizer.decode(prompt)


async def test_a_completion_without_max_tokens_gets_16(tokenizer: Any) -> None:
    engine = FakeEngine()
    assert (await complete(engine, tokenizer, prompt="Hi")).status_code == 200
    assert only_params(engine).max_tokens == 16


async def test_the_completion_default_shrinks_to_the_room_the_context_leaves(tokenizer: Any) -> None:
    engine = FakeEngine()
    assert (await complete(engine, tokenizer, max_model_len=10, prompt=[1] * 4)).status_code == 200
    assert only_params(engine).max_tokens == 6


async def test_a_chat_without_max_tokens_still_gets_the_rest_of_the_context(tokenizer: Any) -> None:
    engine = FakeEngine()
    assert (await ask(engine, tokenizer)).status_code == 200
    assert only_params(engine).max_tokens == 2048 - len(next(iter(engine.prompts.values())))


@pytest.mark.parametrize("message", [{"role": "user", "content": None}, {"role": "user"},
                                     {"role": "system"}, {"role": "tool", "tool_call_id": "c"}])
async def test_a_message_without_content_is_a_400(tokenizer: Any, message: dict) -> None:
    r = await ask(FakeEngine(), tokenizer, messages=[message])
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error"
    assert "needs content" in error["message"] and error["param"].startswith("messages.0")


async def test_an_assistant_message_with_calls_needs_no_content(tokenizer: Any) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]
    assert (await ask(FakeEngine(), tokenizer, messages=messages)).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_lone_surrogate_is_a_400_that_says_so(tokenizer: Any, path: str) -> None:
    body = (b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}' if "chat" in path
            else b'{"prompt": "hi \\ud83d"}')
    async with api_client(FakeEngine(), tokenizer) as client:
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error"
    assert "lone UTF-16 surrogate (\\ud83d)" in error["message"] and "encode" not in error["message"]


async def test_the_developer_role_is_rendered_as_system(tokenizer: Any) -> None:
    prompts = []
    for role in ("developer", "system"):
        engine = FakeEngine()
        await ask(engine, tokenizer, messages=[{"role": role, "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}])
        prompts.append(prompt_text(engine, tokenizer))
    assert prompts[0] == prompts[1]


async def test_tools_reach_a_model_whose_template_cannot_show_them(tokenizer: Any) -> None:
    engine = FakeEngine()
    assert (await ask(engine, tokenizer, tools=[WEATHER])).status_code == 200  # tool_choice auto
    text = prompt_text(engine, tokenizer)
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert only_params(engine).grammar is not None  # plain text or a call of get_weather


async def test_an_earlier_call_and_its_result_reach_the_model_as_text(tokenizer: Any) -> None:
    engine = FakeEngine()
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "3 C and snow"}]
    await ask(engine, tokenizer, messages=messages, tools=[WEATHER])
    text = prompt_text(engine, tokenizer)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\n3 C and snow\n</tool_response>" in text


async def test_return_token_ids_gives_the_prompt_and_output_ids_of_a_completion(tokenizer: Any) -> None:
    r = await complete(FakeEngine(), tokenizer, prompt=[7, 8, 9], max_tokens=3, return_token_ids=True)
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == [7, 8, 9] and choice["token_ids"] == [t for t, _ in SCRIPT[:3]]


async def test_return_token_ids_in_chat_gives_the_prompt_on_the_response(tokenizer: Any) -> None:
    engine = FakeEngine()
    body = (await ask(engine, tokenizer, max_tokens=2, return_token_ids=True)).json()
    assert body["prompt_token_ids"] == next(iter(engine.prompts.values()))
    assert body["choices"][0]["token_ids"] == [t for t, _ in SCRIPT[:2]]


async def test_without_return_token_ids_no_id_fields_appear(tokenizer: Any) -> None:
    body = (await complete(FakeEngine(), tokenizer, prompt="Hi", max_tokens=2)).json()
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]


async def test_a_server_without_a_tokenizer_returns_the_generated_ids() -> None:
    body = (await complete(FakeEngine(), None, prompt=[7, 8], max_tokens=3)).json()
    assert body["choices"][0]["token_ids"] == [t for t, _ in SCRIPT[:3]]


async def test_a_stream_without_a_tokenizer_carries_each_tokens_id_and_the_prompt_once() -> None:
    chunks = events(await stream(FakeEngine(), None, "/v1/completions", {"prompt": [7, 8], "max_tokens": 3}))
    choices = [c["choices"][0] for c in chunks]
    assert [c.get("token_ids") for c in choices] == [[t] for t, _ in SCRIPT[:3]] + [None]
    assert [c.get("prompt_token_ids") for c in choices[:2]] == [[7, 8], None]


async def test_a_streamed_chat_with_return_token_ids_sends_the_prompt_first_and_ids_per_chunk(tokenizer: Any) -> None:
    chunks = events(await stream(FakeEngine(), tokenizer, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                  "return_token_ids": True}))
    assert chunks[0]["prompt_token_ids"] and "prompt_token_ids" not in chunks[1]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == [t for t, _ in SCRIPT[:2]]


RESULT_CONVERSATION = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "3 C and snow"}]


async def test_after_a_tool_result_the_model_is_asked_to_answer_in_auto_mode(tokenizer: Any) -> None:
    engine = FakeEngine()
    await ask(engine, tokenizer, messages=RESULT_CONVERSATION, tools=[WEATHER])
    assert prompt_text(engine, tokenizer).endswith(
        "<|im_start|>tool\n<tool_response>\n3 C and snow\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nUse this result to answer my question in one sentence.<|im_end|>\n"
        "<|im_start|>assistant\n")


async def test_a_forced_call_after_a_tool_result_is_not_asked_for_an_answer(tokenizer: Any) -> None:
    engine = FakeEngine()
    await ask(engine, tokenizer, messages=RESULT_CONVERSATION, tools=[WEATHER], tool_choice="required")
    assert "answer my question" not in prompt_text(engine, tokenizer)


TWO_CALLS = [(200, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'),
             (201, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')]


@pytest.mark.parametrize("streamed", [False, True])
async def test_parallel_tool_calls_false_ends_an_auto_output_after_the_first_call(
        tokenizer: Any, streamed: bool) -> None:
    fields = dict(tools=[WEATHER], parallel_tool_calls=False)
    if streamed:
        chunks = events(await stream(FakeEngine(TWO_CALLS), tokenizer, "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "Hi"}], **fields}))
        deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
        calls = [(d["function"]["name"], d["function"]["arguments"]) for d in deltas if "id" in d]
        arguments = "".join(d["function"]["arguments"] for d in deltas)
        assert {d["index"] for d in deltas} == {0} and json.loads(arguments) == {"city": "Oslo"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        choice = (await ask(FakeEngine(TWO_CALLS), tokenizer, **fields)).json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        assert calls == [("get_weather", '{"city": "Oslo"}')] and choice["finish_reason"] == "tool_calls"
    assert len(calls) == 1


@pytest.mark.parametrize("choice, one_call", [
    ("required", lambda spec: json.loads(spec.value)["maxItems"] == 1),
    ("auto", lambda spec: json.loads(spec.value)["format"]["stop_after_first"] is True)])
async def test_parallel_tool_calls_false_asks_the_grammar_for_one_call(tokenizer: Any, choice: str, one_call) -> None:
    engine = FakeEngine()
    assert (await ask(engine, tokenizer, tools=[WEATHER], tool_choice=choice,
                      parallel_tool_calls=False)).status_code == 200
    assert one_call(only_params(engine).grammar.spec)


async def test_parallel_tool_calls_must_be_a_boolean(tokenizer: Any) -> None:
    r = await ask(FakeEngine(), tokenizer, tools=[WEATHER], parallel_tool_calls="no")
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls"
