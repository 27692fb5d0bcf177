"""Logprobs in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`
and the legacy completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.

Values are the model's log-softmax over its raw logits (before penalties, bias, temperature,
top-k/top-p and grammar masks), as vLLM reports them by default. A token's text is the tokenizer's
decoding of that token alone (special tokens included); its `bytes` are that text's UTF-8, so a
token holding part of a character shows U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flashserve.engine.outputs import TokenLogprob


class TokenTexts:
    """Token id -> text, decoded once per id (a server decodes the same ids over and over)."""

    def __init__(self, tokenizer: Any | None, max_entries: int = 1 << 17) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._max = max_entries

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._texts) < self._max:
                self._texts[token_id] = text
        return text


def _logprob(value: float) -> float:
    # JSON has no -Infinity: a token the model gives no chance reports OpenAI's floor instead.
    return value if value > -9999.0 else -9999.0


def chat_logprobs(entries: Sequence[TokenLogprob], text_of: TokenTexts) -> dict[str, Any]:
    """Chat's `choices[].logprobs` for these tokens."""
    content = []
    for entry in entries:
        token = text_of(entry.token_id)
        content.append({
            "token": token,
            "logprob": _logprob(entry.logprob),
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := text_of(i)), "logprob": _logprob(lp), "bytes": list(t.encode("utf-8"))}
                for i, lp in entry.top
            ],
        })
    return {"content": content}


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], text_of: TokenTexts, text_offset: int = 0
) -> dict[str, Any]:
    """Completions' `choices[].logprobs` for these tokens, whose text starts at character
    `text_offset` of the choice's text. A None entry (the first prompt token under echo, which
    nothing predicts) has a null logprob and null top_logprobs."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        token = text_of(token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_logprob(entry.logprob))
        top_logprobs.append({text_of(i): _logprob(lp) for i, lp in entry.top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One completions logprobs object from the pieces of several outputs, in order."""
    if not parts:
        return None
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}
