"""Logprobs in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`
and the legacy completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.

Values are the model's log-softmax over its raw logits (before penalties, bias, temperature,
top-k/top-p and grammar masks), as vLLM reports them by default. A token's text is the tokenizer's
decoding of that token alone (special tokens included), so a token holding part of a character
shows U+FFFD; its `bytes` are the token's own raw bytes, so that joining them rebuilds the text.
`text_offset` counts characters of the returned text: a token that starts inside a character has
that character's offset.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Sequence
from typing import Any

from flashserve.message.outputs import TokenLogprob


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE vocabulary writes for
    each byte -> that byte (printable bytes stand for themselves, the others are moved up by 256)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _decoder_types(tokenizer: Any) -> set[str]:
    """The `type`s in a fast tokenizer's decoder (a Sequence's steps included); empty if unknown."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except (AttributeError, TypeError, ValueError):
        return set()
    steps = spec.get("decoders") or [spec]
    return {step.get("type") for step in steps if isinstance(step, dict)}


def raw_token_bytes(tokenizer: Any) -> Callable[[int], bytes | None]:
    """token id -> the raw bytes the token stands for, read from its vocabulary entry where the
    tokenizer's decoder says how (byte-level BPE, SentencePiece byte fallback); None where it does
    not, or for an added token (whose text is what it stands for)."""
    kinds = _decoder_types(tokenizer)
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or ())
    if "ByteLevel" in kinds:
        table = _byte_level_table()

        def byte_level(token_id: int) -> bytes | None:
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if token_id in added or not isinstance(piece, str) or any(c not in table for c in piece):
                return None
            return bytes(table[c] for c in piece)

        return byte_level
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        def sentencepiece(token_id: int) -> bytes | None:
            piece = tokenizer.convert_ids_to_tokens(token_id)
            if token_id in added or not isinstance(piece, str):
                return None
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")

        return sentencepiece
    return lambda token_id: None


class TokenTexts:
    """Token id -> text, decoded once per id (a server decodes the same ids over and over), and
    token id -> raw bytes (`bytes_of`)."""

    def __init__(self, tokenizer: Any | None, max_entries: int = 1 << 17) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._raw: Callable[[int], bytes | None] | None = None  # read from the tokenizer on first use
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

    def bytes_of(self, token_id: int) -> bytes:
        """The token's own raw bytes: part of a character's UTF-8 for a token that holds part of
        one (the text's UTF-8 where the tokenizer does not say)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            if self._raw is None:
                self._raw = raw_token_bytes(self._tokenizer) if self._tokenizer is not None else lambda i: None
            raw = self._raw(token_id)
            if raw is None:
                raw = self(token_id).encode("utf-8")
            if len(self._bytes) < self._max:
                self._bytes[token_id] = raw
        return raw


class TextOffsets:
    """Character offsets of tokens in a text, from their raw bytes: each token's offset is the
    number of characters completed before it, so a token that starts inside a character gets that
    character's offset and offsets never go back. Kept across a stream's chunks."""

    def __init__(self, start: int = 0) -> None:
        self.position = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, raw: bytes) -> int:
        """The offset of the token with these bytes; moves past it."""
        offset = self.position
        self.position += len(self._decoder.decode(raw))
        return offset


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
            "bytes": list(text_of.bytes_of(entry.token_id)),
            "top_logprobs": [
                {"token": text_of(i), "logprob": _logprob(lp), "bytes": list(text_of.bytes_of(i))}
                for i, lp in entry.top
            ],
        })
    return {"content": content}


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], text_of: TokenTexts, offsets: TextOffsets
) -> dict[str, Any]:
    """Completions' `choices[].logprobs` for these tokens, whose text starts where `offsets` stands
    in the choice's text (it moves past them). A None entry (the first prompt token under echo,
    which nothing predicts) has a null logprob and null top_logprobs."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        tokens.append(text_of(token_id))
        text_offset.append(offsets.next(text_of.bytes_of(token_id)))
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_logprob(entry.logprob))
        top_logprobs.append({text_of(i): _logprob(lp) for i, lp in entry.top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One completions logprobs object from the pieces of several outputs, in order."""
    if not parts:
        return None
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}
