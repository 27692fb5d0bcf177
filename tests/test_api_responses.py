"""POST /v1/responses on the embedded SmolLM2 through the real server, driven by the official
OpenAI client (create, stream, parse) and the OpenAI Agents SDK.

The server parses hermes tool calls for tool_choice "auto" (SmolLM2's template shows no format),
so a request with tools and no tool_choice (the Agents SDK's after a call) runs; the model's own
answer then is text. Tool calls are forced with tool_choice "required" or a named function."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel, Field

from live_server import live_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
STORE_SIZE = 8
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False},
}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # Two front ends: a request that continues a stored response may reach either of them.
    args = ["--tool-call-parser", "hermes", "--responses-store-max-entries", str(STORE_SIZE), "--api-server-count", "2"]
    with live_server(args) as (base, _proc):
        yield base


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_create_answers_with_a_message_and_usage(server: str) -> None:
    resp = client(server).responses.create(model=MODEL, input="What is the capital of France?",
                                           instructions="Answer in one word.", max_output_tokens=12, temperature=0)
    assert resp.id.startswith("resp_") and resp.status in ("completed", "incomplete")
    assert resp.output[0].type == "message" and resp.output_text
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.usage.output_tokens > 0


def test_a_response_validates_against_the_sdks_type(server: str) -> None:
    body = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4},
                      timeout=60).json()
    Response.model_validate(body)
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} or body["status"] == "completed"


def test_a_stream_sends_the_events_in_order_and_the_same_text(server: str) -> None:
    kwargs = dict(model=MODEL, input="Name a colour of the rainbow.", max_output_tokens=12, temperature=0)
    whole = client(server).responses.create(**kwargs)
    with client(server).responses.stream(**kwargs) as stream:
        events = list(stream)
    final = events[-1].response  # response.completed, or response.incomplete at max_output_tokens
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-1] == f"response.{final.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


def test_parse_returns_the_pydantic_object(server: str) -> None:
    resp = client(server).responses.parse(model=MODEL, input="Describe Paris as JSON.", text_format=City,
                                          max_output_tokens=60, temperature=0)
    assert isinstance(resp.output_parsed, City)


def test_json_object_format_gives_a_json_object(server: str) -> None:
    resp = client(server).responses.create(model=MODEL, input="Describe Paris as JSON.", max_output_tokens=40,
                                           text={"format": {"type": "json_object"}}, temperature=0)
    assert resp.output_text.startswith("{")


def test_a_function_call_round_trip_with_function_call_output(server: str) -> None:
    c = client(server)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                               max_output_tokens=40, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    # tool_choice "none": with tools shown and a call and its output in the conversation, the model
    # may call again under "auto" (tools work with any model's template); this turn is for the answer.
    second = c.responses.create(model=MODEL, input=ask + first.output + [answer], tools=[WEATHER],
                                tool_choice="none", max_output_tokens=16, temperature=0, store=False)
    assert second.output[0].type == "message" and second.output_text
    alone = c.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="none", max_output_tokens=1,
                               temperature=0, store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens  # the call and its output are in the prompt


def test_a_streamed_named_function_call_reassembles_to_its_item(server: str) -> None:
    with client(server).responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                         tool_choice={"type": "function", "name": "get_weather"},
                                         max_output_tokens=40, temperature=0) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert done.type == "function_call" and done.name == "get_weather" and done.arguments == deltas
    assert isinstance(json.loads(deltas), dict)


def test_previous_response_id_continues_the_stored_conversation(server: str) -> None:
    c = client(server)
    first = c.responses.create(model=MODEL, input="My name is Ann.", max_output_tokens=12, temperature=0)
    second = c.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    # The first turn (its input and output) is the start of the second's prompt, and came from the cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_a_stored_response_can_be_read_back_and_deleted(server: str) -> None:
    c = client(server)
    resp = c.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    assert c.responses.retrieve(resp.id).output_text == resp.output_text
    c.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(resp.id)


def test_store_false_keeps_nothing(server: str) -> None:
    c = client(server)
    resp = c.responses.create(model=MODEL, input="Hello", max_output_tokens=4, store=False)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(resp.id)


def test_an_unknown_previous_response_id_is_a_404_naming_the_field(server: str) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client(server).responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope",
                                        max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"


def test_the_store_at_its_limit_drops_the_least_recently_used(server: str) -> None:
    c = client(server)
    ids = [c.responses.create(model=MODEL, input=f"Count {i}", max_output_tokens=1).id for i in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL, input="Go on", previous_response_id=ids[0], max_output_tokens=1)
    assert c.responses.retrieve(ids[-1]).id == ids[-1]


@pytest.mark.parametrize("item", [{"type": "computer_call_output", "call_id": "c", "output": {}},
                                  {"type": "mystery"}])
def test_an_unknown_input_item_type_is_a_400(server: str, item: dict) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(server).responses.create(model=MODEL, input=[item], max_output_tokens=4)
    assert err.value.body["param"] == "input" and item["type"] in err.value.body["message"]


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
])
def test_an_unsupported_field_is_a_400_naming_it(server: str, fields: dict, param: str) -> None:
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "Hi", **fields}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_an_agents_sdk_agent_calls_its_function_tool_then_answers_in_text(server: str) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "Sunny, 24 C"

    # "required" forces the first call (on a first question the 135M model answers without one); the
    # SDK then resets tool_choice, and the model's answer after the tool's result ends the run.
    settings = ModelSettings(tool_choice="required", max_tokens=40, temperature=0)

    async def run() -> object:
        # The client closes inside the loop it ran on: left open, its connection is closed when it is
        # collected, on that loop, closed by then, and the error surfaces in whichever test runs next.
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as client:
            agent = Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                          model=OpenAIResponsesModel(MODEL, client), model_settings=settings)
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    # A loop of its own, closed and unset on return: Runner.run_sync leaves a closed loop behind as the
    # thread's event loop, which the next module's anyio tests then failed on ("Event loop is closed").
    result = asyncio.run(run())
    assert calls == ["Paris"] and len(result.raw_responses) == 2  # the call, then the answer
    assert isinstance(result.final_output, str) and result.final_output.strip()
