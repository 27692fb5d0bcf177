"""POST /v1/messages (Anthropic's Messages API) on the embedded SmolLM2 through the real server,
driven by the official `anthropic` client. The server wants an API key, which Anthropic's client
sends as x-api-key; tool calls are forced with tool_choice "tool" or "any" (SmolLM2's template
shows no tool-call format), and the server parses hermes calls for "auto"."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from live_server import live_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-messages"
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}
# Anthropic's client has no temperature argument (its newer models take none); the server reads it.
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with live_server(["--tool-call-parser", "hermes", "--api-key", KEY]) as (base, _proc):
        yield base


def client(base: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def test_create_answers_with_text_and_usage(server: str) -> None:
    msg = client(server).messages.create(model=MODEL, max_tokens=12, system="Answer in one word.",
                                         messages=[{"role": "user", "content": "Capital of France?"}], extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens > 0 and msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0


def test_a_stream_gives_the_same_text_as_create(server: str) -> None:
    kwargs = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Name a colour."}], extra_body=GREEDY)
    whole = client(server).messages.create(**kwargs)
    with client(server).messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_text_and_is_named(server: str) -> None:
    kwargs = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Tell me about Paris."}],
                  extra_body=GREEDY)
    text = client(server).messages.create(**kwargs).content[0].text
    stop = text.split()[2]
    msg = client(server).messages.create(**kwargs, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


def test_a_tool_round_trip_with_tool_use_and_tool_result(server: str) -> None:
    c = client(server)
    first = c.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER],
                              tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}
    # tool_choice "none": the turn for the answer (under "auto" a small model may call again).
    second = c.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], tool_choice={"type": "none"},
                               extra_body=GREEDY, messages=ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [result]}])
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens")


def test_a_streamed_tool_use_arrives_as_input_json(server: str) -> None:
    with client(server).messages.stream(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER],
                                        tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and final.stop_reason == "tool_use"


def test_an_output_format_gives_json_of_that_schema(server: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    msg = client(server).messages.create(model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY,
                                         output_config={"format": {"type": "json_schema", "schema": schema}})
    assert isinstance(json.loads(msg.content[0].text)["city"], str)


def test_an_unsupported_block_is_a_400_in_anthropics_shape(server: str) -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client(server).messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in err.value.body["error"]["message"]


def test_a_missing_field_is_a_400_in_anthropics_shape(server: str) -> None:
    resp = httpx.post(f"{server}/v1/messages", headers={"x-api-key": KEY},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in resp.json()["error"]["message"]


def test_a_wrong_key_is_a_401_in_anthropics_shape(server: str) -> None:
    with pytest.raises(anthropic.AuthenticationError) as err:
        client(server, key="wrong").messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert err.value.body["error"]["type"] == "authentication_error"


def test_an_unknown_model_is_a_404_in_anthropics_shape(server: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        client(server).messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"
