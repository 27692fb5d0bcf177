"""The speculative-decoding benchmarks: the workload (input-grounded chat prompts built from Python's
standard library, the same for the same seed), the CPU benchmark's summary, and the GPU benchmark's
replayed drafts and the acceptance it reads."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from benchmark.spec_bench import Run, summarize
from benchmark.spec_gpu import EveryStepProposer, ForcedAcceptance, ReplayProposer, acceptance_from
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


def run_of(tokens: list[int], decode_s: float, drafts: int = 0, accepted: int = 0,
           per_pos: list[int] | None = None) -> Run:
    steps = len(tokens) - 1 - accepted  # each step: the target's token and the drafts it accepted
    return Run(tokens, "", 1.0 + decode_s, 1.0 + decode_s, 1.0, decode_s, decode_s, steps, drafts, drafts * 2,
               accepted, per_pos or [])


def test_summary_speedup_is_decode_tokens_per_second_over_speculation_off() -> None:
    base = [run_of(list(range(11)), 2.0)]
    row = summarize("ngram k=2", [run_of(list(range(11)), 1.0, drafts=4, accepted=6, per_pos=[4, 2])], base)
    assert row["decode_tokens_per_s"] == pytest.approx(10.0) and row["speedup"] == pytest.approx(2.0)
    assert row["mean_accepted_length"] == pytest.approx(2.5)
    assert row["acceptance_per_position"] == pytest.approx([1.0, 0.5])


def test_summary_counts_outputs_that_differ_from_speculation_off() -> None:
    base = [run_of([1, 2, 3], 1.0), run_of([4, 5, 6], 1.0)]
    row = summarize("ngram k=2", [run_of([1, 2, 3], 1.0), run_of([4, 5, 7], 1.0)], base)
    assert row["identical"] == 1 and row["requests"] == 2


def test_replay_proposer_drafts_the_recorded_output_when_every_draft_is_accepted() -> None:
    proposer = ReplayProposer({(7, 8, 9): [10, 11, 12, 13, 14, 15]}, [1.0] * 4, vocab_size=100)
    assert proposer.propose([7, 8, 9, 10, 11], 4) == [12, 13, 14, 15]
    assert proposer.propose([7, 8, 9, 10, 11, 12, 13, 14], 4) == [15]
    assert proposer.propose([1, 2, 3], 4) == []


def test_replay_proposer_misses_at_the_acceptance_given_per_position() -> None:
    acceptance = [0.8, 0.6, 0.4, 0.2]
    output = list(range(20, 2020))
    proposer = ReplayProposer({(1, 2, 3): output}, acceptance, vocab_size=5000, seed=1)
    matched = [0] * 4
    trials = 2000
    for done in range(trials - 4):
        drafts = proposer.propose([1, 2, 3] + output[:done], 4)
        run = next((i for i, d in enumerate(drafts) if d != output[done + i]), 4)
        for i in range(run):
            matched[i] += 1
    assert [m / (trials - 4) for m in matched] == pytest.approx(acceptance, abs=0.04)


def test_forced_acceptance_keeps_drafts_at_the_acceptance_given_per_position() -> None:
    acceptance = [0.8, 0.6, 0.4, 0.2]
    forced = ForcedAcceptance(acceptance, seed=3)
    trials = 4000
    kept = [forced.kept(4) for _ in range(trials)]
    assert [sum(m > i for m in kept) / trials for i in range(4)] == pytest.approx(acceptance, abs=0.03)
    assert max(forced.kept(2) for _ in range(100)) <= 2  # never more than the row drafted


def test_every_step_proposer_drafts_k_tokens_for_every_request() -> None:
    assert EveryStepProposer().propose([5, 6, 7], 4) == [7, 7, 7, 7]
    assert EveryStepProposer().propose([5], 0) == []


def test_gpu_benchmark_reads_the_acceptance_of_the_cpu_run_of_the_same_k(tmp_path: Path) -> None:
    path = tmp_path / "spec_bench.json"
    path.write_text(json.dumps({"rows": [
        {"config": "off", "acceptance_per_position": []},
        {"config": "ngram k=2", "acceptance_per_position": [0.9, 0.8]},
        {"config": "ngram k=4", "acceptance_per_position": [0.7, 0.5, 0.4, 0.3]}]}))
    assert acceptance_from([str(path)], 4) == ([0.7, 0.5, 0.4, 0.3], f"{path}: ngram k=4")
    assert acceptance_from(["0.9", "0.5"], 4)[0] == [0.9, 0.5, 0.0, 0.0]


def test_summary_counts_steps_and_the_share_of_them_that_verified_drafts() -> None:
    base = [run_of(list(range(11)), 2.0)]
    row = summarize("ngram k=2", [run_of(list(range(11)), 1.0, drafts=4, accepted=6, per_pos=[4, 2])], base)
    assert row["decode_steps"] == 4 and row["tokens_per_step"] == pytest.approx(2.5)
    assert row["drafted_steps"] == pytest.approx(1.0)


def test_more_prompts_per_kind_keep_the_first_ones(workload: list[SpecPrompt]) -> None:
    assert build_workload(per_kind=2, seed=0) == [p for p in workload if by_kind(workload, p.kind).index(p) < 2]
