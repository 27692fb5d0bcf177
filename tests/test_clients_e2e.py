"""What real clients do, through the real server on the embedded SmolLM2 (whose chat template
renders no tools): the `openai` client, LangChain and LiteLLM with tools in `auto` mode (their
default), a two-turn tool loop, a forced call cut by max_tokens, emoji and CJK in logprobs and echo,
token ids, the completions default, and schema outputs with numbers that finish."""

from __future__ import annotations

import json
from typing import Annotated, Any

import httpx
import pytest
from pydantic import BaseModel, Field

from test_server_e2e import MODEL, client, server  # noqa: F401 - `server` is this module's fixture too

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ROME_CALL = {"id": "call_rome", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}}
# An agent's conversation after one call: the 135M model then calls the tool itself (on a first
# question it answers in plain text).
HISTORY = [{"role": "user", "content": "What is the weather in Rome?"},
           {"role": "assistant", "content": None, "tool_calls": [ROME_CALL]},
           {"role": "tool", "tool_call_id": "call_rome", "content": "21 C, sunny"},
           {"role": "assistant", "content": "It is 21 C and sunny in Rome."}]
ASK_WEATHER = [*HISTORY, {"role": "user", "content": "What is the weather in Paris?"}]


def reassemble(stream: Any) -> tuple[str, dict[int, dict[str, str]], list[str | None]]:
    """(content, calls by index, finish reasons) of a streamed chat completion."""
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


# ---- tools in auto mode, on a model whose template shows none ------------------------------


def test_auto_tools_on_the_default_model_give_a_parsed_call(server: str) -> None:
    resp = client(server).chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                                  max_tokens=40, temperature=0)
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_auto_tools_on_a_first_question_give_a_plain_answer_and_the_tools_reach_the_prompt(server: str) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    without = client(server).chat.completions.create(model=MODEL, messages=question, max_tokens=8, temperature=0)
    with_tools = client(server).chat.completions.create(model=MODEL, messages=question, tools=[WEATHER],
                                                        max_tokens=8, temperature=0)
    assert with_tools.choices[0].message.content and with_tools.choices[0].message.tool_calls is None
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 40


def test_a_streamed_auto_call_equals_the_whole_one(server: str) -> None:
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=40, temperature=0)
    whole = client(server).chat.completions.create(**kwargs).choices[0].message.tool_calls
    content, calls, reasons = reassemble(client(server).chat.completions.create(**kwargs, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert reasons == ["tool_calls"] and not content.strip()


def test_the_calls_and_results_of_a_history_reach_the_prompt(server: str) -> None:
    def prompt_tokens(result: str, city: str) -> int:
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        messages = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": result}]
        return client(server).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                      max_tokens=1).usage.prompt_tokens

    assert prompt_tokens("18 C", "Paris") < prompt_tokens("18 C, sunny, a light wind from the west", "Paris")
    assert prompt_tokens("18 C", "Paris") < prompt_tokens("18 C", "Paris, Texas, United States")


def test_langchain_bind_tools_runs_a_two_turn_tool_loop(server: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", temperature=0, max_tokens=40)
    bound = llm.bind_tools([WEATHER])  # tool_choice left to the default: auto
    history: list[Any] = [
        HumanMessage("What is the weather in Rome?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Rome"}, "id": "call_rome"}]),
        ToolMessage("21 C, sunny", tool_call_id="call_rome"),
        AIMessage("It is 21 C and sunny in Rome."),
        HumanMessage("What is the weather in Paris?")]
    first = bound.invoke(history)
    (call,) = first.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    history += [first, ToolMessage("18 C and sunny", tool_call_id=call["id"])]
    second = bound.invoke(history)
    assert second.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert second.response_metadata["token_usage"]["prompt_tokens"] > \
        first.response_metadata["token_usage"]["prompt_tokens"]


# A first question, the model's call and its result: the model then answers in text (it used to call
# get_weather again, and an agent loop never ended).
PARIS_CALL = {"id": "call_paris", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
ANSWERABLE = [{"role": "user", "content": "What is the weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
              {"role": "tool", "tool_call_id": "call_paris", "content": "18 C and sunny"}]


def test_after_a_tool_result_auto_answers_in_text(server: str) -> None:
    resp = client(server).chat.completions.create(model=MODEL, messages=ANSWERABLE, tools=[WEATHER],
                                                  max_tokens=40, temperature=0)
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.message.content.strip()
    assert choice.finish_reason == "stop"


def test_langchain_a_forced_call_and_its_tool_message_end_in_a_text_answer(server: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", temperature=0, max_tokens=40)
    question = [HumanMessage("What is the weather in Paris?")]
    first = llm.bind_tools([WEATHER], tool_choice="required").invoke(question)
    (call,) = first.tool_calls
    second = llm.bind_tools([WEATHER]).invoke([*question, first, ToolMessage("18 C and sunny", tool_call_id=call["id"])])
    assert not second.tool_calls and second.content.strip()


def test_litellm_with_tools_gets_a_call(server: str) -> None:
    import litellm

    resp = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server}/v1", api_key="unused",
                              messages=ASK_WEATHER, tools=[WEATHER], max_tokens=40, temperature=0)
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}


def test_litellm_streams_a_plain_answer(server: str) -> None:
    import litellm

    stream = litellm.completion(model=f"openai/{MODEL}", api_base=f"{server}/v1", api_key="unused", stream=True,
                                messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream).strip()


# ---- a forced call cut by max_tokens --------------------------------------------------------


def test_a_required_call_cut_by_max_tokens_is_a_partial_call_not_content(server: str) -> None:
    resp = client(server).chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                                  tool_choice="required", max_tokens=5, temperature=0)
    choice = resp.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "length" and choice.message.content is None
    assert call.function.name == "get_weather" and "[{" not in call.function.arguments


def test_a_streamed_required_call_cut_by_max_tokens_is_a_partial_call(server: str) -> None:
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", temperature=0)
    whole = client(server).chat.completions.create(**kwargs, max_tokens=12).choices[0].message.tool_calls
    content, calls, reasons = reassemble(client(server).chat.completions.create(**kwargs, max_tokens=12, stream=True))
    assert reasons == ["length"] and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]


TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time",
                                         "parameters": {"type": "object", "properties": {}}}}


def test_a_streamed_required_call_without_parallel_calls_is_one_call(server: str) -> None:
    # With parallel calls this question gets get_time, then get_weather.
    stream = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it?"}], tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True)
    content, calls, reasons = reassemble(stream)
    assert [c["name"] for c in calls.values()] == ["get_time"] and list(calls) == [0]
    assert reasons == ["tool_calls"] and not content


# ---- logprobs and echo with emoji and CJK ------------------------------------------------------

FORCED_TEXT = "🎉 東京 ok"


def test_logprob_bytes_of_emoji_and_cjk_rebuild_the_text(server: str) -> None:
    resp = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply with the emoji 🎉 only."}], max_tokens=20,
        logprobs=True, top_logprobs=2, temperature=0, extra_body={"structured_outputs": {"choice": [FORCED_TEXT]}})
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == FORCED_TEXT
    text = bytes(b for entry in content for b in entry.bytes).decode("utf-8")
    assert text.removesuffix("<|im_end|>") == FORCED_TEXT  # the end-of-turn token has an entry too
    assert any("\ufffd" in entry.token for entry in content)  # a token holding part of a character
    for top in (t for entry in content for t in entry.top_logprobs if "\ufffd" not in t.token):
        assert bytes(top.bytes).decode("utf-8") == top.token


@pytest.mark.parametrize("stream", [False, True])
def test_echo_text_offsets_point_into_the_text_of_a_multibyte_prompt(server: str, stream: bool) -> None:
    prompt = "Emojis: 😀🎉, 東京 and café"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)
    if stream:
        text, offsets, tokens = "", [], []
        for chunk in client(server).completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                text += choice.text
                if choice.logprobs is not None:
                    offsets += choice.logprobs.text_offset
                    tokens += choice.logprobs.tokens
    else:
        choice = client(server).completions.create(**kwargs).choices[0]
        text, offsets, tokens = choice.text, choice.logprobs.text_offset, choice.logprobs.tokens
    assert text.startswith(prompt) and offsets == sorted(offsets) and offsets[-1] < len(text)
    for offset, token in zip(offsets, tokens):
        if "\ufffd" not in token:
            assert text[offset:].startswith(token)


# ---- defaults and token ids ----------------------------------------------------------------------


def test_a_completion_without_max_tokens_stops_at_16(server: str) -> None:
    resp = client(server).completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                             extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_return_token_ids_match_the_usage(server: str) -> None:
    resp = httpx.post(f"{server}/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                                        "return_token_ids": True}, timeout=60).json()
    choice = resp["choices"][0]
    assert len(choice["prompt_token_ids"]) == resp["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == resp["usage"]["completion_tokens"]


def test_the_developer_role_costs_what_system_costs(server: str) -> None:
    def prompt_tokens(role: str) -> int:
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        return client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens

    assert prompt_tokens("developer") == prompt_tokens("system")


# ---- schema outputs with numbers -----------------------------------------------------------------


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: float
    landmarks: list[Annotated[str, Field(max_length=20)]] = Field(max_length=2)


def test_parse_with_an_unbounded_float_finishes(server: str) -> None:
    resp = client(server).chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_tokens=200, temperature=0)
    assert resp.choices[0].finish_reason == "stop" and isinstance(resp.choices[0].message.parsed, City)
