"""The data and machinery shared by the tool-call formats of `parsers`.

A format is a scanner (a `ToolCallStreamer` subclass) that both `parse` and streaming run, so the
two cannot drift apart. A scanner decides only from text it has seen and holds back what it cannot
decide yet: a tail that may still grow into a marker, or a call whose JSON has not closed. A call
goes out whole, once its JSON has closed and parsed, because a call cannot be taken back once sent
and a malformed one must come out as the plain text it was.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex digits
    name: str
    arguments: str  # a JSON object, serialized


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when there are tool calls and nothing else but whitespace
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class FoundCall:
    """A call a scanner found; it gets its id when it is handed out."""

    name: str
    arguments: str


Event = Union[str, FoundCall]  # content text, or a call
NOT_JSON = object()
TEXT = "text"  # scanner state: everything is content (up to the next marker, where there is one)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return NOT_JSON


def call_with(name: str, args: Any) -> FoundCall | None:
    """The call of `name` with these arguments; None if they cannot be a call's arguments."""
    if args is None:
        args = {}
    if isinstance(args, dict):
        return FoundCall(name, json.dumps(args, ensure_ascii=False))
    if isinstance(args, str):
        # Some models write the arguments as a JSON string: keep it when it holds an object.
        keep = isinstance(load_json(args), dict)
        return FoundCall(name, args if keep else json.dumps(args, ensure_ascii=False))
    return None


def call_from_json(obj: Any, require_arguments: bool = False) -> FoundCall | None:
    """The call that {"name": ..., "arguments" | "parameters": ...} stands for; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "arguments" not in obj and "parameters" not in obj and require_arguments:
        return None
    return call_with(obj["name"], obj["arguments"] if "arguments" in obj else obj.get("parameters"))


# The start of a call object cut short: its name (perhaps unfinished), then perhaps its arguments.
_PARTIAL_CALL = re.compile(r'\s*\{\s*(?:"name"\s*:\s*(?:"((?:[^"\\]|\\.)*)("?))?)?(\s*,\s*"(?:arguments|parameters)"\s*:)?',
                           re.DOTALL)
_ARGUMENTS_KEYS = (',"arguments":', ',"parameters":')


def partial_call(text: str, names: Sequence[str]) -> FoundCall | None:
    """The call that `text`, the start of a {"name": ..., "arguments" | "parameters": ...} object
    cut short by max_tokens, was becoming: its arguments as far as they went. An unfinished name
    stands for the one function of `names` it can still become; None if it can become none or
    several, or if `text` is no such start."""
    match = _PARTIAL_CALL.match(text)
    if match is None:
        return None
    name, closed, key = match.groups()
    rest = text[match.end():]
    if key is None:
        compact = re.sub(r"\s", "", rest)
        if compact and not (closed and any(k.startswith(compact) for k in _ARGUMENTS_KEYS)):
            return None
        rest = ""
    candidates = [n for n in names if n == name] if closed else [n for n in names if n.startswith(name or "")]
    if len(candidates) != 1:
        return None
    return FoundCall(candidates[0], rest.strip())


def _marker_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could still grow into `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class _JsonEnd:
    """Where the bracketed JSON value that opens a growing text closes. It resumes where it
    stopped, so a value that arrives in a thousand deltas is still read once."""

    def __init__(self) -> None:
        self._pos = self._depth = 0
        self._in_string = self._escaped = False

    def find(self, text: str) -> int | None:
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for i in range(self._pos, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    return i + 1
        self._pos, self._depth, self._in_string, self._escaped = len(text), depth, in_string, escaped
        return None


def _header(index: int, call_id: str, name: str) -> dict:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def _fragment(index: int, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


class ToolCallStreamer:
    """Turns one output's text deltas into OpenAI chat `delta` dicts. A subclass scans one format
    in `_step`; this class turns what it finds into deltas. With `max_calls` (parallel_tool_calls
    false: 1) the output ends after that many calls: what follows is dropped, calls and text."""

    def __init__(self, names: Sequence[str] = (), max_calls: int | None = None) -> None:
        self._names = tuple(names)  # the request's functions: an unfinished name may tell which
        self._max_calls = max_calls
        self._cut = False  # the output was cut by max_tokens: an unfinished call goes out as it is
        self._buf = ""  # text seen, not decided yet
        self._raw = ""  # text taken for the call being read: content after all if it is malformed
        self._state = "start"
        self._end = _JsonEnd()
        self._seen = 0  # how far a marker search has already looked
        self._num_tool_calls = 0
        self._spoke = False  # some non-whitespace content went out
        self._blank = ""  # whitespace-only content, held: dropped if the output turns out to be calls

    @property
    def num_tool_calls(self) -> int:
        return self._num_tool_calls

    def feed(self, delta: str) -> list[dict]:
        return self._deltas(self._scan(delta, final=False))

    def finish(self, cut: bool = False) -> list[dict]:
        """The deltas left at the end; `cut` (max_tokens ended the output): a call under way goes
        out with its arguments as far as they went, as OpenAI's do."""
        self._cut = cut
        out = self._deltas(self._scan("", final=True))
        if self._blank and not self._num_tool_calls:
            out.append({"content": self._blank})
        self._blank = ""
        return out

    def parse_whole(self, text: str, cut: bool = False) -> ParsedOutput:
        """A fresh streamer's scan of a whole output at once: `ToolParser.parse`."""
        self._cut = cut
        events = self._within_max_calls(self._scan(text, final=True), 0)
        calls = [ToolCall(new_call_id(), e.name, e.arguments) for e in events if isinstance(e, FoundCall)]
        content = "".join(e for e in events if isinstance(e, str))
        return ParsedOutput(None if calls and not content.strip() else content, calls)

    def _scan(self, text: str, final: bool) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events, final):
            pass
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Decide what can be decided at the start of the buffer; True to be called again."""
        raise NotImplementedError

    def _within_max_calls(self, events: list[Event], made: int) -> list[Event]:
        """`events` up to the call that reaches max_calls, counting the `made` calls before them."""
        if self._max_calls is None:
            return events
        for i, event in enumerate(events):
            if made >= self._max_calls:
                return events[:i]
            made += isinstance(event, FoundCall)
        return events

    def _deltas(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        text = ""
        for event in self._within_max_calls(events, self._num_tool_calls):
            if isinstance(event, str):
                text += event
                continue
            self._say(text, out)
            text = ""
            index = self._num_tool_calls
            self._num_tool_calls += 1
            out += [_header(index, new_call_id(), event.name), _fragment(index, event.arguments)]
        self._say(text, out)
        return out

    def _say(self, text: str, out: list[dict]) -> None:
        if not self._spoke:
            self._blank += text
            if not self._blank.strip():
                return
            text, self._blank, self._spoke = self._blank, "", True
        if text:
            out.append({"content": text})

    # Helpers for _step.

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        return taken

    def _enter(self, state: str) -> bool:
        self._state, self._end, self._seen = state, _JsonEnd(), 0
        return True

    def _fail(self, events: list[Event]) -> bool:
        """The call being read is malformed: the text taken for it is content after all."""
        events.append(self._raw)
        self._raw = ""
        return self._enter(TEXT)

    def _wait(self, events: list[Event], final: bool) -> bool:
        """Undecidable until more text comes; at the end none will, so the call is malformed, or,
        when max_tokens cut it, unfinished: it goes out as far as it went."""
        if not final:
            return False
        if not self._cut:
            return self._fail(events)
        # What went into a call is no content, even where it cannot make a call ("[", a marker, a
        # name that could be either of two functions).
        call = self._partial()
        if call is not None:
            events.append(call)
        self._raw = self._buf = ""
        self._enter(TEXT)
        return False

    def _partial(self) -> FoundCall | None:
        """The call under way at a cut, from the text not taken yet; a scanner whose state is a
        call object's start ("object") reads it with `partial_call`."""
        return partial_call(self._buf, self._names) if self._state == "object" else None

    def _done(self, events: list[Event], call: FoundCall | None, then: str = TEXT) -> bool:
        if call is None:
            return self._fail(events)
        events.append(call)
        self._raw = ""
        return self._enter(then)

    def _until(self, marker: str, events: list[Event], final: bool) -> bool:
        """Content up to `marker`, which goes into _raw; False while it has not come."""
        at = self._buf.find(marker)
        if at < 0:
            keep = 0 if final else _marker_tail(self._buf, marker)
            events.append(self._take(len(self._buf) - keep))
            return False
        events.append(self._take(at))
        self._raw = self._take(len(marker))
        return True

    def _next_char(self) -> str:
        """Take leading whitespace into _raw; the next character, or "" if none has come yet."""
        self._raw += self._take(len(self._buf) - len(self._buf.lstrip()))
        return self._buf[:1]

    def _closed_value(self) -> str | None:
        """The JSON value that opens the buffer, taken into _raw once it has closed."""
        end = self._end.find(self._buf)
        if end is None:
            return None
        value = self._take(end)
        self._raw += value
        return value


class NamedCallStreamer(ToolCallStreamer):
    """Streams the output of a named `tool_choice`: the arguments object of that one function.

    The grammar makes that output valid JSON, so it goes out as argument fragments as it comes
    instead of being held back; only a length cut can leave the arguments unfinished."""

    def __init__(self, name: str) -> None:
        super().__init__((name,))
        self._name = name

    def feed(self, delta: str) -> list[dict]:
        if not delta:
            return []
        out = [] if self._num_tool_calls else [_header(0, new_call_id(), self._name)]
        self._num_tool_calls = 1
        return out + [_fragment(0, delta)]

    def finish(self, cut: bool = False) -> list[dict]:
        return []


def forced_named_call(name: str, text: str, cut: bool = False) -> ParsedOutput:
    """The output of a named `tool_choice`, whose whole text is the arguments object of `name`;
    `cut` by max_tokens, the arguments as far as they went."""
    args = load_json(text)
    if not isinstance(args, dict):
        if cut:
            return ParsedOutput(None, [ToolCall(new_call_id(), name, text.strip())])
        return ParsedOutput(text, [])
    return ParsedOutput(None, [ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))])
