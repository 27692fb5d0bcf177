"""One choice's output in OpenAI's shapes: text, logprobs and tool calls, whole or streamed.

The engine hands out text and token ids; this module turns them into a chat message (content or
`tool_calls`) or a completion's text, with logprobs when asked. Streaming builders return the
`choices[]` entries of the chunks to send for each engine output, in order.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from flashserve.api.logprobs import (
    TextOffsets,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
)
from flashserve.api.tools.parsers import ToolParser, forced_named_call
from flashserve.message.outputs import RequestOutput, TokenLogprob


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's tools shape its output: `auto` parses the model's own tool-call format
    (`parser`), or, where the chat template cannot show the tools (`rendered`), the generic format
    of `tools.render`, which a grammar enforces; `required` and `named` outputs follow a grammar (a
    JSON array of calls, or the named function's arguments)."""

    kind: str  # "auto" | "required" | "named"
    parser: ToolParser | None = None  # auto: the model's format; required: the forced array
    name: str | None = None  # named: the function
    names: tuple[str, ...] = ()  # the request's functions
    rendered: bool = False  # the tools reach the model as text of ours, not through its template
    parallel: bool = True  # False (parallel_tool_calls): at most one call

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1


@dataclass
class ChoiceResult:
    """Everything one choice produced, gathered from its engine outputs."""

    index: int
    pieces: list[str] = field(default_factory=list)  # the text, joined once at the end
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str = "stop"
    num_output_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, out: RequestOutput) -> None:
        self.pieces.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_output_tokens = max(self.num_output_tokens, out.num_output_tokens)
        if out.finished:
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"


def _call_dict(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(result: ChoiceResult, tools: ToolMode | None) -> tuple[dict[str, Any], str]:
    """(the assistant message, finish_reason) of a finished chat choice."""
    content: str | None = result.text
    calls: list[Any] = []
    cut = result.finish_reason == "length"  # a call under way keeps its arguments as far as they went
    if tools is not None:
        parsed = (forced_named_call(tools.name, result.text, cut) if tools.kind == "named" and tools.name
                  else tools.parser.parse(result.text, tools.names, cut, tools.max_calls) if tools.parser is not None
                  else None)
        if parsed is not None:
            content, calls = parsed.content, parsed.tool_calls
    reason = "tool_calls" if calls and not cut else result.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [_call_dict(c) for c in calls]
    return message, reason


def chat_choice_logprobs(result: ChoiceResult, text_of: TokenTexts) -> dict[str, Any] | None:
    return chat_logprobs(result.logprobs, text_of) if result.logprobs is not None else None


def completion_choice_logprobs(result: ChoiceResult, text_of: TokenTexts, prompt_ids: list[int] | None,
                               prompt_text: str = "") -> dict[str, Any] | None:
    """The completion's logprobs; with `prompt_ids` (echo) the prompt's tokens come first. A choice
    of max_tokens 0 has the prompt's alone."""
    if result.logprobs is None and (prompt_ids is None or result.prompt_logprobs is None):
        return None
    parts: list[dict[str, Any]] = []
    if prompt_ids is not None and result.prompt_logprobs is not None:
        parts.append(completion_logprobs(prompt_ids, result.prompt_logprobs, text_of, TextOffsets()))
    if result.logprobs is not None:
        parts.append(completion_logprobs(result.token_ids, result.logprobs, text_of, TextOffsets(len(prompt_text))))
    return merge_completion_logprobs(parts)


def chat_choices(results: list[ChoiceResult], tools: ToolMode | None, text_of: TokenTexts,
                 token_ids: bool = False) -> list[dict[str, Any]]:
    """The `choices` of a finished chat completion; `token_ids`: with each output's token ids."""
    choices = []
    for r in results:
        message, reason = chat_message(r, tools)
        choice = {"index": r.index, "message": message, "finish_reason": reason,
                  "logprobs": chat_choice_logprobs(r, text_of)}
        if token_ids:
            choice["token_ids"] = r.token_ids
        choices.append(choice)
    return choices


def completion_choices(results: list[ChoiceResult], text_of: TokenTexts, prompts: list[list[int]],
                       echo: list[str] | None, token_ids: bool = False) -> list[dict[str, Any]]:
    """The `choices` of a finished text completion; `prompts[i]` and `echo[i]` (the prompt's text,
    when the request echoes it) belong to choice i. `token_ids`: with the prompt's and the
    output's token ids."""
    choices = []
    for r in results:
        prefix = echo[r.index] if echo else ""
        logprobs = completion_choice_logprobs(r, text_of, prompts[r.index] if echo else None, prefix)
        choice = {"index": r.index, "text": prefix + r.text, "finish_reason": r.finish_reason, "logprobs": logprobs}
        if token_ids:
            choice.update(prompt_token_ids=prompts[r.index], token_ids=r.token_ids)
        choices.append(choice)
    return choices


class ChatChoiceStream:
    """The chunks' choices for one streamed chat choice: content deltas, or tool-call deltas."""

    def __init__(self, index: int, text_of: TokenTexts, tools: ToolMode | None, token_ids: bool = False) -> None:
        self.index = index
        self._text_of = text_of
        self._tools = tools
        self._token_ids = token_ids  # each output's ids on its first chunk
        self._streamer = (tools.parser.streamer(tools.names, tools.max_calls)
                          if tools is not None and tools.parser is not None else None)
        self._named_id = f"call_{uuid.uuid4().hex[:24]}" if tools is not None and tools.kind == "named" else None
        self._named_started = False

    def _choice(self, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _deltas(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self._streamer is not None:
            return self._streamer.feed(text)
        if self._named_id is not None:
            assert self._tools is not None
            delta: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self._named_started:
                self._named_started = True
                delta = {"index": 0, "id": self._named_id, "type": "function",
                         "function": {"name": self._tools.name, "arguments": text}}
            return [{"tool_calls": [delta]}]
        return [{"content": text}]

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The choices to send for one engine output (final ones included when it finished)."""
        logprobs = chat_logprobs(out.logprobs, self._text_of) if out.logprobs else None
        deltas = self._deltas(out.new_text)
        choices = [self._choice(d) for d in deltas]
        if logprobs is not None or (self._token_ids and out.new_token_ids):
            if not choices:
                choices.append(self._choice({}))
            choices[0]["logprobs"] = logprobs
            if self._token_ids:
                choices[0]["token_ids"] = out.new_token_ids
        if out.finished:
            if self._streamer is not None:
                choices += [self._choice(d) for d in self._streamer.finish(cut=out.finish_reason == "length")]
            called = self._named_started or (self._streamer is not None and self._streamer.num_tool_calls > 0)
            reason = "length" if out.finish_reason == "length" else "tool_calls" if called else "stop"
            choices.append(self._choice({}, None, reason))
        return choices


class CompletionChoiceStream:
    """The chunks' choices for one streamed text completion (echo and logprobs included)."""

    def __init__(self, index: int, text_of: TokenTexts, prompt_ids: list[int], prompt_text: str | None,
                 token_ids: bool = False) -> None:
        self.index = index
        self._text_of = text_of
        self._prompt_ids = prompt_ids
        self._token_ids = token_ids  # each output's ids on its chunk, the prompt's on the first
        self._sent_prompt_ids = False
        self._echo = prompt_text  # None: no echo; sent before the first completion text
        self._offsets = TextOffsets(len(prompt_text or ""))  # of the completion's tokens

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        text = out.new_text
        parts: list[dict[str, Any]] = []
        if self._echo is not None:
            if out.prompt_logprobs is not None:
                parts.append(completion_logprobs(self._prompt_ids, out.prompt_logprobs, self._text_of, TextOffsets()))
            text, self._echo = self._echo + text, None
        if out.logprobs:
            parts.append(completion_logprobs(out.new_token_ids, out.logprobs, self._text_of, self._offsets))
        logprobs = merge_completion_logprobs(parts)
        choices = []
        if text or logprobs is not None or (self._token_ids and out.new_token_ids):
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": None}
            if self._token_ids:
                if not self._sent_prompt_ids:
                    choice["prompt_token_ids"], self._sent_prompt_ids = self._prompt_ids, True
                choice["token_ids"] = out.new_token_ids
            choices.append(choice)
        if out.finished:
            reason = "length" if out.finish_reason == "length" else "stop"
            choices.append({"index": self.index, "text": "", "logprobs": None, "finish_reason": reason})
        return choices


def json_arguments(text: str) -> Any:
    """Tool-call arguments as a template expects them: an object when the JSON text is one."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
