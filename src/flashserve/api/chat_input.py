"""From a chat request to what the engine takes: the messages as chat templates read them (with
the tools where the template cannot show them), how the request's tools shape the output, and the
grammar its output must follow (compiled off the event loop, once per schema)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Sequence

from flashserve.api import protocol as p
from flashserve.api.choices import ToolMode, json_arguments
from flashserve.api.errors import invalid
from flashserve.api.tools.parsers import TOOL_PARSERS, detect_tool_parser, get_tool_parser
from flashserve.api.tools.render import TemplateSupport, render_messages, tools_block
from flashserve.message.grammar_spec import GrammarSpec
from flashserve.structured.compiler import GrammarCompiler
from flashserve.structured.specs import generic_tool_spec, tool_call_spec


def message_text(content: str | list[p.TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type != "text":
            raise invalid(f"content parts of type {part.type!r} are not supported; only text", "messages")
        if part.text is None:
            raise invalid("a text content part needs a text field", "messages")
    return "\n".join(part.text or "" for part in content)


def template_message(m: p.ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: tool-call arguments as objects (templates render them
    with `tojson`), the tool message's call id kept."""
    message: dict[str, Any] = {"role": m.role, "content": message_text(m.content)}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": json_arguments(c.function.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def as_ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True) by default.
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def tool_mode(body: p.ChatCompletionRequest, parser: str | None, tokenizer: Any,
              support: TemplateSupport = TemplateSupport()) -> ToolMode | None:
    """How the request's tools shape its output; None without tools or with tool_choice "none".
    `parser` is the server's --tool-call-parser; `support`, what the chat template renders."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    names = tuple(t.function.name for t in body.tools)
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        name = detect_tool_parser(getattr(tokenizer, "chat_template", None)) if parser == "auto" else parser
        if name in TOOL_PARSERS and support.tools:  # the model's own format, shown by its template
            return ToolMode("auto", get_tool_parser(name), names=names, parallel=parallel)
        return ToolMode("auto", get_tool_parser("hermes"), names=names, rendered=True, parallel=parallel)
    if choice == "required":
        return ToolMode("required", get_tool_parser("forced"), names=names, rendered=not support.tools,
                        parallel=parallel)
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") == "function" and isinstance(name, str):
            return ToolMode("named", None, name, names=names, rendered=not support.tools)
    raise invalid('tool_choice must be "none", "auto", "required" or {"type": "function", '
                  '"function": {"name": ...}}', "tool_choice")


def chat_conversation(body: p.ChatCompletionRequest, tools: ToolMode | None,
                      support: TemplateSupport) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the messages, the keyword arguments) to render with the chat template: the tools go to
    the template where it renders them for the model's own format, else into a system block of
    ours (`tools.render`), as do earlier calls and tool results the template cannot render; in
    `auto` mode there, results that end the conversation are followed by a request to answer."""
    messages = [template_message(m) for m in body.messages]
    kwargs: dict[str, Any] = {}
    block = None
    if tools is not None and body.tools:
        listed = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in body.tools]
        if tools.rendered:
            block = tools_block(listed, tools.kind, tools.name)  # type: ignore[arg-type]
        else:
            kwargs["tools"] = listed
    ask_answer = tools is not None and tools.rendered and tools.kind == "auto"
    return render_messages(messages, support, block, ask_answer), kwargs


def tool_grammar(body: p.ChatCompletionRequest, tools: ToolMode | None) -> GrammarSpec | None:
    """The grammar the request's tools impose, or None: the forced forms' grammars, and for `auto`
    in the generic format, plain text or calls of the request's functions."""
    if tools is None:
        return None
    listed = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if tools.kind == "auto":
        return generic_tool_spec(listed, tools.parallel) if tools.rendered else None
    return tool_call_spec(listed, body.tool_choice, tools.parallel)


class Grammars:
    """The server's grammar compiler, built on the first structured request (building the
    tokenizer's token table takes a moment for a large vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = asyncio.Lock()

    async def compile(self, spec: GrammarSpec | None) -> Any:
        """The compiled grammar of `spec` (compiled off the event loop, cached), or None."""
        if spec is None:
            return None
        if self._tokenizer is None:
            raise invalid("structured output needs a tokenizer; this server runs without one", spec.param)
        if self._compiler is None:
            async with self._lock:
                if self._compiler is None:
                    vocab = self._vocab_size or len(self._tokenizer)
                    self._compiler = await asyncio.to_thread(GrammarCompiler, self._tokenizer, vocab, self._eos)
        return await self._compiler.compile(spec)
