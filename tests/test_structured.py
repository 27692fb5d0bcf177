"""Structured output: request fields -> grammar specs, compilation and caching, and matchers driven
with the embedded model's real tokens."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Any

import numpy as np
import pytest

import xgrammar as xgr

from flashserve.message.grammar_spec import GrammarSpec
from flashserve.message.sampling_params import InvalidParameter
from flashserve.structured.compiler import GrammarCompiler, XGrammar
from flashserve.structured.json_grammar import unroll_bounded_strings
from flashserve.structured.specs import generic_tool_spec, spec_from_request, tool_call_spec
from flashserve.structured.grammar import bitmask_words, step_bitmask

VOCAB = 49152

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "integer"}},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "score": {"type": "number"}},
            "required": ["id", "score"],
        },
    },
    "required": ["name", "color", "tags", "owner"],
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer, VOCAB, [smollm2_tokenizer.eos_token_id])


@pytest.fixture
def fresh_compiler(smollm2_tokenizer: Any) -> GrammarCompiler:
    """A compiler with zeroed counters and an empty cache (TokenizerInfo takes ~0.1 s)."""
    return GrammarCompiler(smollm2_tokenizer, VOCAB, [smollm2_tokenizer.eos_token_id], cache_size=4)


def drive(grammar: XGrammar, tokenizer: Any, text: str) -> tuple[int | None, bool]:
    """Feeds `text`'s tokens then EOS; (index of the first rejected token or None, terminated)."""
    matcher = grammar.new_matcher()
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    for i, token in enumerate(ids):
        if not matcher.accept_token(token):
            return i, matcher.is_terminated()
    return None, matcher.is_terminated()


def first_bad_token(tokenizer: Any, good: str, bad: str) -> int:
    """The index of the first token of `bad` that differs from `good`'s tokens."""
    g, b = (tokenizer.encode(t, add_special_tokens=False) for t in (good, bad))
    return next(i for i, (x, y) in enumerate(zip(g, b)) if x != y)


# ---- spec_from_request -------------------------------------------------------------------------


def test_response_format_text_is_no_grammar() -> None:
    assert spec_from_request({"type": "text"}, None) is None
    assert spec_from_request(None, None) is None


def test_response_format_json_object() -> None:
    assert spec_from_request({"type": "json_object"}, None) == GrammarSpec("json_object", "", "response_format")


def test_response_format_json_schema_keeps_property_order() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    spec = spec_from_request(rf, None)
    assert spec == GrammarSpec("json", json.dumps(schema, separators=(",", ":")), "response_format")
    assert spec.value.index('"b"') < spec.value.index('"a"')


@pytest.mark.parametrize(
    "rf",
    [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
    ],
    ids=["unknown-type", "no-json-schema", "no-name", "no-schema", "schema-not-object", "bad-strict"],
)
def test_response_format_errors_name_response_format(rf: dict) -> None:
    with pytest.raises(InvalidParameter) as err:
        spec_from_request(rf, None)
    assert err.value.param == "response_format"


@pytest.mark.parametrize(
    "so, kind, value",
    [
        ({"json": {"type": "integer"}}, "json", '{"type":"integer"}'),
        ({"json": '{"type": "integer"}'}, "json", '{"type":"integer"}'),
        ({"json_object": True}, "json_object", ""),
        ({"regex": r"\d+"}, "regex", r"\d+"),
        ({"choice": ["a", "b"]}, "choice", '["a", "b"]'),
        ({"grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
        ({"regex": "a", "json": None, "disable_fallback": True}, "regex", "a"),
    ],
    ids=["json-object", "json-string", "json_object", "regex", "choice", "grammar", "ignored-keys"],
)
def test_structured_outputs_forms(so: dict, kind: str, value: str) -> None:
    assert spec_from_request(None, so) == GrammarSpec(kind, value, "structured_outputs")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "so",
    [
        {},
        {"regex": "a", "choice": ["a"]},
        {"choice": []},
        {"choice": ["a", 1]},
        {"regex": 5},
        {"grammar": ""},
        {"json": "{not json"},
        {"json": [1, 2]},
        {"structural_tag": "{}"},
    ],
    ids=["none", "two", "empty-choice", "non-string-choice", "regex-type", "empty-grammar", "bad-json-text",
         "json-not-object", "unsupported-key"],
)
def test_structured_outputs_errors_name_structured_outputs(so: dict) -> None:
    with pytest.raises(InvalidParameter) as err:
        spec_from_request(None, so)
    assert err.value.param == "structured_outputs"


def test_both_fields_is_an_error() -> None:
    with pytest.raises(InvalidParameter, match="only one of") as err:
        spec_from_request({"type": "json_object"}, {"regex": "a"})
    assert err.value.param == "response_format"


# ---- tool_call_spec ----------------------------------------------------------------------------


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_tool_choice_auto_none_is_no_grammar(choice: Any) -> None:
    assert tool_call_spec([WEATHER], choice) is None


def test_tool_choice_required_is_array_of_calls() -> None:
    spec = tool_call_spec([WEATHER, CLOCK], "required")
    assert spec is not None and spec.kind == "json"
    schema = json.loads(spec.value)
    assert schema["type"] == "array" and schema["minItems"] == 1
    calls = schema["items"]["anyOf"]
    assert [c["properties"]["name"]["const"] for c in calls] == ["get_weather", "get_time"]
    assert all(c["required"] == ["name", "parameters"] and c["additionalProperties"] is False for c in calls)


def test_tool_choice_required_relocates_parameter_refs() -> None:
    params = {
        "type": "object",
        "properties": {"enum": {"$ref": "#/$defs/Unit"}, "unit": {"enum": [{"$ref": "#"}]}},
        "$defs": {"Unit": {"type": "string"}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    moved = json.loads(tool_call_spec([tool], "required").value)["$defs"]["tool_0"]["properties"]
    assert moved["enum"] == {"$ref": "#/$defs/tool_0/$defs/Unit"}  # a property named like a keyword
    assert moved["unit"] == {"enum": [{"$ref": "#"}]}  # enum values are data, left alone


def test_tool_choice_named_is_that_functions_parameters() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert json.loads(tool_call_spec([WEATHER, CLOCK], named).value) == WEATHER["function"]["parameters"]
    clock = {"type": "function", "function": {"name": "get_time"}}
    assert json.loads(tool_call_spec([WEATHER, CLOCK], clock).value) == {"type": "object"}


def test_tool_choice_unknown_name_is_an_error() -> None:
    with pytest.raises(InvalidParameter, match="nope") as err:
        tool_call_spec([WEATHER], {"type": "function", "function": {"name": "nope"}})
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        (None, "required", "tool_choice"),
        ([WEATHER], "always", "tool_choice"),
        ([{"type": "function"}], "required", "tools"),
        ([{"type": "function", "function": {"name": ""}}], "required", "tools"),
        ([WEATHER, WEATHER], "required", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required", "tools"),
    ],
    ids=["no-tools", "bad-choice", "no-function", "empty-name", "duplicate", "bad-parameters"],
)
def test_tool_errors_name_their_param(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidParameter) as err:
        tool_call_spec(tools, choice)
    assert err.value.param == param


# ---- matchers driven with real tokens ----------------------------------------------------------


def test_nested_schema_accepts_valid_and_rejects_invalid(compiler: GrammarCompiler, tokenizer: Any) -> None:
    grammar = compiler.compile_sync(GrammarSpec("json", json.dumps(NESTED_SCHEMA), "response_format"))
    good = json.dumps({"name": "Ada L", "color": "green", "tags": [1, 22], "owner": {"id": 7, "score": -1.5}})
    assert drive(grammar, tokenizer, good) == (None, True)
    bad = good.replace('"green"', '"pink"')
    assert drive(grammar, tokenizer, bad)[0] == first_bad_token(tokenizer, good, bad)


def test_json_output_has_no_free_whitespace(compiler: GrammarCompiler, tokenizer: Any) -> None:
    grammar = compiler.compile_sync(GrammarSpec("json", json.dumps(NESTED_SCHEMA), "response_format"))
    bad = '{ "name": "a"'
    assert tokenizer.decode(tokenizer.encode(bad, add_special_tokens=False)[:1]) == "{"
    assert drive(grammar, tokenizer, bad)[0] == 1  # "{" is fine, the space after it is not


BOUNDED = {
    "type": "object",
    "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 5}, "note": {"type": "string"}},
    "required": ["code", "note"],
}


@pytest.mark.parametrize("code, ok", [("ab", True), ("abcde", True), ("a", False), ("abcdef", False)])
def test_bounded_string_keeps_min_and_max_length(
    compiler: GrammarCompiler, tokenizer: Any, code: str, ok: bool
) -> None:
    grammar = compiler.compile_sync(GrammarSpec("json", json.dumps(BOUNDED), "response_format"))
    rejected, terminated = drive(grammar, tokenizer, json.dumps({"code": code, "note": "a longer free note"}))
    assert (rejected is None and terminated) == ok


def test_bounded_strings_compile_as_rule_chains() -> None:
    """xgrammar's counted repetition for maxLength is rewritten (its masks cost ~50x more per row);
    a free string and a bound too long to unroll are left as they are."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 40},
                                               "b": {"type": "string", "maxLength": 1000}}}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    unrolled = unroll_bounded_strings(ebnf)
    assert "{0, 40}" in ebnf and "{0, 40}" not in unrolled
    assert "{0, 1000}" in unrolled
    assert len(re.findall(r"_bounded_0_\d+ ::=", unrolled)) == 41  # one rule per length 0..40
    free = str(xgr.Grammar.from_json_schema(json.dumps(NESTED_SCHEMA), any_whitespace=False))
    assert unroll_bounded_strings(free) == free


# Each way xgrammar bounds a string: unrolled maxLength, maxLength too long to unroll, minLength only.
BOUNDED_FORMS = [{"maxLength": 5}, {"maxLength": 1000}, {"minLength": 1}]


@pytest.mark.parametrize("bounds", BOUNDED_FORMS)
def test_bounded_string_output_is_valid_json_without_raw_control_characters(
    compiler: GrammarCompiler, tokenizer: Any, bounds: dict
) -> None:
    """JSON forbids U+0000-U+001F unescaped in a string (json.loads rejects a raw tab); xgrammar's
    length-bounded string allowed every one of them but CR and LF, so a sampled tab ended a
    terminated grammar's output as text that is not JSON."""
    schema = {"type": "object", "properties": {"code": {"type": "string", **bounds}}, "required": ["code"]}
    grammar = compiler.compile_sync(GrammarSpec("json", json.dumps(schema), "structured_outputs"))
    assert drive(grammar, tokenizer, '{"code": "a b"}') == (None, True)
    for control in ("\t", "\x00", "\x0b", "\x1f"):
        rejected, _ = drive(grammar, tokenizer, '{"code": "a' + control + 'b"}')
        assert rejected is not None, repr(control)
    # No token the mask allows inside the string holds a control character.
    matcher = grammar.new_matcher()
    for token in tokenizer.encode('{"code": "a', add_special_tokens=False):
        assert matcher.accept_token(token)
    mask = step_bitmask([matcher], [grammar], VOCAB)
    assert mask is not None
    allowed = np.flatnonzero(np.unpackbits(mask.array()[0].view(np.uint8), bitorder="little")[:VOCAB])
    texts = tokenizer.batch_decode([[int(i)] for i in allowed])
    assert any("b" in t for t in texts)
    assert not [t for t in texts if re.search("[\x00-\x1f]", t)]


def test_advance_reports_acceptance_and_termination_as_the_matcher_does(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    grammar = compiler.compile_sync(GrammarSpec("json", json.dumps(BOUNDED), "response_format"))
    batched, single = grammar.new_matcher(), grammar.new_matcher()
    ids = tokenizer.encode(json.dumps({"code": "abc", "note": "n"}), add_special_tokens=False)
    for token in ids + [tokenizer.eos_token_id]:
        assert grammar.advance([batched], [token]) == [(single.accept_token(token), single.is_terminated())]
    assert single.is_terminated()
    assert grammar.advance([grammar.new_matcher()], [tokenizer.eos_token_id]) == [(False, False)]


def test_json_object_accepts_any_object_only(compiler: GrammarCompiler, tokenizer: Any) -> None:
    grammar = compiler.compile_sync(GrammarSpec("json_object", "", "response_format"))
    assert drive(grammar, tokenizer, json.dumps({"a": [1, {"b": None}], "c": "d"})) == (None, True)
    assert drive(grammar, tokenizer, "[1, 2]")[0] == 0


def test_regex(compiler: GrammarCompiler, tokenizer: Any) -> None:
    grammar = compiler.compile_sync(GrammarSpec("regex", r"\d{3}-[a-z]+", "structured_outputs"))
    assert drive(grammar, tokenizer, "123-abc") == (None, True)
    assert drive(grammar, tokenizer, "12-abc")[0] is not None


def test_choice_with_special_characters(compiler: GrammarCompiler, tokenizer: Any) -> None:
    choices = ['say "hi"\\n', "a.*b|(c)", "line\nbreak\tbad", "\x01\x7f", "é😀"]
    grammar = compiler.compile_sync(GrammarSpec("choice", json.dumps(choices), "structured_outputs"))
    for text in choices:
        assert drive(grammar, tokenizer, text) == (None, True), text
    rejected, _ = drive(grammar, tokenizer, "a.xb")
    assert rejected is not None
    assert drive(grammar, tokenizer, "a.*b|(c)x")[1] is False  # a prefix match is not enough


def test_ebnf_grammar(compiler: GrammarCompiler, tokenizer: Any) -> None:
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'
    grammar = compiler.compile_sync(GrammarSpec("grammar", ebnf, "structured_outputs"))
    assert drive(grammar, tokenizer, "(1+23+4)") == (None, True)
    assert drive(grammar, tokenizer, "(1+)")[0] is not None


def test_tool_call_required_output(compiler: GrammarCompiler, tokenizer: Any) -> None:
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["parameters"] = {
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/City"}},
        "required": ["city"],
        "$defs": {"City": {"type": "string", "enum": ["Paris", "Oslo"]}},
    }
    grammar = compiler.compile_sync(tool_call_spec([weather, CLOCK], "required"))
    calls = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    assert drive(grammar, tokenizer, json.dumps(calls)) == (None, True)
    assert drive(grammar, tokenizer, "[]")[1] is False
    bad = json.dumps([{"name": "get_weather", "parameters": {"city": "Rome"}}])
    assert drive(grammar, tokenizer, bad)[0] is not None
    assert drive(grammar, tokenizer, json.dumps([{"name": "get_news", "parameters": {}}]))[0] is not None


def test_a_required_call_without_parallel_calls_is_an_array_of_one(compiler: GrammarCompiler, tokenizer: Any) -> None:
    grammar = compiler.compile_sync(tool_call_spec([WEATHER, CLOCK], "required", parallel=False))
    one = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    assert drive(grammar, tokenizer, json.dumps(one)) == (None, True)
    assert drive(grammar, tokenizer, json.dumps(one + [{"name": "get_time", "parameters": {}}]))[0] is not None


def test_the_auto_grammar_without_parallel_calls_ends_after_the_first_call(
        compiler: GrammarCompiler, tokenizer: Any) -> None:
    from flashserve.api.tools.render import call_text

    call = call_text("get_weather", {"city": "Oslo"})
    one, parallel = (compiler.compile_sync(generic_tool_spec([WEATHER], parallel=p)) for p in (False, True))
    assert drive(one, tokenizer, "Let me look. " + call) == (None, True)
    assert drive(one, tokenizer, call + "\n" + call)[0] is not None
    assert drive(one, tokenizer, call + " Done.")[0] is not None
    assert drive(parallel, tokenizer, call + "\n" + call) == (None, True)


def test_step_bitmask_allows_exactly_the_grammar_tokens(compiler: GrammarCompiler, tokenizer: Any) -> None:
    choices = ["yes", "no"]
    grammar = compiler.compile_sync(GrammarSpec("choice", json.dumps(choices), "structured_outputs"))
    m1, m2 = grammar.new_matcher(), grammar.new_matcher()
    assert m2.accept_token(tokenizer.encode("n", add_special_tokens=False)[0])
    mask = step_bitmask([m1, None, m2], [grammar, None, grammar], VOCAB)
    assert mask is not None and mask.rows == [0, 2]
    array = mask.array()
    assert array.shape == (2, bitmask_words(VOCAB)) and array.dtype == np.int32
    allowed = [set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))) for row in array]
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    special = set(tokenizer.all_special_ids)
    ok0 = {i for i, t in enumerate(texts) if t and i not in special and any(c.startswith(t) for c in choices)}
    ok2 = {i for i, t in enumerate(texts) if t and i not in special and "o".startswith(t)}
    assert allowed[0] == ok0 and allowed[1] == ok2
    first = {tokenizer.encode(c, add_special_tokens=False)[0] for c in choices}
    assert first <= allowed[0] and tokenizer.encode(" the", add_special_tokens=False)[0] not in allowed[0]


def test_padded_vocab_masks_padding_ids(smollm2_tokenizer: Any) -> None:
    padded = GrammarCompiler(smollm2_tokenizer, VOCAB + 40, [smollm2_tokenizer.eos_token_id])
    grammar = padded.compile_sync(GrammarSpec("json_object", "", "response_format"))
    matcher = grammar.new_matcher()
    mask = step_bitmask([matcher], [grammar], VOCAB + 40)
    assert mask is not None and mask.array().shape == (1, bitmask_words(VOCAB + 40))
    bits = np.unpackbits(mask.array()[0].view(np.uint8), bitorder="little")
    assert bits[:VOCAB].any() and not bits[VOCAB:].any()
    assert matcher.accept_token(VOCAB + 3) is False


# ---- errors and the cache ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, words",
    [
        (GrammarSpec("json", '{"type":"nonsense"}', "response_format"), "nonsense"),
        (GrammarSpec("json", '{"type":"object","properties":{"a":{"$ref":"#/$defs/no"}}}', "tools"), "no"),
        (GrammarSpec("regex", "(abc", "structured_outputs"), "regex"),
        (GrammarSpec("grammar", "root ::= undefined_rule", "structured_outputs"), "undefined_rule"),
        (GrammarSpec("grammar", 'start ::= "a"', "structured_outputs"), "root"),
    ],
    ids=["bad-type", "dangling-ref", "regex", "undefined-rule", "no-root"],
)
def test_invalid_input_is_invalid_parameter(fresh_compiler: GrammarCompiler, spec: GrammarSpec, words: str) -> None:
    for _ in range(2):  # a failure is not cached: the second try fails the same way
        with pytest.raises(InvalidParameter, match=words) as err:
            fresh_compiler.compile_sync(spec)
        assert err.value.param == spec.param and ".cc:" not in str(err.value)
    assert fresh_compiler.num_compiles == 2
    ok = fresh_compiler.compile_sync(GrammarSpec("regex", "ok", "structured_outputs"))
    assert fresh_compiler.compile_sync(GrammarSpec("regex", "ok", "structured_outputs")) is ok
    assert fresh_compiler.num_cache_hits == 1


def test_same_spec_compiles_once(fresh_compiler: GrammarCompiler) -> None:
    spec = GrammarSpec("json", json.dumps(NESTED_SCHEMA), "response_format")
    first = asyncio.run(fresh_compiler.compile(spec))
    assert asyncio.run(fresh_compiler.compile(spec)) is first
    assert (fresh_compiler.num_compiles, fresh_compiler.num_cache_hits) == (1, 1)


def test_cache_evicts_least_recently_used(fresh_compiler: GrammarCompiler) -> None:
    specs = [GrammarSpec("regex", f"a{i}", "structured_outputs") for i in range(5)]
    for spec in specs[:4]:
        fresh_compiler.compile_sync(spec)
    fresh_compiler.compile_sync(specs[0])  # now the most recent
    fresh_compiler.compile_sync(specs[4])  # evicts specs[1]
    fresh_compiler.compile_sync(specs[0])
    fresh_compiler.compile_sync(specs[1])
    assert fresh_compiler.num_compiles == 6


def test_compile_runs_off_the_loop_and_concurrent_requests_share_it(fresh_compiler: GrammarCompiler) -> None:
    seen: list[int] = []
    real = fresh_compiler._compile

    def slow_compile(spec: GrammarSpec) -> Any:
        seen.append(threading.get_ident())
        time.sleep(0.2)
        return real(spec)

    fresh_compiler._compile = slow_compile  # type: ignore[method-assign]
    spec = GrammarSpec("regex", "[a-z]{2,5}", "structured_outputs")

    async def main() -> tuple[int, list[XGrammar], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        grammars = await asyncio.gather(*(fresh_compiler.compile(spec) for _ in range(5)))
        task.cancel()
        return threading.get_ident(), grammars, ticks

    loop_thread, grammars, ticks = asyncio.run(main())
    assert seen and all(t != loop_thread for t in seen)
    assert ticks >= 5  # the loop kept running while the grammar compiled
    assert fresh_compiler.num_compiles == 1 and all(g is grammars[0] for g in grammars)


def test_cancelled_waiter_does_not_cancel_shared_compile(fresh_compiler: GrammarCompiler) -> None:
    real = fresh_compiler._compile
    fresh_compiler._compile = lambda spec: (time.sleep(0.2), real(spec))[1]  # type: ignore[method-assign]
    spec = GrammarSpec("regex", "x+", "structured_outputs")

    async def main() -> XGrammar:
        doomed = asyncio.create_task(fresh_compiler.compile(spec))
        survivor = asyncio.create_task(fresh_compiler.compile(spec))
        await asyncio.sleep(0.05)
        doomed.cancel()
        return await survivor

    assert isinstance(asyncio.run(main()), XGrammar)
    assert fresh_compiler.num_compiles == 1
