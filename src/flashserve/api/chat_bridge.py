"""One chat generation for the endpoints translated onto chat (Responses, Messages).

Their handlers build a `ChatCompletionRequest`, get its `ChatPlan` from the chat endpoint (template,
grammar, tool mode) and run it here on the same engine streams and choice shaping as
/v1/chat/completions; what comes back is data (the finished assistant message, or a stream of
`ChatEvent`s) for them to put into their own shapes, not an HTTP response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterator, Mapping, Union

import orjson
from fastapi import Request
from pydantic import ValidationError

from flashserve.api import protocol as p
from flashserve.api.chat_plan import ChatEndpoint, ChatPlan
from flashserve.api.choices import ChatChoiceStream, chat_message
from flashserve.api.errors import APIError, invalid
from flashserve.api.streaming import EngineStreams, unless_disconnected, usage
from flashserve.message.sampling_params import InvalidParameter


@dataclass(frozen=True)
class ChatResult:
    message: dict[str, Any]  # {"role": "assistant", "content": str | None, "tool_calls"?: [...]}
    finish_reason: str  # "stop" | "length" | "tool_calls"
    usage: dict[str, Any]  # as chat's: prompt_tokens, completion_tokens, prompt_tokens_details, ...
    token_ids: list[int]  # the output's, for telling which stop sequence ended it


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's number in this output
    call_id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "tool_calls"
    usage: dict[str, Any]
    token_ids: list[int]


ChatEvent = Union[TextDelta, CallStart, ArgumentsDelta, Finished, APIError]  # an APIError ends the stream


def sse_event(event: dict[str, Any]) -> bytes:
    """A server-sent event named by its type, as both Responses and Messages streams send them."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def chat_request(fields: dict[str, Any]) -> p.ChatCompletionRequest:
    """The chat request a translation built; its own mistakes in the fields are 400s, not 500s."""
    try:
        return p.ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise invalid(f"{where}: {first.get('msg')}" if where else str(first.get("msg")), where or None) from None


@contextmanager
def fields_named(params: Mapping[str, str]) -> Iterator[None]:
    """Errors raised inside (by the chat endpoint's checks and the engine's parameter checks) name
    the translated API's fields rather than chat's (`params`: chat field -> that API's field)."""
    try:
        yield
    except InvalidParameter as exc:
        raise invalid(str(exc), params.get(exc.param or "", exc.param)) from None
    except APIError as exc:
        exc.param = params.get(exc.param or "", exc.param)
        raise


class ChatRun:
    """The engine streams of one planned chat request, started: a failure before the first token
    has already been raised as an APIError (so it can still be an HTTP status)."""

    def __init__(self, serving: ChatEndpoint, plan: ChatPlan, streams: EngineStreams) -> None:
        self._serving = serving
        self._plan = plan
        self._streams = streams

    @classmethod
    async def start(cls, serving: ChatEndpoint, raw: Request, body: p.ChatCompletionRequest,
                    plan: ChatPlan, arrival: float | None = None) -> ChatRun:
        """Raises APIError, or ClientGone if the client left first."""
        streams = serving.open_streams(body, plan.request_id, [plan.prompt], param="messages",
                                arrival=time.monotonic() if arrival is None else arrival,
                                x_request_id=raw.state.request_id, grammar=plan.grammar, headers=raw.headers)
        try:
            await unless_disconnected(raw, streams.start())
        except BaseException:
            streams.close()
            raise
        return cls(serving, plan, streams)

    def usage(self) -> dict[str, Any]:
        """Chat's usage so far; the prompt's cached tokens are known once started."""
        s = self._streams
        return usage(len(self._plan.prompt), s.num_output_tokens, s.num_cached_prompt_tokens)

    async def result(self, raw: Request) -> ChatResult:
        """The finished message. Raises APIError, or ClientGone if the client left first."""
        try:
            (result,) = await unless_disconnected(raw, self._streams.collect())
        finally:
            self._streams.close()
        message, reason = chat_message(result, self._plan.tools)
        return ChatResult(message, reason, self.usage(), result.token_ids)

    async def events(self) -> AsyncIterator[ChatEvent]:
        """The output as it comes, ending in Finished or an APIError; closes the streams on exit,
        a client that leaves mid-stream included."""
        choice = ChatChoiceStream(0, self._serving.text_of, self._plan.tools)
        reason = "stop"
        token_ids: list[int] = []
        try:
            async for index, out in self._streams.outputs():
                err = self._streams.failure(index, out)
                if err is not None:
                    self._serving.metrics.record_error(err.type, err.code)
                    yield err
                    return
                token_ids += out.new_token_ids
                for entry in choice.chunks(out):
                    delta = entry["delta"]
                    if delta.get("content"):
                        yield TextDelta(delta["content"])
                    for call in delta.get("tool_calls") or ():
                        function = call.get("function", {})
                        if "id" in call:
                            yield CallStart(call["index"], call["id"], function.get("name", ""))
                        if function.get("arguments"):
                            yield ArgumentsDelta(call["index"], function["arguments"])
                    reason = entry["finish_reason"] or reason
            yield Finished(reason, self.usage(), token_ids)
        finally:
            self._streams.close()

    def close(self) -> None:
        self._streams.close()

    async def aclose(self) -> None:  # a BackgroundTask runs a plain function on a thread
        self._streams.close()
