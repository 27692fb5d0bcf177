"""Tool-call parsing: each format's outputs, and streaming that reassembles to what parse() gives."""

from __future__ import annotations

import json
import random
import re

import pytest

from flashserve.api.tools.parsers import (
    TOOL_PARSERS,
    NamedCallStreamer,
    ParsedOutput,
    detect_tool_parser,
    forced_named_call,
    get_tool_parser,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
# Unicode, escaped quotes, and brackets inside strings that must not end the JSON early.
NOTE_ARGS = {"title": 'Café "naïve" 東京 🚀', "body": "a } b ] c { d [ \\ e",
             "tags": ["x", {"k": [1, 2.5, None, True]}]}
NOTE = json.dumps({"name": "create_note", "arguments": NOTE_ARGS}, ensure_ascii=False)
NOTE_ESCAPED = json.dumps({"name": "create_note", "arguments": NOTE_ARGS})  # \uXXXX escapes
W = {"city": "Paris", "unit": "celsius"}
T = {"timezone": "Europe/Paris"}
SAME = "<the whole output>"  # expected content: the output as it is, with no calls


def call(s: str) -> str:
    return s.replace('"arguments"', '"parameters"')


def tagged(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# (parser, output, expected content, expected [(name, arguments object)])
EXAMPLES = [
    ("hermes", tagged(WEATHER), None, [("get_weather", W)]),
    ("hermes", tagged(WEATHER) + "\n" + tagged(TIME), None, [("get_weather", W), ("get_time", T)]),
    ("hermes", "Let me check the weather.\n" + tagged(WEATHER), "Let me check the weather.\n",
     [("get_weather", W)]),
    ("hermes", "The capital of France is Paris.", SAME, []),
    ("hermes", tagged(WEATHER[:-1]), SAME, []),
    ("hermes", tagged(NOTE), None, [("create_note", NOTE_ARGS)]),
    ("hermes", tagged(NOTE_ESCAPED), None, [("create_note", NOTE_ARGS)]),
    ("hermes", f"<tool_call>\n{WEATHER}\n", None, [("get_weather", W)]),  # stopped before the close tag
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu', SAME, []),
    ("hermes", tagged(WEATHER) + "\nDone.", "\nDone.", [("get_weather", W)]),
    ("hermes", tagged('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'), None,
     [("get_weather", {"city": "Paris"})]),
    ("hermes", "I like <tools> and <tool_calls", SAME, []),
    ("llama3_json", call(WEATHER), None, [("get_weather", W)]),
    ("llama3_json", "<|python_tag|>" + call(WEATHER), None, [("get_weather", W)]),
    ("llama3_json", call(WEATHER) + "; " + call(TIME), None, [("get_weather", W), ("get_time", T)]),
    ("llama3_json", WEATHER, None, [("get_weather", W)]),  # "arguments" works as well as "parameters"
    ("llama3_json", "Paris is the capital of France.", SAME, []),
    ("llama3_json", '{"city": "Paris"}', SAME, []),
    ("llama3_json", "{name} is a placeholder", SAME, []),
    ("llama3_json", call(WEATHER)[:-1], SAME, []),
    ("llama3_json", "Sure: " + call(WEATHER), SAME, []),
    ("llama3_json", "\n " + call(NOTE), None, [("create_note", NOTE_ARGS)]),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', SAME, []),
    ("mistral", f"[TOOL_CALLS][{WEATHER}]", None, [("get_weather", W)]),
    ("mistral", f"[TOOL_CALLS][{WEATHER}, {TIME}]", None, [("get_weather", W), ("get_time", T)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None,
     [("get_weather", W)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}', None, [("get_weather", W), ("get_time", T)]),
    ("mistral", f"Let me look.[TOOL_CALLS][{WEATHER}]", "Let me look.", [("get_weather", W)]),
    ("mistral", "No tools needed [TOOL] here.", SAME, []),
    ("mistral", f"[TOOL_CALLS][{WEATHER[:-1]}]", SAME, []),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}", SAME, []),
    ("mistral", "[TOOL_CALLS]create_note[ARGS]" + json.dumps(NOTE_ARGS, ensure_ascii=False), None,
     [("create_note", NOTE_ARGS)]),
    ("mistral", f"[TOOL_CALLS] [{NOTE_ESCAPED}]", None, [("create_note", NOTE_ARGS)]),
    ("forced", f"[{call(WEATHER)}]", None, [("get_weather", W)]),
    ("forced", f"[{call(WEATHER)}, {call(TIME)}]", None, [("get_weather", W), ("get_time", T)]),
    ("forced", f"[{call(NOTE)}]", None, [("create_note", NOTE_ARGS)]),
    ("forced", f"[{call(WEATHER)[:-3]}", SAME, []),  # cut by max_tokens
    ("forced", f"[{call(WEATHER)}, {call(TIME)[:20]}", ", " + call(TIME)[:20], [("get_weather", W)]),
    ("forced", "[]", SAME, []),
    ("forced", "not json", SAME, []),
]
IDS = [f"{i}-{parser}" for i, (parser, *_) in enumerate(EXAMPLES)]


def reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """The content and the calls a client gets by concatenating the deltas."""
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"}
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["type"] == "function"
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in range(len(calls))]


def stream(parser_name: str, chunks: list[str]) -> tuple[str, list[dict], int]:
    streamer = get_tool_parser(parser_name).streamer()
    deltas = [d for chunk in chunks for d in streamer.feed(chunk)] + streamer.finish()
    return (*reassemble(deltas), streamer.num_tool_calls)


def assert_same(parsed: ParsedOutput, streamed: tuple[str, list[dict], int]) -> None:
    content, calls, num = streamed
    assert content == (parsed.content or "")
    assert [c["name"] for c in calls] == [c.name for c in parsed.tool_calls]
    assert [json.loads(c["arguments"]) for c in calls] == [json.loads(c.arguments) for c in parsed.tool_calls]
    assert num == len(parsed.tool_calls)


@pytest.mark.parametrize("parser_name, text, content, calls", EXAMPLES, ids=IDS)
def test_parse_gives_the_recorded_calls_and_content(parser_name, text, content, calls):
    parsed = get_tool_parser(parser_name).parse(text)
    assert parsed.content == (text if content is SAME else content)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize("parser_name, text", [(p, t) for p, t, *_ in EXAMPLES], ids=IDS)
def test_stream_split_at_any_boundary_reassembles_to_parse(parser_name, text):
    parsed = get_tool_parser(parser_name).parse(text)
    for i in range(len(text) + 1):
        assert_same(parsed, stream(parser_name, [text[:i], text[i:]]))


@pytest.mark.parametrize("parser_name, text", [(p, t) for p, t, *_ in EXAMPLES], ids=IDS)
def test_stream_one_character_at_a_time_reassembles_to_parse(parser_name, text):
    assert_same(get_tool_parser(parser_name).parse(text), stream(parser_name, list(text)))


@pytest.mark.parametrize("parser_name, text", [(p, t) for p, t, *_ in EXAMPLES], ids=IDS)
def test_stream_in_random_chunks_reassembles_to_parse(parser_name, text):
    rng = random.Random(1234)
    parsed = get_tool_parser(parser_name).parse(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert_same(parsed, stream(parser_name, chunks))


PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "</tool_", tagged(WEATHER), WEATHER,
               f"<tool_call>\n{NOTE}\n</tool_call>", "{oops}", "Hi there. ", "\n", " ", "<", '"', "\\"],
    "llama3_json": [call(WEATHER), call(TIME), "; ", ";", "<|python_tag|>", "<|pyth", " ", "\n", "{", "}",
                    '{"x": 1}', "text ", call(NOTE)[:25], '"', "{name}"],
    "mistral": ["[TOOL_CALLS]", "[TOOL", f"[{WEATHER}]", "get_time[ARGS]", '{"timezone": "UTC"}', "[ARGS]",
                "f", " ", "Hello ", "[", "]", "{", "}", f"[{NOTE}, {TIME}]", "bad name",
                f"[TOOL_CALLS][{WEATHER}]", '[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}'],
    "forced": ["[", "]", ", ", call(WEATHER), call(TIME), " ", "\n", "{", "}", "text", call(NOTE)[:40],
               f"[{call(WEATHER)}", f"[{call(TIME)}]", f", {call(NOTE)}"],
}


@pytest.mark.parametrize("parser_name", sorted(PIECES))
def test_random_mixes_of_markers_calls_and_text_stream_like_they_parse(parser_name):
    rng = random.Random(99)
    parser = get_tool_parser(parser_name)
    for _ in range(300):
        text = "".join(rng.choices(PIECES[parser_name], k=rng.randint(1, 6)))
        parsed = parser.parse(text)
        cuts = sorted(set(rng.choices(range(len(text) + 1), k=rng.randint(0, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert_same(parsed, stream(parser_name, chunks))
        assert_same(parsed, stream(parser_name, list(text)))


def test_arguments_are_json_dumped_without_ascii_escapes():
    parsed = get_tool_parser("hermes").parse(f"<tool_call>{NOTE_ESCAPED}</tool_call>")
    assert parsed.tool_calls[0].arguments == json.dumps(NOTE_ARGS, ensure_ascii=False)


def test_string_arguments_that_are_not_an_object_are_kept_as_a_json_string():
    parsed = get_tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": "just text"}</tool_call>')
    assert json.loads(parsed.tool_calls[0].arguments) == "just text"


def test_hermes_call_without_arguments_gets_an_empty_object():
    parsed = get_tool_parser("hermes").parse('<tool_call>{"name": "list_files"}</tool_call>')
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("list_files", "{}")]


def test_hermes_malformed_call_is_content_and_the_next_call_still_parses():
    text = f"<tool_call>{{oops}}</tool_call>\n<tool_call>{TIME}</tool_call>"
    parsed = get_tool_parser("hermes").parse(text)
    assert parsed.content == "<tool_call>{oops}</tool_call>\n"
    assert [c.name for c in parsed.tool_calls] == ["get_time"]


def test_near_marker_prefix_is_held_then_released_as_content():
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("I like <tool") == [{"content": "I like "}]
    assert streamer.feed("s are fun") == [{"content": "<tools are fun"}]
    assert streamer.finish() == []
    assert streamer.num_tool_calls == 0


def test_mistral_near_marker_prefix_comes_out_as_content():
    streamer = get_tool_parser("mistral").streamer()
    assert streamer.feed("See [TOOL_") == [{"content": "See "}]
    assert streamer.feed("CALLZ]") == [{"content": "[TOOL_CALLZ]"}]


def test_near_marker_prefix_at_the_end_is_flushed_by_finish():
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("a <tool_") == [{"content": "a "}]
    assert streamer.finish() == [{"content": "<tool_"}]


@pytest.mark.parametrize("parser_name", ["hermes", "mistral", "llama3_json"])
def test_plain_text_streams_without_holding_back(parser_name):
    streamer = get_tool_parser(parser_name).streamer()
    assert streamer.feed("Hello") == [{"content": "Hello"}]
    assert streamer.feed(", world.") == [{"content": ", world."}]


def test_call_is_sent_as_header_then_arguments_once_its_json_closes():
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("<tool_call>\n" + WEATHER[:30]) == []
    header, fragment = streamer.feed(WEATHER[30:] + "\n</tool_call>")
    call_id = header["tool_calls"][0].pop("id")
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id)
    assert header == {"tool_calls": [{"index": 0, "type": "function",
                                      "function": {"name": "get_weather", "arguments": ""}}]}
    assert fragment == {"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(W)}}]}
    assert streamer.num_tool_calls == 1


def test_whitespace_between_calls_is_not_streamed_as_content():
    streamer = get_tool_parser("hermes").streamer()
    deltas = streamer.feed(tagged(WEATHER) + "\n\n" + tagged(TIME) + "\n") + streamer.finish()
    assert all("content" not in d for d in deltas)


def test_whitespace_only_output_without_calls_is_content():
    assert get_tool_parser("hermes").parse("\n").content == "\n"
    assert stream("hermes", ["\n"])[0] == "\n"


def test_call_ids_are_unique_and_kept_within_a_stream():
    text = "".join(f"<tool_call>{WEATHER}</tool_call>" for _ in range(5))
    _, calls, _ = stream("hermes", list(text))
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == 5 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    parsed_ids = [c.id for c in get_tool_parser("hermes").parse(text).tool_calls]
    assert len(set(parsed_ids + ids)) == 10


# One output of each format with two calls (and, in hermes, text around them); the content before
# the first call.
TWO_CALLS = [("hermes", "Checking.\n" + tagged(WEATHER) + "\nAnd the time:\n" + tagged(TIME) + "\nDone.",
              "Checking.\n"),
             ("llama3_json", call(WEATHER) + "; " + call(TIME), None),
             ("mistral", "[TOOL_CALLS]" + json.dumps([json.loads(WEATHER), json.loads(TIME)]), None),
             ("forced", json.dumps([json.loads(call(WEATHER)), json.loads(call(TIME))]), None)]


@pytest.mark.parametrize("parser_name, text, before", TWO_CALLS, ids=[p for p, *_ in TWO_CALLS])
def test_with_one_call_at_most_parse_ends_the_output_after_the_first_call(parser_name, text, before):
    parsed = get_tool_parser(parser_name).parse(text, max_calls=1)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", W)]
    assert parsed.content == before


@pytest.mark.parametrize("parser_name, text, before", TWO_CALLS, ids=[p for p, *_ in TWO_CALLS])
def test_with_one_call_at_most_a_stream_ends_after_the_first_call(parser_name, text, before):
    streamer = get_tool_parser(parser_name).streamer(max_calls=1)
    deltas = [d for c in text for d in streamer.feed(c)] + streamer.finish()
    content, calls = reassemble(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", W)]
    assert content == (before or "") and streamer.num_tool_calls == 1
    assert {d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d} == {0}


def test_forced_named_call_takes_the_whole_output_as_arguments():
    parsed = forced_named_call("get_weather", json.dumps(W))
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", W)]


def test_forced_named_call_with_unfinished_json_is_content():
    assert forced_named_call("get_weather", '{"city": "Par') == ParsedOutput('{"city": "Par', [])


def test_named_call_streamer_streams_arguments_as_they_come():
    streamer = NamedCallStreamer("get_weather")
    chunks = ['{"city"', ': "Paris", "unit": ', '"celsius"}']
    deltas = [d for chunk in chunks for d in streamer.feed(chunk)] + streamer.finish()
    assert len(deltas) == 4 and streamer.num_tool_calls == 1
    content, calls = reassemble(deltas)
    assert content == "" and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == W


def test_tool_parsers_registry_names():
    assert sorted(TOOL_PARSERS) == ["forced", "hermes", "llama3_json", "mistral"]
    assert all(get_tool_parser(name).name == name for name in TOOL_PARSERS)


def test_unknown_tool_parser_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="forced, hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")


@pytest.mark.parametrize("template, expected", [
    ('{%- if tools %}<tool_call>\n{"name": <function-name>, "arguments": <args>}\n</tool_call>', "hermes"),
    ("{%- if message.tool_calls %}{{ '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
    ('{{- "<|python_tag|>" + tool_call.name + ".call(" }}', "llama3_json"),
    ('{{- "Environment: ipython\\n" }}Respond in the format {"name": function name, "parameters": dict}',
     "llama3_json"),
    ('{{- "Environment: ipython\\n" }}', None),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ("<tool_call> or [TOOL_CALLS]", None),
    ("", None),
    (None, None),
])
def test_detect_tool_parser_from_template(template, expected):
    assert detect_tool_parser(template) == expected


# ---- outputs cut by max_tokens ---------------------------------------------------------------

NAMES = ("get_weather", "get_time")


@pytest.mark.parametrize(("parser_name", "text", "names", "expected"), [
    ("forced", '[{"name":', ("get_weather",), [("get_weather", "")]),
    ("forced", '[{"name": "get_w', NAMES, [("get_weather", "")]),
    ("forced", '[{"name": "get_weather", "parameters": {"city": "Pa', NAMES, [("get_weather", '{"city": "Pa')]),
    ("forced", f'[{call(WEATHER)}, {{"name": "get_time", "parameters": {{"timez', NAMES,
     [("get_weather", json.dumps(W)), ("get_time", '{"timez')]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UT', NAMES, [("get_time", '{"zone": "UT')]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"ci', NAMES, [("get_weather", '{"ci')]),
])
def test_a_call_cut_by_max_tokens_keeps_its_arguments_as_far_as_they_went(parser_name, text, names, expected):
    parsed = get_tool_parser(parser_name).parse(text, names, cut=True)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected
    assert not (parsed.content or "").strip()


def test_a_cut_call_whose_name_may_be_either_function_is_dropped_not_shown_as_content():
    parsed = get_tool_parser("forced").parse('[{"name": "get_', NAMES, cut=True)
    assert parsed.tool_calls == [] and not parsed.content


def test_a_cut_stream_ends_with_the_partial_call_as_deltas():
    streamer = get_tool_parser("forced").streamer(("get_weather",))
    deltas = streamer.feed('[{"name": "get_weather", "parameters": {"ci') + streamer.finish(cut=True)
    content, calls = reassemble(deltas)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"ci')]


def test_a_cut_named_call_keeps_its_partial_arguments():
    parsed = forced_named_call("get_weather", '{"city": "Par', cut=True)
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Par')]


def test_plain_text_cut_by_max_tokens_stays_content():
    parsed = get_tool_parser("hermes").parse("The weather in Paris is", NAMES, cut=True)
    assert parsed == ParsedOutput("The weather in Paris is", [])
