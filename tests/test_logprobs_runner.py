"""Logprobs and grammar masks in the runner: values against a float32 log-softmax of transformers'
eager logits, prompt logprobs over chunks, and bitmask rows that only allow what they allow."""

from __future__ import annotations

import math

import numpy as np
import torch
from test_model_hf import VOCAB, Requests, build_model, eager_logits, make_runner

from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.sampler import Sampler
from flashserve.structured.grammar import TokenBitmask, bitmask_words
from flashserve.worker.input_batch import InputBatch


def chunk(reqs: Requests, rid: str, start: int, end: int, prompt_len: int, **params: object) -> ScheduledRequest:
    tokens = reqs.tokens[rid]
    return ScheduledRequest(rid, tokens[start:end], start, reqs.pages[rid], end == prompt_len,
                            SamplingParams(**params), tokens[:prompt_len], [])  # type: ignore[arg-type]


def reference(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(eager_logits(model, tokens).double(), dim=-1)


def test_sampled_token_logprob_and_top_logprobs_match_a_float32_log_softmax() -> None:
    model = build_model("llama-tied")
    reqs = Requests()
    reqs.add("a", 9)
    reqs.add("b", 5)
    runner = make_runner(model)
    step = [chunk(reqs, "a", 0, 9, 9, logprobs=5), chunk(reqs, "b", 0, 5, 5)]
    result = runner.execute(SchedulerOutput(step))
    expected = reference(model, reqs.tokens["a"])[-1]
    (lp,) = result[0].logprobs
    assert lp.token_id == result[0].token_ids[0] == int(expected.argmax())
    assert math.isclose(lp.logprob, float(expected[lp.token_id]), abs_tol=1e-4)
    top_ids = expected.topk(5).indices.tolist()
    assert [t for t, _ in lp.top] == top_ids
    for token, value in lp.top:
        assert math.isclose(value, float(expected[token]), abs_tol=1e-4)


def test_requests_without_logprobs_get_none() -> None:
    reqs = Requests()
    reqs.add("b", 5)
    result = make_runner(build_model("llama-tied")).execute(SchedulerOutput([chunk(reqs, "b", 0, 5, 5)]))
    assert result[0].logprobs is None and result[0].prompt_logprobs is None


def test_prompt_logprobs_over_two_chunks_cover_every_prompt_token_after_the_first() -> None:
    model = build_model("qwen2-bias")
    reqs = Requests()
    reqs.add("a", 20)
    runner = make_runner(model)
    first = runner.execute(SchedulerOutput([chunk(reqs, "a", 0, 12, 20, prompt_logprobs=2)]))[0]
    second = runner.execute(SchedulerOutput([chunk(reqs, "a", 12, 20, 20, prompt_logprobs=2)]))[0]
    entries = first.prompt_logprobs + second.prompt_logprobs
    tokens = reqs.tokens["a"]
    expected = reference(model, tokens)
    assert [e.token_id for e in entries] == tokens[1:]
    for pos, entry in enumerate(entries):  # entry for token pos + 1, predicted at position pos
        assert math.isclose(entry.logprob, float(expected[pos, tokens[pos + 1]]), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == expected[pos].topk(2).indices.tolist()
    assert len(second.token_ids) == 1 and len(first.token_ids) == 0


def mask_allowing(rows: list[int], allowed: list[set[int]]) -> TokenBitmask:
    bitmask = np.zeros((len(rows), bitmask_words(VOCAB)), dtype=np.int32)
    for j, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[j, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return TokenBitmask(rows, bitmask)


def test_bitmask_rows_sample_only_allowed_tokens_and_other_rows_are_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    reqs = InputBatch().update(SchedulerOutput([ScheduledRequest(f"r{i}", [1], 0, [1], True, SamplingParams(temperature=t))
                                                for i, t in enumerate((0.0, 1.0, 0.0))]))
    allowed = [{5, 100, 210}, {31, 32, 63}]
    mask = mask_allowing([0, 1], allowed)
    sampler = Sampler(0)
    for _ in range(20):
        ids = sampler.sample(logits, reqs, mask)
        assert ids[0] in allowed[0] and ids[1] in allowed[1]
        assert ids[2] == int(logits[2].argmax())
    assert ids[0] == max(allowed[0], key=lambda t: float(logits[0, t]))


def test_bitmask_leaves_the_callers_logits_unchanged() -> None:
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    rows = InputBatch().update(SchedulerOutput([ScheduledRequest("r", [1], 0, [1], True, SamplingParams(temperature=0.0))]))
    Sampler(0).sample(logits, rows, mask_allowing([0], [{7}]))
    assert torch.equal(logits, before)


def test_logprobs_stay_raw_under_a_grammar_mask() -> None:
    model = build_model("llama-tied")
    reqs = Requests()
    reqs.add("a", 6)
    forced = 3
    runner = make_runner(model, Sampler(0))
    step = SchedulerOutput([chunk(reqs, "a", 0, 6, 6, logprobs=1, temperature=0.0)],
                           token_bitmask=mask_allowing([0], [{forced}]))
    result = runner.execute(step)[0]
    expected = reference(model, reqs.tokens["a"])[-1]
    assert result.token_ids == [forced]
    assert math.isclose(result.logprobs[0].logprob, float(expected[forced]), abs_tol=1e-4)
    assert result.logprobs[0].top[0][0] == int(expected.argmax())
