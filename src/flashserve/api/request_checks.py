"""Checks on request fields that say exactly what is wrong: the bound on stop strings, and for a
prompt of token ids that validation refused, which id and why.

Both are pydantic validators, so their errors reach the client as any validation error does: a
400 whose `param` is the field and whose message names the item.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

# Stop strings one request may give, and the characters in each. Every decoding step checks every
# stop string against the new text, and a stream holds back as much text as the longest one could
# still claim, so neither is left unbounded. OpenAI takes 4 strings; 32 leaves room for what clients
# send (lm-eval's `until` lists and code benchmarks' stop words run to about 10, LangChain's and
# agent frameworks' to a few).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256

# The first id orjson no longer reads as an int64 (larger ones come as floats).
_INT64_END = 2**63

PROMPT_TYPES = "a string, a list of token ids, or a list of strings or of token-id lists"


def check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    """`stop` (chat, completions) or `stop_sequences` (Messages), refused past MAX_STOP_STRINGS
    strings or a string past MAX_STOP_CHARS characters."""
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > MAX_STOP_STRINGS:
        raise PydanticCustomError(
            "too_many_stop_strings", "at most {limit} stop strings are allowed, got {count}",
            {"limit": MAX_STOP_STRINGS, "count": len(strings)})
    for i, text in enumerate(strings):
        if len(text) > MAX_STOP_CHARS:
            raise PydanticCustomError(
                "stop_string_too_long", "stop string {index} has {length} characters; the limit is {limit}",
                {"index": i, "length": len(text), "limit": MAX_STOP_CHARS})
    return stop


def prompt_validator() -> WrapValidator:
    """Validation of a completions prompt whose error, for token ids, names the id that is wrong
    and why (negative, not an integer, past 64 bits), else lists the shapes a prompt takes."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            mistake = _prompt_mistake(value)
            if mistake is not None:
                raise PydanticCustomError("token_id", mistake) from None
            raise PydanticCustomError("union_type", "Input should be {expected}", {"expected": PROMPT_TYPES}) from None

    return WrapValidator(validate)


def _prompt_mistake(prompt: Any) -> str | None:
    """For a prompt that looks like token ids (a list of numbers, or of lists): the first item
    that is no token id, named; None for any other shape."""
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(ids, list) for ids in prompt):
        for k, ids in enumerate(prompt):
            mistake = _token_id_mistake(ids, f" of prompt[{k}]")
            if mistake is not None:
                return mistake
        return None
    if isinstance(prompt[0], (int, float)) and not isinstance(prompt[0], bool):
        return _token_id_mistake(prompt, "")
    return None


def _token_id_mistake(ids: list[Any], of: str) -> str | None:
    for i, token in enumerate(ids):
        at = f"at index {i}{of}"
        if isinstance(token, bool) or not isinstance(token, (int, float)):
            return f"the item {at} is {_json_kind(token)}, not a token id (an integer)"
        if isinstance(token, float) and not token.is_integer():
            return f"token id {token!r} {at} is not an integer"
        if token < 0:
            return f"token id {_shown(token)} {at} is negative: token ids count from 0"
        if token >= _INT64_END:
            # Past int64 orjson reads a float: shown as read, exact for round numbers such as 2**70.
            return (f"token id {_shown(token)} {at} is out of range: it is past 2**63, and a token id "
                    "indexes the model's vocabulary")
        if isinstance(token, float):
            return f"token id {token!r} {at} is not an integer: write it without a decimal point"
    return None


def _shown(token: int | float) -> str:
    return str(int(token)) if isinstance(token, int) or token.is_integer() else repr(token)


def _json_kind(value: Any) -> str:
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, bool):
        return f"the value {str(value).lower()}"
    return {list: "a list", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
