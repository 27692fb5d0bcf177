"""Tools for a model whose chat template cannot show them: what a template renders, found by
probes, and the messages that carry the tools, earlier calls and tool results as text instead."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from jinja2 import Template

from flashserve.api.tools.parsers import get_tool_parser
from flashserve.api.tools.render import (
    ANSWER_AFTER_RESULT,
    ANSWER_AFTER_RESULTS,
    TemplateSupport,
    call_text,
    render_messages,
    template_support,
    tools_block,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


class JinjaTokenizer:
    """A tokenizer whose chat template is this Jinja text (what `template_support` probes)."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any) -> str:
        return Template(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   tools=kwargs.get("tools"))


TOOLS_AWARE = (
    "{% if tools %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% endfor %}")


def test_the_embedded_models_template_renders_neither_tools_nor_calls(smollm2_tokenizer: Any) -> None:
    support = template_support(smollm2_tokenizer)
    assert not support.tools and not support.tool_calls and not support.developer


def test_the_embedded_models_template_renders_a_tool_turn(smollm2_tokenizer: Any) -> None:
    assert template_support(smollm2_tokenizer).tool_role


def test_a_template_that_renders_tools_and_calls_is_recognised() -> None:
    assert template_support(JinjaTokenizer(TOOLS_AWARE)) == TemplateSupport(tools=True, tool_calls=True,
                                                                             tool_results=True, tool_role=True)


def test_a_template_that_raises_on_the_probes_renders_none_of_them() -> None:
    def refuse(*args: Any, **kwargs: Any) -> str:
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    assert template_support(SimpleNamespace(chat_template="{{ messages }}", apply_chat_template=refuse)) == \
        TemplateSupport()


def test_the_tools_block_lists_each_function_and_the_call_format() -> None:
    block = tools_block([WEATHER], "auto")
    assert json.dumps(WEATHER["function"]) in block and "<tool_call>" in block and "plain text" in block


def test_a_written_call_parses_back_into_that_call() -> None:
    parsed = get_tool_parser("hermes").parse(call_text("get_weather", {"city": "Paris"}))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_the_tools_block_joins_the_first_system_message() -> None:
    out = render_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                          TemplateSupport(), "TOOLS")
    assert out == [{"role": "system", "content": "Be brief.\n\nTOOLS"}, {"role": "user", "content": "Hi"}]


def test_without_a_system_message_the_tools_block_opens_the_conversation() -> None:
    out = render_messages([{"role": "user", "content": "Hi"}], TemplateSupport(), "TOOLS")
    assert out[0] == {"role": "system", "content": "TOOLS"}


def test_the_developer_role_becomes_system_where_the_template_has_no_such_role() -> None:
    messages = [{"role": "developer", "content": "Be brief."}]
    assert render_messages(messages, TemplateSupport())[0]["role"] == "system"
    assert render_messages(messages, TemplateSupport(developer=True))[0]["role"] == "developer"


def test_calls_and_results_become_text_where_the_template_renders_no_calls() -> None:
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
                {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
                {"role": "tool", "content": "21 C", "tool_call_id": "call_2"}]
    out = render_messages(messages, TemplateSupport())
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1] == {"role": "assistant", "content": call_text("get_weather", {"city": "Paris"}) + "\n"
                      + call_text("get_weather", {"city": "Paris"})}
    assert out[2]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n</tool_response>"


def test_calls_and_results_stay_as_they_are_where_the_template_renders_them() -> None:
    messages = [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]
    assert render_messages(messages, TemplateSupport(tools=True, tool_calls=True, tool_results=True)) == messages


QUESTION = {"role": "user", "content": "Weather in Paris and Rome?"}
TWO_CALLS = {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]}
RESULTS = [{"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
           {"role": "tool", "content": "21 C", "tool_call_id": "call_2"}]


def test_results_go_in_tool_turns_where_the_template_renders_that_role() -> None:
    out = render_messages([QUESTION, TWO_CALLS, *RESULTS], TemplateSupport(tool_role=True))
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool"]
    assert [m["content"] for m in out[2:]] == ["<tool_response>\n18 C\n</tool_response>",
                                                "<tool_response>\n21 C\n</tool_response>"]


def test_results_that_end_the_conversation_are_followed_by_a_request_to_answer() -> None:
    one = render_messages([QUESTION, TWO_CALLS, RESULTS[0]], TemplateSupport(tool_role=True), ask_answer=True)
    two = render_messages([QUESTION, TWO_CALLS, *RESULTS], TemplateSupport(tool_role=True), ask_answer=True)
    assert one[-1] == {"role": "user", "content": ANSWER_AFTER_RESULT}
    assert two[-1] == {"role": "user", "content": ANSWER_AFTER_RESULTS} and two[-2]["role"] == "tool"


def test_without_a_tool_role_the_request_to_answer_ends_the_user_turn_of_the_results() -> None:
    out = render_messages([QUESTION, TWO_CALLS, *RESULTS], TemplateSupport(), ask_answer=True)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[-1]["content"].endswith("21 C\n</tool_response>\n" + ANSWER_AFTER_RESULTS)


def test_results_already_answered_get_no_request_to_answer() -> None:
    messages = [QUESTION, TWO_CALLS, *RESULTS, {"role": "assistant", "content": "18 C and 21 C."},
                {"role": "user", "content": "Thanks!"}]
    out = render_messages(messages, TemplateSupport(tool_role=True), ask_answer=True)
    assert all(m["content"] not in (ANSWER_AFTER_RESULT, ANSWER_AFTER_RESULTS) for m in out)
