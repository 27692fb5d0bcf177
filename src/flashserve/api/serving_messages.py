"""POST /v1/messages (Anthropic's Messages API), and its errors in Anthropic's shape.

A translation onto the chat endpoint's path: the messages become chat messages, the chat endpoint
plans them (template, grammar, tool mode) and `chat_bridge` runs the plan; the assistant message,
or its stream of deltas, comes back here to become content blocks and Anthropic's events.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Sequence

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashserve.api import chat_bridge as bridge, messages_protocol as mp
from flashserve.api.chat_plan import ChatEndpoint
from flashserve.api.choices import json_arguments
from flashserve.api.errors import unsupported
from flashserve.api.streaming import CLIENT_CLOSED, ClientGone, SSEResponse

MESSAGES_PATHS = frozenset({"/v1/messages", "/messages"})


def _usage(chat_usage: dict[str, Any], output_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic counts input tokens read from the cache apart from `input_tokens`."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "output_tokens": chat_usage["completion_tokens"] if output_tokens is None else output_tokens}


def _stop(reason: str, text: str, token_ids: list[int], stops: Sequence[str] | None,
          tokenizer: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). The engine strips a stop sequence from the text; the output's
    tokens still hold it, right after the text."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if stops:
        tail = tokenizer.decode(token_ids, skip_special_tokens=True)[len(text):]
        found = next((s for s in stops if tail.startswith(s)), None)
        if found is not None:
            return "stop_sequence", found
    return "end_turn", None


def _content(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        args = json_arguments(call["function"]["arguments"])
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": args if isinstance(args, dict) else {}})
    return blocks


class MessagesServing:
    def __init__(self, serving: ChatEndpoint) -> None:
        self.serving = serving

    async def create(self, body: mp.MessagesRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        field = mp.unsupported_field(body)
        if field is not None:
            raise unsupported(field)
        chat = bridge.chat_request(mp.chat_fields(body))
        try:
            with bridge.fields_named(mp.CHAT_TO_MESSAGES_PARAM):
                plan = await self.serving.plan_chat(chat)
                run = await bridge.ChatRun.start(self.serving, raw, chat, plan, arrival)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": plan.model}
        if body.stream:
            # The background close covers a client that leaves before the body iterator starts.
            return SSEResponse(self._events(run, head, body), ping=0, sep="\n", background=BackgroundTask(run.aclose))
        try:
            result = await run.result(raw)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        text = result.message.get("content") or ""
        reason, sequence = _stop(result.finish_reason, text, result.token_ids, body.stop_sequences,
                                 self.serving.tokenizer)
        return JSONResponse({**head, "content": _content(result.message), "stop_reason": reason,
                             "stop_sequence": sequence, "usage": _usage(result.usage)})

    async def _events(self, run: bridge.ChatRun, head: dict[str, Any], body: mp.MessagesRequest) -> AsyncIterator[bytes]:
        """Anthropic's event stream: message_start, a start/deltas/stop per content block,
        message_delta (stop reason, output tokens), message_stop."""
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": _usage(run.usage(), output_tokens=0)}
        yield bridge.sse_event({"type": "message_start", "message": start})
        yield bridge.sse_event({"type": "ping"})
        index = -1  # the open block's
        kind: str | None = None  # its type
        text = ""

        def begin(block: dict[str, Any]) -> list[bytes]:
            nonlocal index, kind
            out = [bridge.sse_event({"type": "content_block_stop", "index": index})] if kind is not None else []
            index, kind = index + 1, block["type"]
            return out + [bridge.sse_event({"type": "content_block_start", "index": index, "content_block": block})]

        async for ev in run.events():
            if isinstance(ev, bridge.TextDelta):
                if kind != "text":
                    for chunk in begin({"type": "text", "text": ""}):
                        yield chunk
                text += ev.text
                yield bridge.sse_event({"type": "content_block_delta", "index": index,
                            "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, bridge.CallStart):
                for chunk in begin({"type": "tool_use", "id": ev.call_id, "name": ev.name, "input": {}}):
                    yield chunk
            elif isinstance(ev, bridge.ArgumentsDelta):
                yield bridge.sse_event({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": ev.text}})
            elif isinstance(ev, bridge.Finished):
                if kind is not None:
                    yield bridge.sse_event({"type": "content_block_stop", "index": index})
                reason, sequence = _stop(ev.reason, text, ev.token_ids, body.stop_sequences, self.serving.tokenizer)
                yield bridge.sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": {"output_tokens": ev.usage["completion_tokens"]}})
                yield bridge.sse_event({"type": "message_stop"})
            else:  # an APIError ends the stream
                yield bridge.sse_event(mp.anthropic_error(ev.status_code, ev.message))


class AnthropicErrors:
    """ASGI middleware: an error answered on a Messages path (by the handler, request validation
    or the guard's auth, size and drain checks) goes out in Anthropic's shape,
    {"type": "error", "error": {"type", "message"}}, rather than OpenAI's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in MESSAGES_PATHS:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def reshape(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            try:
                error = json.loads(body).get("error") or {}
                message_text = error.get("message") if isinstance(error, dict) else None
            except (ValueError, AttributeError):
                message_text = None
            new = orjson.dumps(mp.anthropic_error(start["status"], message_text or body.decode(errors="replace")))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(new)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, reshape)
