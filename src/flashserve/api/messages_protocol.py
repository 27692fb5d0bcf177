"""Anthropic's Messages API request, its translation into the chat endpoint's fields, and
Anthropic's error shape.

Content blocks are checked by hand so that a bad block is one 400 naming `messages[i]` and what
is wrong with it; block types this server cannot read (images, documents, thinking) are refused,
not dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from flashserve.api.errors import invalid, unsupported
from flashserve.api.request_checks import check_stop

# A chat field's errors are reported under the Messages field it came from.
CHAT_TO_MESSAGES_PARAM = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                          "response_format": "output_config.format"}

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: Annotated[list[str] | None, AfterValidator(check_stop)] = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": ...}}
    # Known, not implemented: a 400 when set.
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None


def unsupported_field(req: MessagesRequest) -> str | None:
    checks = [
        ("thinking", req.thinking is not None and req.thinking.get("type") != "disabled"),
        ("mcp_servers", bool(req.mcp_servers)),
        ("container", req.container is not None),
        ("output_config.effort", (req.output_config or {}).get("effort") is not None),
    ]
    return next((name for name, bad in checks if bad), None)


def _text(blocks: Any, where: str, param: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid(f"{where} must be a string or a list of content blocks", param)
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise invalid(f"{where}[{j}] must be a text block; blocks of type {kind!r} are not supported here", param)
        texts.append(block["text"])
    return "\n".join(texts)


def _block_fields(block: dict[str, Any], where: str, **kinds: type) -> list[Any]:
    values = []
    for key, kind in kinds.items():
        if not isinstance(block.get(key), kind):
            raise invalid(f"{where}.{key} must be {'a string' if kind is str else 'an object'}", "messages")
        values.append(block[key])
    return values


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """Chat messages for the request: a user message's tool_result blocks become tool messages
    (before its text), an assistant message's tool_use blocks its tool_calls."""
    out: list[dict[str, Any]] = []
    use_ids: set[str] = set()  # of the tool_use blocks so far
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system", "system")})
    for i, message in enumerate(req.messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role must be user or assistant, got {role!r}", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"messages[{i}].content must be a string or a list of content blocks", "messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts += _block_fields(block, where, text=str)
            elif kind == "tool_use" and role == "assistant":
                call_id, name, args = _block_fields(block, where, id=str, name=str, input=dict)
                use_ids.add(call_id)
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                (call_id,) = _block_fields(block, where, tool_use_id=str)
                if call_id not in use_ids:
                    raise invalid(f"{where}: unexpected tool_use_id found in tool_result blocks: {call_id}. Each "
                                  "tool_result block must answer a tool_use block of an earlier assistant message.",
                                  "messages")
                out.append({"role": "tool", "tool_call_id": call_id,
                            "content": _text(block.get("content", ""), f"{where}.content", "messages")})
            else:
                raise invalid(f"{where} has type {kind!r}, which this server does not support in a {role} "
                              "message; it reads text, tool_use (assistant) and tool_result (user) blocks",
                              "messages", code="unsupported_content_type")
        if texts or calls or not content:
            chat: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts or not calls else None}
            if calls:
                chat["tool_calls"] = calls
            out.append(chat)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise unsupported(f"tools[{i}]", f": tools of type {tool.get('type')!r}; this server runs "
                                             "client tools (name, description, input_schema) only")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}',
                  "tool_choice")


def chat_response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise invalid('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}


def chat_fields(req: MessagesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "messages": chat_messages(req), "model": req.model, "max_completion_tokens": req.max_tokens,
        "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice), "stream": req.stream,
        "response_format": chat_response_format(req.output_config),
        # Anthropic's switch for at most one tool_use block
        "parallel_tool_calls": False if (req.tool_choice or {}).get("disable_parallel_tool_use") is True else None,
    }
    return {k: v for k, v in fields.items() if v is not None}
