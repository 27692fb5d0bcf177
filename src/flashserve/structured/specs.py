"""What a request asks of the output, as a `GrammarSpec`: `response_format` (OpenAI),
`structured_outputs` (vLLM's extension), a forced `tool_choice`, or the generic tool-call format of
`tool_choice: "auto"`. The API layer builds specs; the engine core compiles them
(`structured/compiler.py`). Bad user input (a malformed schema or an unknown form) becomes an
`InvalidParameter` naming the request field, so the client gets a 400 rather than a 500.
"""

from __future__ import annotations

import json
from typing import Any

from flashserve.message.grammar_spec import GrammarSpec
from flashserve.message.sampling_params import InvalidParameter
from flashserve.structured.tool_format import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN

# vLLM `structured_outputs` keys that pick the output form, and keys we accept and ignore: JSON
# output never has free whitespace here, and there is no other backend to fall back to.
_FORMS = ("json", "json_object", "regex", "choice", "grammar")
_IGNORED = frozenset({"disable_fallback", "disable_any_whitespace"})


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
