"""The incremental detokenizer's specification, on the embedded SmolLM2 tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from flashserve.detokenizer import IncrementalDetokenizer, MAX_HELD_TOKENS
from flashserve.message.sampling_params import SamplingParams

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of "
    "times; it was the age of wisdom, it was the age of foolishness.\n\nIn 1969, Apollo 11 landed "
    "on the Moon: Neil Armstrong said \"That's one small step for man\" - and 600 million people "
    "watched.  Double  spaces,\ttabs, and trailing punctuation!?... (parentheses) [brackets] "
    "{braces} <angles> def f(x): return x ** 2  # code\n" * 8
)
MULTILINGUAL = (
    "Café, naïve, façade, jalapeño, Ångström, Straße. 日本語のテキスト、中文文本，한국어 텍스트. "
    "Emoji: 😀🦜🧬👩‍👩‍👧 ❤️ 🇫🇷 Ελληνικά и русский текст. עברית العربية हिन्दी ✓ ∑ ∞ ≠ €\n"
)
EMOJI = "🦜"


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


def make(tokenizer: Any, prompt: list[int] | None = None, **params: Any) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt or [], SamplingParams(**params))


@pytest.mark.parametrize("text", [ENGLISH, MULTILINGUAL], ids=["english", "multilingual"])
def test_concatenated_output_equals_full_decode(smollm2_tokenizer: Any, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    detok = make(smollm2_tokenizer)
    pieces = feed(detok, ids) + [detok.flush()]
    assert "".join(pieces) == smollm2_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text


def test_prompt_context_does_not_leak_into_the_output(smollm2_tokenizer: Any) -> None:
    prompt = smollm2_tokenizer.encode("<|im_start|>user\nSay hi 😀<|im_end|>\n<|im_start|>assistant\n")
    output = smollm2_tokenizer.encode(" Hello there, naïve 🦜!<|im_end|>")
    detok = make(smollm2_tokenizer, prompt)
    pieces = feed(detok, output) + [detok.flush()]
    assert "".join(pieces) == " Hello there, naïve 🦜!"


def test_split_character_is_never_emitted_as_replacement(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode(f"a{EMOJI}b {EMOJI}{EMOJI} 日本語")
    assert len(smollm2_tokenizer.encode(EMOJI)) > 1  # the emoji is split into byte tokens
    pieces = feed(make(smollm2_tokenizer), ids)
    assert not any("\ufffd" in p for p in pieces)
    assert EMOJI in pieces[ids.index(smollm2_tokenizer.encode(EMOJI)[-1])]


def test_special_tokens_follow_skip_special_tokens(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("Hi<|im_end|>")
    skipped = make(smollm2_tokenizer)
    kept = make(smollm2_tokenizer, skip_special_tokens=False)
    assert "".join(feed(skipped, ids)) == "Hi"
    assert "".join(feed(kept, ids)) == "Hi<|im_end|>"


def test_stop_string_inside_one_token(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("Hello world, and more")  # " world" is one token
    detok = make(smollm2_tokenizer, stop=("orl",))
    pieces = feed(detok, ids)
    assert detok.stopped
    assert "".join(pieces) == detok.text == "Hello w"
    assert pieces[2:] == ["", "", ""]  # nothing after the stop
    assert detok.flush() == ""


def test_stop_string_split_across_tokens(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("Hello world, and more")
    detok = make(smollm2_tokenizer, stop=("lo wo",))
    pieces = feed(detok, ids)
    assert detok.stopped
    assert "".join(pieces) == "Hel"


def test_stop_string_made_of_a_split_character(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode(f"Look {EMOJI} there")
    detok = make(smollm2_tokenizer, stop=(EMOJI,))
    assert "".join(feed(detok, ids)) == "Look "
    assert detok.stopped


def test_earliest_stop_string_wins(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("one two three four")
    detok = make(smollm2_tokenizer, stop=("four", "two", "three"))
    assert "".join(feed(detok, ids)) == "one "


def test_text_before_a_stop_string_is_emitted_promptly(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("The quick brown fox jumps")
    detok = make(smollm2_tokenizer, stop=("STOP",))
    for n, token_id in enumerate(ids, start=1):
        detok.add(token_id)
        assert detok.text == smollm2_tokenizer.decode(ids[:n])


def test_possible_stop_prefix_is_held_then_released_when_it_diverges(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("foo baz qux")  # foo | " b" | "az" | " qu" | "x"
    detok = make(smollm2_tokenizer, stop=("foo bar",))
    assert detok.add(ids[0]) == ""  # "foo" may start "foo bar"
    assert detok.add(ids[1]) == ""  # "foo b" still may
    assert detok.add(ids[2]) == "foo baz"  # "foo baz" cannot
    assert "".join(feed(detok, ids[3:])) == " qux"
    assert not detok.stopped


def test_flush_returns_held_back_text(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode("the foo")
    detok = make(smollm2_tokenizer, stop=("foo bar",))
    assert "".join(feed(detok, ids)) == "the "
    assert detok.flush() == "foo"
    assert detok.text == "the foo"
    assert not detok.stopped


def test_flush_returns_an_unfinished_character_as_the_full_decode_does(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode(f"ok {EMOJI}")[:-1]  # the last byte of the emoji never comes
    detok = make(smollm2_tokenizer)
    assert "".join(feed(detok, ids)) == "ok"
    assert detok.flush() == smollm2_tokenizer.decode(ids)[2:]


def test_invalid_bytes_are_released_after_a_bounded_wait(smollm2_tokenizer: Any) -> None:
    continuation = smollm2_tokenizer.encode(EMOJI)[-1]  # a lone continuation byte
    detok = make(smollm2_tokenizer)
    pieces = feed(detok, [continuation] * (3 * MAX_HELD_TOKENS))
    assert all(pieces[i] for i in range(MAX_HELD_TOKENS - 1, len(pieces), MAX_HELD_TOKENS))


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_decode_window_stays_short_over_a_long_output(smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode((ENGLISH + MULTILINGUAL) * 2)
    assert len(ids) > 1000
    counting = CountingTokenizer(smollm2_tokenizer)
    detok = make(counting, smollm2_tokenizer.encode("a prompt of some length " * 20), stop=("@@@",))
    feed(detok, ids)
    assert counting.longest <= 2 * MAX_HELD_TOKENS


@pytest.mark.parametrize("clean_up", [False, True])
def test_raw_decoder_gives_the_tokenizers_own_text(smollm2_tokenizer: Any, clean_up: bool) -> None:
    import copy

    from flashserve.detokenizer import raw_decoder

    tok = copy.copy(smollm2_tokenizer)
    tok.clean_up_tokenization_spaces = clean_up
    ids = tok.encode("Hello , world . It 's <|im_end|> done ?", add_special_tokens=False)
    for skip in (False, True):
        assert raw_decoder(tok)(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


class _CleaningUp:
    """A tokenizer whose decode applies clean-up, as transformers does for WordPiece tokenizers."""

    clean_up_tokenization_spaces = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.backend_tokenizer = inner.backend_tokenizer

    def encode(self, text: str, **kw: Any) -> list[int]:
        return self.inner.encode(text, **kw)

    def decode(self, ids: list[int], **kw: Any) -> str:
        return self.inner.decode(ids, **kw).replace(" .", ".").replace(" ,", ",").replace(" 's", "'s")


def test_raw_decoder_keeps_a_tokenizer_that_really_cleans_up(smollm2_tokenizer: Any) -> None:
    from flashserve.detokenizer import raw_decoder

    tok = _CleaningUp(smollm2_tokenizer)
    assert raw_decoder(tok) == tok.decode


def test_raw_decoder_takes_the_backend_when_clean_up_changes_nothing(smollm2_tokenizer: Any) -> None:
    import copy

    from flashserve.detokenizer import raw_decoder

    tok = copy.copy(smollm2_tokenizer)
    tok.clean_up_tokenization_spaces = True
    probe = tok.encode("x . y 's z ,", add_special_tokens=False)
    expected_backend = tok.decode(probe) == tok.backend_tokenizer.decode(probe)
    assert (raw_decoder(tok) == tok.backend_tokenizer.decode) == expected_backend
