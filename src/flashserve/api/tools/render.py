"""Tools for a model whose chat template cannot show them.

Many chat templates (SmolLM2's among them) render neither a request's `tools`, nor an assistant's
`tool_calls`, nor `tool` messages: the model would never see them. `template_support` finds out
what a template renders by rendering probes; where it does not, the messages carry them as text
the model can read:

- the tools, in a system block (`tools_block`) that lists them as JSON and says how to call one:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format, which many
  models were trained on, and which `HermesToolParser` reads back);
- an assistant's earlier calls, in that same format, after its content;
- tool results, as `<tool_response>...</tool_response>` blocks: each in a `tool` turn where the
  template renders that role's content after a plain assistant turn (SmolLM2's renders any role),
  else in one user turn;
- after the results that end a conversation in `auto` mode, a user turn that asks for the answer
  (`ANSWER_AFTER_RESULT`): a small model shown only its own call and the result otherwise calls the
  same function again, forever (SmolLM2-135M did on every such conversation tried).

A template that renders tools and whose model's format is known keeps both (`--tool-call-parser`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from flashserve.structured.tool_format import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN

# What follows the results that end a conversation. Wordings that also offered another call ("...,
# or call a function if you need more information") or named no length led SmolLM2-135M back into
# calls or into repeating itself; docs/api.md lists what was tried.
ANSWER_AFTER_RESULT = "Use this result to answer my question in one sentence."
ANSWER_AFTER_RESULTS = "Use these results to answer my question in one sentence."

_PROBE_NAME = "flashserve_probe_function"
_PROBE_RESULT = "flashserve_probe_result"
_PROBE_CALL = {"id": "call_probe", "type": "function",
               "function": {"name": _PROBE_NAME, "arguments": {"probe": 1}}}
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders: the `tools` argument, assistant `tool_calls`, the content of
    `tool` messages (after a call; `tool_role`: after a plain assistant turn, as the generic format
    sends them), and whether it knows a `developer` role."""

    tools: bool = False
    tool_calls: bool = False
    tool_results: bool = False
    developer: bool = False
    tool_role: bool = False


def _renders(tokenizer: Any, messages: list[dict[str, Any]], sign: str, **kwargs: Any) -> bool:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)
    except Exception:  # a template that refuses the shape does not render it either
        return False
    return isinstance(text, str) and sign in text


def template_support(tokenizer: Any) -> TemplateSupport:
    """What the tokenizer's chat template renders, found by rendering probes (milliseconds)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return TemplateSupport()
    user = {"role": "user", "content": "hi"}
    call = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
    result = {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "call_probe", "name": _PROBE_NAME}
    return TemplateSupport(
        tools=_renders(tokenizer, [user], _PROBE_NAME, tools=[_PROBE_TOOL]),
        tool_calls=_renders(tokenizer, [user, call], _PROBE_NAME),
        tool_results=_renders(tokenizer, [user, call, result], _PROBE_RESULT),
        tool_role=_renders(tokenizer, [user, {"role": "assistant", "content": "ok"}, result], _PROBE_RESULT),
        # A role name is no text a probe could look for in the output; a template that knows the
        # role names it.
        developer="developer" in str(template),
    )


def tools_block(tools: Sequence[dict[str, Any]], mode: Literal["auto", "required", "named"],
                name: str | None = None) -> str:
    """The system text that shows `tools` (OpenAI tool objects) to the model. `auto` explains the
    call format; `required` and `named` outputs follow a grammar, so it only asks for a call."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    head = f"You can call these functions, described as JSON schemas:\n<tools>\n{listed}\n</tools>\n"
    if mode == "named":
        return head + f"Call the function {name} now."
    if mode == "required":
        return head + "Call one or more of these functions now."
    return head + (
        f"To call a function, answer with only this, one block per call:\n{CALL_OPEN}\n"
        '{"name": <the function\'s name>, "arguments": <the arguments as a JSON object>}\n'
        f"{CALL_CLOSE}\nOtherwise, answer in plain text. Results of calls come back in "
        f"{RESULT_OPEN}{RESULT_CLOSE} blocks.")


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it in the format of `tools_block`."""
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ' \
           f"{json.dumps(arguments, ensure_ascii=False)}}}\n{CALL_CLOSE}"


def render_messages(messages: list[dict[str, Any]], support: TemplateSupport,
                    system_text: str | None = None, ask_answer: bool = False) -> list[dict[str, Any]]:
    """Template messages (as `template_message` makes them) with what the template cannot render
    turned into text: the `developer` role into `system`, assistant calls into call blocks, tool
    results into result blocks (in `tool` turns where the template renders them, else in one user
    turn for consecutive ones), and `system_text` (the tools block) added to the first system
    message or put in one of its own at the start. `ask_answer`: where the conversation ends with
    results, a request to answer with them follows (in a user turn of its own, or at the end of the
    user turn that holds them)."""
    out: list[dict[str, Any]] = []
    as_text = not (support.tool_calls and support.tool_results)
    for m in messages:
        m = dict(m)
        if m["role"] == "developer" and not support.developer:
            m["role"] = "system"
        if as_text and m["role"] == "assistant" and m.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m.pop("tool_calls")]
            m["content"] = "\n".join([m["content"], *calls] if m.get("content") else calls)
        elif as_text and m["role"] == "tool":
            block = f"{RESULT_OPEN}\n{m['content']}\n{RESULT_CLOSE}"
            if support.tool_role:
                m["content"] = block
            elif out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
                continue
            else:
                m = {"role": "user", "content": block, "tool_results": True}
        out.append(m)
    results = _trailing_results(messages)
    if ask_answer and as_text and results:
        ask = ANSWER_AFTER_RESULT if results == 1 else ANSWER_AFTER_RESULTS
        if out[-1]["role"] == "tool":
            out.append({"role": "user", "content": ask})
        else:
            out[-1]["content"] += "\n" + ask
    for m in out:
        m.pop("tool_results", None)
    if system_text:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system_text}" if out[0]["content"] else system_text}
        else:
            out.insert(0, {"role": "system", "content": system_text})
    return out


def _trailing_results(messages: list[dict[str, Any]]) -> int:
    """How many tool results end the conversation."""
    count = 0
    for m in reversed(messages):
        if m["role"] != "tool":
            break
        count += 1
    return count
