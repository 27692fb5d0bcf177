"""Structured output, tool calls and logprobs on the embedded SmolLM2 through the real server, with
the official OpenAI client and LangChain: what agents and extraction code rely on."""

from __future__ import annotations

import enum
import json
import math
import re

import openai
import pytest
from pydantic import BaseModel, Field
from test_server_e2e import MODEL, client, server  # noqa: F401 - `server` is this module's fixture too

pytestmark = pytest.mark.slow


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)
    favourite: Colour
    hobbies: list[str] = Field(max_length=3)
    address: Address


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "Describe a person called Ann who lives in Paris, as JSON."}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_nested_pydantic_model_returns_a_valid_object(server: str, temperature: float) -> None:
    resp = client(server).chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, temperature=temperature, max_tokens=200, seed=3)
    person = resp.choices[0].message.parsed
    assert isinstance(person, Person)
    assert resp.choices[0].finish_reason == "stop"


def test_json_object_output_parses_as_an_object(server: str) -> None:
    resp = client(server).chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:  # cut off by max_tokens: still a prefix of one object
        assert resp.choices[0].message.content.startswith("{")


def test_regex_output_matches_the_pattern(server: str) -> None:
    pattern = r"\d{3}-[a-z]{2,5}"
    resp = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a code."}], max_tokens=20, temperature=1.0,
        extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, resp.choices[0].message.content)


def test_choice_output_is_one_of_the_choices_in_completions_too(server: str) -> None:
    choices = ["yes (sure)", "no.", "maybe*"]
    resp = client(server).completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=10, temperature=1.0, n=4,
        extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices for c in resp.choices)


def test_an_invalid_schema_is_a_400_naming_response_format(server: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert err.value.body["param"] == "response_format"


def check_weather_call(call: object) -> None:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["city"], str) and len(args["city"]) <= 20


def test_tool_choice_required_yields_valid_tool_calls(server: str) -> None:
    resp = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME], tool_choice="required", max_tokens=150, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)


def test_a_named_tool_choice_yields_that_call_with_valid_arguments(server: str) -> None:
    resp = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    (call,) = resp.choices[0].message.tool_calls
    check_weather_call(call)


def test_a_streamed_named_tool_call_reassembles_to_valid_arguments(server: str) -> None:
    stream = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=1.0)
    name, ident, arguments, reasons = None, None, "", []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                name = delta.function.name or name
                ident = delta.id or ident
                arguments += delta.function.arguments or ""
            reasons.append(choice.finish_reason)
    assert name == "get_weather" and ident.startswith("call_") and reasons[-1] == "tool_calls"
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"}


def test_a_streamed_required_tool_call_equals_the_whole_one(server: str) -> None:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                  tool_choice="required", max_tokens=100, temperature=0)
    whole = client(server).chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    for chunk in client(server).chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]
    check_weather_call(whole[0])


def test_chat_logprobs_have_openai_shape_and_sorted_top_logprobs(server: str) -> None:
    resp = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob <= 0 and math.isclose(entry.logprob, tops[0], abs_tol=1e-4)  # greedy: the top one
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == resp.choices[0].message.content


def test_completion_logprobs_with_echo_cover_prompt_and_completion(server: str) -> None:
    prompt = "The capital of France is"
    resp = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                             logprobs=2, echo=True)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_streamed_completion_logprobs_equal_the_whole_ones(server: str) -> None:
    kwargs = dict(model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=1)
    whole = client(server).completions.create(**kwargs).choices[0].logprobs
    tokens: list[str] = []
    values: list[float] = []
    for chunk in client(server).completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert tokens == whole.tokens
    assert values == pytest.approx(whole.token_logprobs, abs=1e-5)


def test_top_logprobs_above_20_is_a_400(server: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, logprobs=True,
                                               top_logprobs=21)
    assert err.value.body["param"] == "top_logprobs"


def test_langchain_with_structured_output_returns_the_model(server: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", temperature=0, max_tokens=200)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe Ann from Paris.")
    assert isinstance(person, Person)


def test_langchain_bind_tools_yields_tool_calls(server: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", temperature=0, max_tokens=100)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
