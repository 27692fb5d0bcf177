"""The Responses API's request, and its translation into the chat endpoint's fields.

Input items are checked here by hand rather than by a pydantic union, so that a bad item is one
400 naming `input[i]` and what is wrong with it. Fields this server knows but does not implement
(built-in tools, background mode, ...) are declared loosely so that `unsupported_field` can name
them in a 400 instead of silently ignoring something that changes the output.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from flashserve.api.errors import invalid, unsupported

# A chat field's errors are reported under the Responses field it came from.
CHAT_TO_RESPONSES_PARAM = {
    "messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True  # OpenAI's default
    previous_response_id: str | None = Field(None, min_length=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Known, not implemented: a 400 when set to anything that would change the output.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


def unsupported_field(req: ResponsesRequest) -> str | None:
    checks = [
        ("background", bool(req.background)),
        ("conversation", req.conversation is not None),
        ("prompt", req.prompt is not None),
        ("include", bool(req.include)),
        ("reasoning", bool(req.reasoning) and any(v is not None for v in req.reasoning.values())),
        ("max_tool_calls", req.max_tool_calls is not None),
        ("top_logprobs", bool(req.top_logprobs)),
        ("truncation", req.truncation == "auto"),
    ]
    return next((name for name, bad in checks if bad), None)


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    if not req.input and req.previous_response_id is None:
        raise invalid("input must not be empty", "input")
    return list(req.input)


def _text_parts(content: Any, where: str) -> list[dict[str, Any]] | str:
    """A message's content as chat takes it: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise invalid(f"{where}.content[{j}] of type {kind!r} is not supported; this server reads text "
                          "parts only (input_text, output_text)", "input")
        if not isinstance(part.get(key), str):
            raise invalid(f"{where}.content[{j}].{key} must be a string", "input")
        parts.append({"type": "text", "text": part[key]})
    return parts


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key} must be a string", "input")
    return value


def chat_messages(items: list[dict[str, Any]], instructions: str | None,
                  history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Chat messages for the items of the stored conversation `previous_response_id` continues
    (`history`, validated when stored) and then the request's `items`: a function_call joins the
    assistant message before it as one of its tool_calls, a function_call_output is a tool message.
    A function_call_output must answer a function_call before it, as OpenAI requires."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    call_ids: set[str] = set()
    for i, item in enumerate([*history, *items]):
        where = f"input[{i - len(history)}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"{where}.role must be user, assistant, system or developer, got {role!r}", "input")
            messages.append({"role": role, "content": _text_parts(item.get("content"), where)})
        elif kind == "function_call":
            call_ids.add(_string(item, "call_id", where))
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_parts(output, where)
            call_id = _string(item, "call_id", where)
            if call_id not in call_ids:
                raise invalid(f"No tool call found for function call output with call_id {call_id}. ({where} answers "
                              "no function_call item before it, in the input or in the conversation that "
                              "previous_response_id continues.)", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise invalid(f"{where} has type {kind!r}, which this server does not support; it reads message, "
                          "function_call and function_call_output items", "input", code="unsupported_item_type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"tools[{i}]", f": tools of type {kind!r}; this server runs function tools only")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported("tool_choice", f": {choice.get('type')!r}; it takes none, auto, required or a function")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("text.format must be an object", "text.format")
    if fmt.get("type") != "json_schema":
        return fmt  # text, json_object, or a type the chat check names
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def chat_fields(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request's fields for this Responses request and its conversation."""
    fields: dict[str, Any] = {
        "messages": messages, "model": req.model, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": chat_response_format(req.text), "stream": req.stream,
    }
    return {k: v for k, v in fields.items() if v is not None}
