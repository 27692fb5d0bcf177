"""Speculative decoding (n-gram) on the embedded SmolLM2-135M on the CPU, float32: greedy output is
token for token the output without speculation, and everything around a request keeps working.

One engine serves every test: speculation off is the same engine with its speculator set aside
(`speculation_off`), which is what an engine built without `speculative_config` runs.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest

from flashserve.entrypoints.llm import LLM, Completion
from flashserve.message.sampling_params import SamplingParams
from spec_helpers import speculation_off

pytestmark = pytest.mark.slow

# Input-grounded prompts (quoting a given text), where prompt lookup finds the continuation.
PASSAGE = inspect.getdoc(inspect)[:600]  # the standard library's text: on every machine
QUOTE = f"Repeat this text exactly, word for word:\n\n{PASSAGE}"
QUESTION = "What is the capital of France?"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("", num_pages=160, max_num_seqs=8, speculative_config=SPEC)


def chat(llm: LLM, text: str) -> list[int]:
    tokenizer = llm.stack.tokenizer
    return list(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                add_generation_prompt=True, tokenize=False)))


def both(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[Completion], list[Completion]]:
    """(with speculation, without) for the same prompts and parameters."""
    with speculation_off(llm):
        off = llm.generate(prompts, params)
    return llm.generate(prompts, params), off


def drafts_accepted(llm: LLM) -> int:
    stats = llm.engine.scheduler.spec_stats
    assert stats is not None
    return stats.num_accepted_tokens


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> list[Completion]:
    """Greedy completions of the quoting prompt and the question, without speculation."""
    with speculation_off(llm):
        return llm.generate([chat(llm, QUOTE), chat(llm, QUESTION)], GREEDY)


@pytest.fixture(scope="module")
def quote(llm: LLM, baseline: list[Completion]) -> tuple[list[int], Completion]:
    """The quoting prompt and its greedy completion without speculation."""
    return chat(llm, QUOTE), baseline[0]


def test_greedy_outputs_are_token_for_token_those_without_speculation(llm, baseline):
    before = drafts_accepted(llm)
    on = llm.generate([chat(llm, QUOTE), chat(llm, QUESTION)], GREEDY)
    assert [c.token_ids for c in on] == [c.token_ids for c in baseline]
    assert drafts_accepted(llm) - before >= 8  # the quote was mostly drafted, not decoded


def test_a_stream_gets_several_tokens_in_one_chunk(llm, quote):
    prompt, off = quote
    engine = llm.engine
    engine.add_request("stream", prompt, GREEDY)
    chunks: list[list[int]] = []
    while engine.has_unfinished:
        chunks += [out.new_token_ids for out in engine.step() if out.new_token_ids]
    assert [t for c in chunks for t in c] == off.token_ids
    assert max(len(c) for c in chunks) > 1


def test_a_stop_string_inside_an_accepted_run_ends_the_text_as_without_speculation(llm, quote):
    prompt, off = quote
    word = off.text.split()[6]  # a word the quote reaches after a few accepted runs
    on = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[word]))[0]
    assert on.text == off.text[: off.text.index(word)] and on.finish_reason == "stop"


def test_a_stop_string_inside_an_accepted_run_keeps_no_token_after_it(llm, quote):
    """The tokens (and so usage) end where they end without speculation: the accepted tokens after
    the one that completed the stop string are dropped."""
    prompt, off = quote
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=[off.text.split()[6]])
    before = drafts_accepted(llm)
    (on,), (plain,) = both(llm, [prompt], params)
    assert drafts_accepted(llm) > before
    assert on.token_ids == plain.token_ids and on.text == plain.text


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(llm, quote):
    prompt, off = quote
    token = off.token_ids[12]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(token,))
    on = llm.generate([prompt], params)[0]
    cut = off.token_ids.index(token)
    assert on.token_ids == off.token_ids[: cut + 1] and on.finish_reason == "stop"


def test_max_tokens_cuts_an_accepted_run(llm, quote):
    prompt, off = quote
    on = llm.generate([prompt], SamplingParams(max_tokens=7, temperature=0.0))[0]
    assert on.token_ids == off.token_ids[:7] and on.finish_reason == "length"


def test_logprobs_of_accepted_tokens_are_the_targets(llm, quote):
    prompt, _ = quote
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
    engine = llm.engine

    def logprobs() -> list[Any]:
        engine.add_request("lp", prompt, params)
        got: list[Any] = []
        while engine.has_unfinished:
            for out in engine.step():
                got += out.logprobs or []
        return got

    on = logprobs()
    with speculation_off(llm):
        off = logprobs()
    assert [e.token_id for e in on] == [e.token_id for e in off]
    for a, b in zip(on, off):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_penalties_apply_to_accepted_tokens_as_without_speculation(llm, quote):
    prompt, _ = quote
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3)
    on, off = both(llm, [prompt], params)
    assert on[0].token_ids == off[0].token_ids


def test_a_seeded_sampled_request_is_reproducible_with_speculation(llm, quote):
    prompt, _ = quote
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=1234)
    first, second = llm.generate([prompt, prompt], params, prefix_grouping=False)
    assert first.token_ids == second.token_ids


def test_several_sequences_of_one_prompt_each_get_the_greedy_output(llm, quote):
    prompt, off = quote
    outs = llm.generate([prompt] * 2, GREEDY)
    assert all(o.token_ids == off.token_ids for o in outs)


def test_a_cached_prefix_gives_the_same_output_and_every_page_is_freed(llm, quote):
    prompt, off = quote
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == off.token_ids
    assert llm.engine.scheduler.kv_cache.num_used_pages == 0


def test_an_aborted_speculative_request_frees_its_pages(llm, quote):
    prompt, _ = quote
    engine = llm.engine
    engine.add_request("gone", prompt, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort("gone")
    while engine.has_unfinished:
        engine.step()
    for _ in range(2):  # the step in flight when it was aborted
        engine.step()
    assert engine.scheduler.kv_cache.num_used_pages == 0


def test_structured_output_follows_its_grammar_with_speculation(llm):
    from flashserve.structured.compiler import GrammarCompiler, GrammarSpec

    tokenizer = llm.stack.tokenizer
    compiler = GrammarCompiler(tokenizer, llm.stack.loaded.vocab_size, list(llm.stack.loaded.eos_token_ids))
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    grammar = compiler.compile_sync(GrammarSpec("json", json.dumps(schema), "response_format"))
    prompt = chat(llm, f"{QUOTE}\n\nAnswer in JSON: {{\"text\": \"...\"}}")
    params = SamplingParams(max_tokens=30, temperature=0.0, grammar=grammar)
    before = drafts_accepted(llm)
    on, off = both(llm, [prompt], params)
    assert on[0].token_ids == off[0].token_ids
    assert drafts_accepted(llm) > before
    if on[0].finish_reason == "stop":
        json.loads(on[0].text)


def test_run_batch_serves_speculative_requests(llm, tmp_path):
    from flashserve.cli import build_parser
    from flashserve.serve_args import to_batch_args
    from flashserve.entrypoints.run_batch.main import main

    body = {"messages": [{"role": "user", "content": QUOTE}], "max_tokens": 24, "temperature": 0}
    (tmp_path / "in.jsonl").write_text(json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/chat/completions",
                                                   "body": body}) + "\n")
    args = to_batch_args(build_parser({}).parse_args(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                                                      str(tmp_path / "out.jsonl"), "--no-progress"]))
    before = drafts_accepted(llm)
    assert main(args, stack=llm.stack) == 0
    result = json.loads((tmp_path / "out.jsonl").read_text())
    assert result["response"]["status_code"] == 200
    assert drafts_accepted(llm) > before
