"""OpenAI `tool_calls` out of a model's raw output text, whole (`ToolParser.parse`) or as it
streams (`ToolParser.streamer`), for the formats in TOOL_PARSERS.

Each format is one scanner over the text (see `streaming` for how a scanner decides and why
calls go out whole). Malformed calls never raise: they come out as the content they were.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

from flashserve.api.tools.streaming import (
    NOT_JSON,
    TEXT,
    Event,
    FoundCall,
    NamedCallStreamer,
    ParsedOutput,
    ToolCall,
    ToolCallStreamer,
    call_from_json,
    call_with,
    forced_named_call,
    load_json,
    partial_call,
)

__all__ = [
    "TOOL_PARSERS", "NamedCallStreamer", "ParsedOutput", "ToolCall", "ToolCallStreamer", "ToolParser",
    "detect_tool_parser", "forced_named_call", "get_tool_parser",
]


class _HermesStreamer(ToolCallStreamer):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _step(self, events: list[Event], final: bool) -> bool:
        if self._state != "call":
            return self._until(self.OPEN, events, final) and self._enter("call")
        at = self._buf.find(self.CLOSE, self._seen)
        if at < 0:
            if not final:
                self._seen = max(0, len(self._buf) - len(self.CLOSE) + 1)
                return False
            if self._cut and load_json(self._buf) is NOT_JSON:
                return self._wait(events, final)
            at = len(self._buf)  # unclosed at the end: still a call if what came parses as one
        body = self._take(at)
        self._raw += body + self._take(len(self.CLOSE))
        return self._done(events, call_from_json(load_json(body)))


    def _partial(self) -> FoundCall | None:
        return partial_call(self._buf, self._names) if self._state == "call" else None


class _MistralStreamer(ToolCallStreamer):
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"[\w.\-]*")
    _name = ""  # the function of a [TOOL_CALLS]name[ARGS]{...} call being read

    def _step(self, events: list[Event], final: bool) -> bool:
        state = self._state
        if state in ("start", TEXT):
            return self._until(self.MARKER, events, final) and self._enter("after")
        if state == "name":  # [TOOL_CALLS]name[ARGS]{...}
            name = self._NAME.match(self._buf).group()  # type: ignore[union-attr]  # "*" always matches
            rest = self._buf[len(name):]
            if name and rest.startswith(self.ARGS):
                self._name = name
                self._raw += self._take(len(name) + len(self.ARGS))
                return self._enter("args")
            return self._wait(events, final) if self.ARGS.startswith(rest) else self._fail(events)
        c = self._next_char()
        if not c:
            return self._wait(events, final)
        if state == "after":
            return self._enter("list" if c == "[" else "name")
        if c != ("{" if state == "args" else "["):
            return self._fail(events)
        value = self._closed_value()
        if value is None:
            return self._wait(events, final)
        if state == "args":
            return self._done(events, call_with(self._name, load_json(value)))
        items = load_json(value)  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        calls = [call_from_json(i) for i in items] if isinstance(items, list) and items else [None]
        if None in calls:
            return self._fail(events)
        events.extend(calls[:-1])
        return self._done(events, calls[-1])


class _Llama3JsonStreamer(ToolCallStreamer):
    TAG = "<|python_tag|>"
    _NOT_A_KEY = re.compile(r'\{\s*[^\s"]')  # plain text in braces, told apart before it closes

    def _step(self, events: list[Event], final: bool) -> bool:
        state = self._state
        if state == TEXT:
            events.append(self._take(len(self._buf)))
            return False
        c = self._next_char()
        if state == "start":
            if self._buf.startswith(self.TAG):
                self._raw += self._take(len(self.TAG))
                return self._enter("object")
            if not c or self.TAG.startswith(self._buf):
                return self._wait(events, final)
            return self._enter("object")
        if not c:
            return self._wait(events, final)
        if state == "sep":  # calls are separated by "; " (or by whitespace alone)
            if c == ";":
                self._raw += self._take(1)
            return self._enter("object") if c in ";{" else self._fail(events)
        if c != "{" or self._NOT_A_KEY.match(self._buf):
            return self._fail(events)
        value = self._closed_value()
        if value is None:
            return self._wait(events, final)
        return self._done(events, call_from_json(load_json(value), require_arguments=True), then="sep")


class _ForcedStreamer(ToolCallStreamer):
    def _step(self, events: list[Event], final: bool) -> bool:
        state = self._state
        if state == TEXT:
            events.append(self._take(len(self._buf)))
            return False
        c = self._next_char()
        if not c:
            return self._wait(events, final)
        if state == "start":
            if c != "[":
                return self._fail(events)
            self._raw += self._take(1)
            return self._enter("object")
        if state == "sep":
            if c == ",":
                self._raw += self._take(1)
                return self._enter("object")
            if c != "]":
                return self._fail(events)
            self._take(1)
            self._raw = ""
            return self._enter(TEXT)  # what follows the array, if anything, is content
        if c != "{":
            return self._fail(events)
        value = self._closed_value()
        if value is None:
            return self._wait(events, final)
        return self._done(events, call_from_json(load_json(value)), then="sep")


class ToolParser:
    """One tool-call format. Holds no state: one instance serves every request."""

    name: ClassVar[str]
    _streamer: ClassVar[type[ToolCallStreamer]]

    def parse(self, text: str, names: Sequence[str] = (), cut: bool = False,
              max_calls: int | None = None) -> ParsedOutput:
        """The calls and content of a whole output; `cut` (by max_tokens): a call under way is
        kept with its arguments as far as they went, where `names` (the request's functions) tell
        which function it calls. `max_calls`: the output ends after that many calls."""
        return self._streamer(names, max_calls).parse_whole(text, cut)

    def streamer(self, names: Sequence[str] = (), max_calls: int | None = None) -> ToolCallStreamer:
        return self._streamer(names, max_calls)


class HermesToolParser(ToolParser):
    """Hermes 2/3, Qwen 2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
    number of them, amid text."""

    name = "hermes"
    _streamer = _HermesStreamer


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3: the whole output is `{"name": ..., "parameters": {...}}`, calls separated by
    "; ", perhaps after <|python_tag|>. Any other output is content."""

    name = "llama3_json"
    _streamer = _Llama3JsonStreamer


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
    `[TOOL_CALLS]name[ARGS]{...}`, repeated. [TOOL_CALLS] is a special token: it is seen only in
    output decoded with skip_special_tokens off."""

    name = "mistral"
    _streamer = _MistralStreamer


class ForcedToolParser(ToolParser):
    """What the grammar of `tool_choice: "required"` forces: `[{"name": ..., "parameters": {...}}]`,
    one element or more."""

    name = "forced"
    _streamer = _ForcedStreamer


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, ForcedToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; valid names: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The format a chat template asks its model for, when exactly one format's signs are in it."""
    t = chat_template or ""
    found = [name for name, sign in (
        ("hermes", "<tool_call>" in t),
        ("mistral", "[TOOL_CALLS]" in t),
        ("llama3_json", "<|python_tag|>" in t or ("Environment: ipython" in t and '"parameters"' in t)),
    ) if sign]
    return found[0] if len(found) == 1 else None

