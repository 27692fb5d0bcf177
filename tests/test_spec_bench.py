"""The speculative-decoding benchmark's workload: input-grounded chat prompts built from Python's
standard library, the same for the same seed."""

from __future__ import annotations

import ast
import re

import pytest

from benchmark.spec_workload import KINDS, SpecPrompt, _renamed, build_workload


@pytest.fixture(scope="module")
def workload() -> list[SpecPrompt]:
    return build_workload(per_kind=3, seed=0)


def by_kind(workload: list[SpecPrompt], kind: str) -> list[SpecPrompt]:
    return [p for p in workload if p.kind == kind]


def text_after_ask(prompt: SpecPrompt) -> str:
    return prompt.messages[0]["content"].split("\n\n", 1)[1]


def test_same_seed_gives_the_same_prompts(workload: list[SpecPrompt]) -> None:
    assert build_workload(per_kind=3, seed=0) == workload


def test_another_seed_gives_other_prompts(workload: list[SpecPrompt]) -> None:
    assert [p.messages for p in build_workload(per_kind=3, seed=1)] != [p.messages for p in workload]


def test_prompts_are_one_user_message_each_kind_in_turn(workload: list[SpecPrompt]) -> None:
    assert [p.kind for p in workload] == list(KINDS) * 3
    for p in workload:
        assert [m["role"] for m in p.messages] == ["user"] and p.messages[0]["content"].strip()


def test_max_tokens_leaves_room_for_the_whole_reference_answer_within_the_cap() -> None:
    for p in build_workload(per_kind=3, seed=0, max_tokens=200):
        assert len(p.reference) // 4 < p.max_tokens <= 200


def test_spelling_prompt_is_its_reference_with_a_few_words_misspelled(workload: list[SpecPrompt]) -> None:
    for p in by_kind(workload, "spelling"):
        given, right = text_after_ask(p).split(" "), p.reference.split(" ")
        assert len(given) == len(right)
        assert 3 <= sum(a != b for a, b in zip(given, right)) <= 4


def test_rename_reference_renames_every_use_and_nothing_else(workload: list[SpecPrompt]) -> None:
    for p in by_kind(workload, "rename"):
        old, new = re.findall(r"`(\w+)`", p.messages[0]["content"])[:2]
        code = text_after_ask(p).removeprefix("```python\n").removesuffix("```")
        names = {n.id for n in ast.walk(ast.parse(p.reference)) if isinstance(n, ast.Name)}
        assert old not in names and new in names
        assert _renamed(p.reference, new, old) == code


def test_quote_reference_quotes_sentences_of_the_passage_that_name_the_word(workload: list[SpecPrompt]) -> None:
    for p in by_kind(workload, "quote"):
        word = re.search(r'about "(\w+)"', p.messages[0]["content"]).group(1)
        passage = text_after_ask(p)
        quotes = re.findall(r'"(.+?)"(?: |$)', p.reference)
        assert quotes and all(q in passage and word in q for q in quotes)
