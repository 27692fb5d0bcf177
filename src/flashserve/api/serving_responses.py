"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A translation onto the chat endpoint's path: the input items (after the stored conversation that
`previous_response_id` continues) become chat messages, the chat endpoint plans them (template,
grammar, tool mode) and `chat_bridge` runs the plan; the assistant message, or its stream of
deltas, comes back here to become output items and Responses events.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from flashserve.api import chat_bridge as bridge, responses_protocol as rp
from flashserve.api.chat_plan import ChatEndpoint
from flashserve.api.errors import APIError, unsupported
from flashserve.api.response_store import MissingResponse, ResponseStore, StoredResponse
from flashserve.api.streaming import CLIENT_CLOSED, ClientGone, SSEResponse


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    # cache_write_tokens counts OpenAI's explicit cache writes; this server's prefix cache is implicit.
    details = {"cached_tokens": cached, "cache_write_tokens": 0}
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": details,
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _output(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    items = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(_message_item(message.get("content") or "", status))
    items += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], status) for c in calls]
    return items


class ResponsesServing:
    def __init__(self, serving: ChatEndpoint, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    async def create(self, body: rp.ResponsesRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        field = rp.unsupported_field(body)
        if field is not None:
            raise unsupported(field)
        items = rp.input_items(body)
        history = self._history(body.previous_response_id)
        chat = bridge.chat_request(rp.chat_fields(body, rp.chat_messages(items, body.instructions, history)))
        try:
            with bridge.fields_named(rp.CHAT_TO_RESPONSES_PARAM):
                plan = await self.serving.plan_chat(chat)
                run = await bridge.ChatRun.start(self.serving, raw, chat, plan, arrival)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        response = self._response(body, plan.model)
        if body.stream:
            # The background close covers a client that leaves before the body iterator starts.
            return SSEResponse(self._events(run, response, items, body), ping=0, sep="\n",
                               background=BackgroundTask(run.aclose))
        try:
            result = await run.result(raw)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        status = "incomplete" if result.finish_reason == "length" else "completed"
        self._finish(response, _output(result.message, status), result.usage, items, body)
        return JSONResponse(response)

    async def retrieve(self, response_id: str) -> JSONResponse:
        return JSONResponse(self._stored(response_id).response)

    async def delete(self, response_id: str) -> JSONResponse:
        self._stored(response_id)
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def _stored(self, response_id: str) -> StoredResponse:
        try:
            return self.store.get(response_id)
        except MissingResponse:
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                           code="response_not_found") from None

    def _history(self, previous_id: str | None) -> list[dict[str, Any]]:
        if previous_id is None:
            return []
        try:
            return self.store.conversation(previous_id)
        except MissingResponse as missing:
            why = ("this server stores no responses (--responses-store-max-entries 0)" if not self.store.enabled
                   else "it was never stored here, or was deleted, evicted or expired; stored responses are "
                        "kept by this server only, until it restarts")
            gone = "" if missing.response_id == previous_id else f" (an earlier response it continues, " \
                                                                 f"'{missing.response_id}', is gone)"
            raise APIError(404, f"Previous response with id '{previous_id}' not found{gone}: {why}.",
                           param="previous_response_id", code="previous_response_not_found") from None

    def _response(self, body: rp.ResponsesRequest, model: str) -> dict[str, Any]:
        """The Response object in progress: no output yet."""
        return {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": None,
            "store": body.store and self.store.enabled, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": body.truncation or "disabled",
            "usage": None, "user": body.user, "metadata": body.metadata or {},
        }

    def _finish(self, response: dict[str, Any], output: list[dict[str, Any]], chat_usage: dict[str, Any],
                items: list[dict[str, Any]], body: rp.ResponsesRequest) -> None:
        incomplete = any(item["status"] == "incomplete" for item in output)
        response.update(output=output, usage=_usage(chat_usage), status="incomplete" if incomplete else "completed",
                        incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
        if response["store"]:
            self.store.put(StoredResponse(response, items, body.previous_response_id))

    async def _events(self, run: bridge.ChatRun, response: dict[str, Any], items: list[dict[str, Any]],
                      body: rp.ResponsesRequest) -> AsyncIterator[bytes]:
        """The Responses event stream of one run, each event numbered."""
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            seq += 1
            return bridge.sse_event({"type": kind, "sequence_number": seq - 1, **fields})

        yield event("response.created", response=response)
        yield event("response.in_progress", response=response)
        output: list[dict[str, Any]] = []
        open_item: dict[str, Any] | None = None  # the item being streamed

        def close(status: str) -> list[bytes]:
            nonlocal open_item
            if open_item is None:
                return []
            item, open_item = open_item, None
            item["status"] = status
            ids = {"item_id": item["id"], "output_index": len(output)}
            if item["type"] == "message":
                part = item["content"][0]
                out = [event("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[]),
                       event("response.content_part.done", **ids, content_index=0, part=part)]
            else:
                out = [event("response.function_call_arguments.done", **ids, arguments=item["arguments"])]
            output.append(item)
            return out + [event("response.output_item.done", output_index=ids["output_index"], item=item)]

        def open_message() -> list[bytes]:
            nonlocal open_item
            open_item = _message_item("", "in_progress")
            part = dict(open_item["content"][0])
            ids = {"item_id": open_item["id"], "output_index": len(output)}
            return [event("response.output_item.added", output_index=len(output), item={**open_item, "content": []}),
                    event("response.content_part.added", **ids, content_index=0, part=part)]

        async for ev in run.events():
            if isinstance(ev, bridge.TextDelta):
                if open_item is None or open_item["type"] != "message":
                    for chunk in close("completed") + open_message():
                        yield chunk
                assert open_item is not None
                open_item["content"][0]["text"] += ev.text
                yield event("response.output_text.delta", item_id=open_item["id"], output_index=len(output),
                            content_index=0, delta=ev.text, logprobs=[])
            elif isinstance(ev, bridge.CallStart):
                for chunk in close("completed"):
                    yield chunk
                open_item = _call_item(ev.call_id, ev.name, "", "in_progress")
                yield event("response.output_item.added", output_index=len(output), item=dict(open_item))
            elif isinstance(ev, bridge.ArgumentsDelta):
                assert open_item is not None and open_item["type"] == "function_call"
                open_item["arguments"] += ev.text
                yield event("response.function_call_arguments.delta", item_id=open_item["id"],
                            output_index=len(output), delta=ev.text)
            elif isinstance(ev, bridge.Finished):
                status = "incomplete" if ev.reason == "length" else "completed"
                chunks = close(status) if open_item is not None or output else open_message() + close(status)
                for chunk in chunks:
                    yield chunk
                self._finish(response, output, ev.usage, items, body)
                yield event(f"response.{response['status']}", response=response)
            else:  # an APIError: the stream ends failed
                yield event("error", code=ev.code or ev.type, message=ev.message, param=ev.param)
                response.update(status="failed", output=output, error={"code": "server_error", "message": ev.message})
                yield event("response.failed", response=response)

