"""Structured output: request fields -> a grammar spec -> a compiled grammar for the engine.

The API layer reads `response_format` (OpenAI), `structured_outputs` (vLLM's extension) and
`tool_choice` into a `GrammarSpec`, compiles it with xgrammar and passes the result in
`SamplingParams.grammar`; the engine only sees the `flashserve.structured.grammar` protocol.

Compiling takes milliseconds to seconds depending on the schema, so it runs in worker threads (the
event loop keeps serving), results are kept in an LRU cache keyed by the spec (clients repeat the
same schema on every request), and concurrent requests with the same new spec share one
compilation. Bad user input (a malformed schema, regex or grammar) becomes an `InvalidParameter`
naming the request field, so the client gets a 400 rather than a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import threading
from collections import OrderedDict
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

from flashserve.message.grammar_spec import GrammarSpec
from flashserve.message.sampling_params import InvalidParameter
from flashserve.structured.tool_format import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN

if TYPE_CHECKING:
    import xgrammar as xgr


def _xgr() -> ModuleType:
    """xgrammar, imported on first use: it imports torch (about 1.5 s), which an app process that
    serves no grammar never needs (run-batch's)."""
    import xgrammar

    return xgrammar


# vLLM `structured_outputs` keys that pick the output form, and keys we accept and ignore: JSON
# output never has free whitespace here, and there is no other backend to fall back to.
_FORMS = ("json", "json_object", "regex", "choice", "grammar")
_IGNORED = frozenset({"disable_fallback", "disable_any_whitespace"})
# xgrammar's form of a JSON string with maxLength: `"\"" <chars>{min, max} "\""`.
_BOUNDED_STRING = re.compile(r'"\\"" (\w+)\{(\d+), (\d+)\} "\\""')
# Longer bounds stay as xgrammar writes them: an unrolled string compiles one rule per character.
_UNROLL_MAX_LENGTH = 256
# xgrammar's character of a string with minLength or maxLength (`<name>_characters ::= ...`), and
# a JSON string's unescaped character, as its own free strings (`basic_string_sub`) have it.
_BOUNDED_CHARACTER = re.compile(r"^(\w+) ::= " + re.escape(r'(([^\"\\\r\n]))') + "$", re.MULTILINE)
_JSON_CHARACTER = r'[^\0-\x1f\"\\\r\n]'
# Numbers in xgrammar's JSON grammars: unbounded digit runs, which a small model can fill until
# max_tokens ("11111..."). A digit rule (`name ::= (([0-9]))`), its open-ended repetitions, the
# exponent's among them, and the free digits after a number's first.
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.MULTILINE)
_OPEN_REPEAT = re.compile(r"(\[eE\] \w+ )?\b(\w+)\{(\d+), -1\}")
_FREE_DIGITS = "[1-9] [0-9]*"
# At most 19 digits before the point (an int64's), 17 after it (a double's significant digits), 3
# in an exponent.
MAX_INTEGER_DIGITS, MAX_FRACTION_DIGITS, MAX_EXPONENT_DIGITS = 19, 17, 3
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: " (and sometimes "Check failed").
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _schema_text(schema: Any, param: str) -> str:
    """A schema as compact JSON. Key order is kept, not sorted: xgrammar makes properties appear
    in their declared order, so two schemas that differ only in order are different grammars."""
    if not isinstance(schema, dict):
        raise InvalidParameter(param, f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        raise InvalidParameter(param, f"the JSON schema is not valid JSON: {exc}") from None


def _response_format_spec(rf: dict) -> GrammarSpec | None:
    param = "response_format"
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind != "json_schema":
        raise InvalidParameter(param, f"response_format.type must be text, json_object or json_schema: {kind!r}")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise InvalidParameter(param, "response_format.json_schema must be an object with 'name' and 'schema'")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise InvalidParameter(param, "response_format.json_schema.name must be a non-empty string")
    if "schema" not in js:
        raise InvalidParameter(param, "response_format.json_schema.schema is required")
    if not isinstance(js.get("strict", False), (bool, type(None))):
        raise InvalidParameter(param, "response_format.json_schema.strict must be a boolean")
    return GrammarSpec("json", _schema_text(js["schema"], param), param)


def _structured_outputs_spec(so: dict) -> GrammarSpec:
    param = "structured_outputs"
    given = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_FORMS) - _IGNORED)
    if unknown:
        raise InvalidParameter(param, f"structured_outputs.{unknown[0]} is not supported")
    forms = [k for k in _FORMS if k in given]
    if len(forms) != 1:
        raise InvalidParameter(param, f"structured_outputs needs exactly one of {', '.join(_FORMS)}")
    form, value = forms[0], given[forms[0]]
    if form == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidParameter(param, f"structured_outputs.json is not valid JSON: {exc}") from None
        return GrammarSpec("json", _schema_text(value, param), param)
    if form == "json_object":
        if value is not True:
            raise InvalidParameter(param, "structured_outputs.json_object must be a boolean")
        return GrammarSpec("json_object", "", param)
    if form == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidParameter(param, "structured_outputs.choice must be a non-empty list of strings")
        return GrammarSpec("choice", json.dumps(value, ensure_ascii=False), param)
    if not isinstance(value, str) or not value:
        raise InvalidParameter(param, f"structured_outputs.{form} must be a non-empty string")
    return GrammarSpec(form, value, param)  # type: ignore[arg-type]


def spec_from_request(response_format: dict | None, structured_outputs: dict | None) -> GrammarSpec | None:
    """The grammar the request asks for, or None for free text; InvalidParameter if malformed."""
    if response_format is not None and structured_outputs is not None:
        raise InvalidParameter("response_format", "give only one of response_format and structured_outputs")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise InvalidParameter("response_format", "response_format must be an object")
        return _response_format_spec(response_format)
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise InvalidParameter("structured_outputs", "structured_outputs must be an object")
        return _structured_outputs_spec(structured_outputs)
    return None


def _tool_functions(tools: Any) -> dict[str, dict]:
    """Tool name -> parameters schema, checking the OpenAI tool objects."""
    if not isinstance(tools, list) or not tools:
        raise InvalidParameter("tools", "tools must be a non-empty list of tool objects")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidParameter("tools", f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidParameter("tools", f"tools[{i}].function.name must be a non-empty string")
        if name in out:
            raise InvalidParameter("tools", f"tools has two functions named {name!r}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object"}
        if not isinstance(params, dict):
            raise InvalidParameter("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = params
    return out


# Keywords whose values are data, not schemas, and those whose values map names to schemas.
_LITERAL_KEYS = frozenset({"enum", "const", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _relocate_refs(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s ("#/...") pointing below `base`, for embedding it in a
    larger schema where "#" is no longer its root. Literal values (enum, const, ...) are kept."""
    if isinstance(schema, list):
        return [_relocate_refs(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _LITERAL_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # a property may be named "enum"
            out[key] = {name: _relocate_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = _relocate_refs(value, base)
    return out


def tool_call_spec(tools: list[dict] | None, tool_choice: Any, parallel: bool = True) -> GrammarSpec | None:
    """The grammar forced by `tool_choice`, or None when the model may answer freely.

    "required": a non-empty JSON array of {"name": <a tool name>, "parameters": <its arguments>},
    of one element where not `parallel`; a named function: that function's arguments object alone.
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tools is None:
        raise InvalidParameter("tool_choice", "tool_choice needs tools to choose from")
    functions = _tool_functions(tools)
    if tool_choice == "required":
        defs: dict[str, Any] = {}
        calls = []
        for i, (name, params) in enumerate(functions.items()):
            defs[f"tool_{i}"] = _relocate_refs(params, f"#/$defs/tool_{i}")
            properties = {"name": {"type": "string", "const": name}, "parameters": {"$ref": f"#/$defs/tool_{i}"}}
            calls.append({"type": "object", "properties": properties, "required": ["name", "parameters"],
                          "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
        if not parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json", _schema_text(schema, "tools"), "tools")
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidParameter(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        )
    name = fn.get("name")
    if name not in functions:
        raise InvalidParameter("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
    return GrammarSpec("json", _schema_text(functions[name], "tools"), "tools")


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal matching exactly it. Control characters use \\u, which
    takes exactly four digits (xgrammar's \\x reads every hex digit that follows)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def json_string_characters(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with the characters of its length-bounded strings
    (minLength, maxLength) limited to those JSON allows unescaped in a string.

    xgrammar (0.2.8, its issue #800) lets such a character be anything but a quote, a backslash,
    CR or LF, so the other control characters (U+0000-U+001F) get in: a model that samples a raw
    tab inside a bounded string ends its grammar with text that `json.loads` rejects. The bounds
    count characters as before; other grammars come back unchanged.
    """
    return _BOUNDED_CHARACTER.sub(lambda m: f"{m.group(1)} ::= {_JSON_CHARACTER}", ebnf)


def unroll_bounded_strings(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with each length-bounded string (maxLength <= 256) as a
    chain of rules, one per character count, each ending the string or taking one more character.

    The same language, but xgrammar (0.2.8, its issue #852) fills the token mask inside a counted
    repetition by walking the vocabulary at every step, up to ~10 ms a row near the bound on a
    128k vocabulary, while each rule of the chain gets its mask precomputed at compile time
    (~0.02 ms). Other grammars come back unchanged.
    """
    rules: list[str] = []

    def chain(match: re.Match[str]) -> str:
        body, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if high > _UNROLL_MAX_LENGTH:
            return match.group(0)
        name = f"{body}_bounded_{len(rules)}"
        for count in range(high + 1):
            ends = ['"\\""'] if count >= low else []
            more = [f"{body} {name}_{count + 1}"] if count < high else []
            rules.append(f"{name}_{count} ::= " + " | ".join(ends + more))
        return f'"\\"" {name}_0'

    out = _BOUNDED_STRING.sub(chain, ebnf)
    return out + "\n" + "\n".join(rules) + "\n" if rules else ebnf


def _digits(low: int, high: int) -> str:
    """EBNF for `low` to `high` digits, the optional ones nested (`[0-9] ([0-9])?`): a chain of
    rules with masks precomputed at compile time, unlike a counted repetition (see
    `unroll_bounded_strings`)."""
    optional = ""
    for _ in range(high - low):
        optional = f"([0-9] {optional})?" if optional else "([0-9])?"
    return " ".join(["[0-9]"] * low + ([optional] if optional else [])) or '""'


def bound_numbers(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with every number bounded to what its type can hold: at
    most MAX_INTEGER_DIGITS digits before the point, MAX_FRACTION_DIGITS after it and
    MAX_EXPONENT_DIGITS in an exponent, where the schema's minimum and maximum do not bound it
    already. xgrammar (0.2.8) lets digits run on, and a model that keeps writing them ends only at
    max_tokens, with no JSON at all."""
    digit_rules = set(_DIGIT_RULE.findall(ebnf))

    def repeat(match: re.Match[str]) -> str:
        exponent, name, low = match.group(1), match.group(2), int(match.group(3))
        if name not in digit_rules:
            return match.group(0)
        high = MAX_EXPONENT_DIGITS if exponent else MAX_FRACTION_DIGITS
        return f"{exponent or ''}{_digits(low, max(low, high))}"

    ebnf = _OPEN_REPEAT.sub(repeat, ebnf)
    return ebnf.replace(_FREE_DIGITS, f"[1-9] {_digits(0, MAX_INTEGER_DIGITS - 1)}")


def json_grammar(ebnf: str) -> str:
    """xgrammar's EBNF of a JSON schema as this server compiles it: strings hold only what JSON
    allows, length-bounded strings are unrolled, numbers are bounded."""
    return bound_numbers(unroll_bounded_strings(json_string_characters(ebnf)))


def generic_tool_spec(tools: list[dict], parallel: bool = True) -> GrammarSpec:
    """The grammar of `tool_choice: "auto"` in the generic format (`tool_format.py`): any text, in
    which a `<tool_call>` must go on as a call of one of `tools` with arguments that follow its
    schema, and close; any number of calls, or where not `parallel`, one, which ends the output.
    The text never writes a tool result's tag: a small model that has seen results in the
    conversation would otherwise make one up."""
    tags = [{"begin": f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": 1},
             "end": f"}}\n{CALL_CLOSE}"} for name, params in _tool_functions(tools).items()]
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags,
                                                "at_least_one": False, "stop_after_first": not parallel,
                                                "excludes": [RESULT_OPEN[:-1], RESULT_CLOSE[:-1], CALL_CLOSE[:-1]]}}
    return GrammarSpec("structural_tag", _schema_text(tag, "tools"), "tools")


class XGrammar:
    """A compiled grammar; the engine makes one matcher per request from it."""

    def __init__(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar,
                 batch: xgr.BatchGrammarMatcher | None = None) -> None:
        self.spec = spec
        self.compiled = compiled
        self._batch = batch if batch is not None else _xgr().BatchGrammarMatcher(max_threads=1)
        # A matcher terminates when it accepts one of these (the model's EOS ids).
        self._stop_ids = frozenset(compiled.tokenizer_info.stop_token_ids)

    def new_matcher(self) -> xgr.GrammarMatcher:
        return _xgr().GrammarMatcher(self.compiled)

    def advance(self, matchers: Sequence[xgr.GrammarMatcher], token_ids: Sequence[int]) -> list[tuple[bool, bool]]:
        """Every matcher takes its token in one call (any grammars of this compiler's tokenizer)."""
        accepted = _xgr().BatchGrammarMatcher.batch_accept_token(list(matchers), list(token_ids))
        return [(ok, ok and token in self._stop_ids) for ok, token in zip(accepted, token_ids)]

    def fill_bitmasks(self, matchers: Sequence[xgr.GrammarMatcher], bitmask: Any) -> None:
        """One batched call over every row of a step (on the compiler's threads)."""
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask)


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary, with an LRU cache.

    `vocab_size` is the model's logit width (it may exceed the tokenizer's vocabulary when the
    embedding is padded); masks are ceil(vocab_size / 32) words and padding ids are never allowed.
    `num_compiles` counts compilations; `num_cache_hits` counts requests served without starting
    one (a cached grammar, or one already being compiled for another request).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *, cache_size: int = 256,
                 max_threads: int | None = None) -> None:
        """max_threads: for compiling and for filling a step's masks (default: up to 8 cores)."""
        max_threads = max_threads or max(1, min(8, os.cpu_count() or 1))
        self.vocab_size = vocab_size
        self.tokenizer_info = _xgr().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        # xgrammar's own cache is unbounded; ours is bounded and also shares in-flight compiles.
        self._xgr = _xgr().GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._batch = _xgr().BatchGrammarMatcher(max_threads=max_threads)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, XGrammar] = OrderedDict()
        self._pending: dict[GrammarSpec, concurrent.futures.Future[XGrammar]] = {}
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0

    async def compile(self, spec: GrammarSpec) -> XGrammar:
        """The compiled grammar for `spec`; a miss compiles in a worker thread."""
        found = self._lookup(spec)
        if isinstance(found, XGrammar):
            return found
        # Shielded: one cancelled request must not cancel a compilation others are waiting for.
        return await asyncio.shield(asyncio.wrap_future(found))

    def compile_sync(self, spec: GrammarSpec) -> XGrammar:
        """`compile` for callers without an event loop (the offline API); it blocks."""
        found = self._lookup(spec)
        return found if isinstance(found, XGrammar) else found.result()

    def submit(self, spec: GrammarSpec) -> XGrammar | concurrent.futures.Future[XGrammar]:
        """The compiled grammar for `spec` if cached, else a future of it (compiling in a worker
        thread), for a caller that must not block (the engine core's loop)."""
        return self._lookup(spec)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _lookup(self, spec: GrammarSpec) -> XGrammar | concurrent.futures.Future[XGrammar]:
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                self.num_cache_hits += 1
                return grammar
            future = self._pending.get(spec)
            if future is not None:
                self.num_cache_hits += 1
                return future
            future = self._executor.submit(self._build, spec)
            self._pending[spec] = future
        future.add_done_callback(lambda f: self._finish(spec, f))
        return future

    def _finish(self, spec: GrammarSpec, future: concurrent.futures.Future[XGrammar]) -> None:
        """Caches a successful compile; a failed one is forgotten, so it is retried (and fails
        again with the same message) rather than cached."""
        with self._lock:
            self._pending.pop(spec, None)
            if future.cancelled() or future.exception() is not None:
                return
            self._cache[spec] = future.result()
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _build(self, spec: GrammarSpec) -> XGrammar:
        with self._lock:
            self.num_compiles += 1
        what = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice",
                "structural_tag": "tool parameters schema"}
        try:
            return XGrammar(spec, self._compile(spec), self._batch)
        except (RuntimeError, ValueError) as exc:
            detail = _XGR_PREFIX.sub("", str(exc).strip()).strip()
            detail = detail.split(". The JSON string is:")[0]
            raise InvalidParameter(spec.param, f"invalid {what.get(spec.kind, 'grammar')}: {detail}") from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json":
            ebnf = str(_xgr().Grammar.from_json_schema(spec.value, any_whitespace=False))
            return self._xgr.compile_grammar(json_grammar(ebnf))
        if spec.kind == "structural_tag":
            return self._xgr.compile_grammar(json_grammar(str(_xgr().Grammar.from_structural_tag(spec.value))))
        if spec.kind == "json_object":
            # Any object (not any JSON value), on one line like the schema outputs.
            return self._xgr.compile_json_schema('{"type":"object"}', any_whitespace=False)
        if spec.kind == "regex":
            return self._xgr.compile_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return self._xgr.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
        if spec.kind == "grammar":
            return self._xgr.compile_grammar(spec.value)
        raise AssertionError(f"unknown grammar kind {spec.kind!r}")  # a bug, not bad input: no 400
