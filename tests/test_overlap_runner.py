"""The runner's side of overlap scheduling: a row whose token is in flight takes it from the step
before on the device, and its logits equal transformers' eager forward over the whole sequence;
seeds and min_tokens count the token in flight."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_hf import Requests, build_model, eager_logits, make_runner

from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput, sample_error, sampled
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams
from flashserve.worker.runner import LaunchedStep


def in_flight(reqs: Requests, rid: str, position: int) -> ScheduledRequest:
    """A decode row at `position` whose token the step before samples (a placeholder here)."""
    return dataclasses.replace(reqs.chunk(rid, position, position + 1), new_token_ids=[0], last_token_in_flight=True)


def prefill_then_decode(order: list[str], with_chunk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefills a (9 tokens) and b (6), then decodes both in `order` with their tokens in flight,
    beside a prefill chunk of c when `with_chunk`; (logits of the decode step, eager reference)."""
    model = build_model("llama")
    runner = make_runner(model)
    reqs = Requests()
    prompt = {"a": 9, "b": 6}
    for rid, n in prompt.items():
        reqs.add(rid, n + 1)
    reqs.add("c", 20)
    first = runner.launch(SchedulerOutput([reqs.chunk(r, 0, prompt[r]) for r in prompt]))
    rows = [in_flight(reqs, r, prompt[r]) for r in order]
    if with_chunk:
        rows.insert(1, reqs.chunk("c", 0, 5, sample=False))
    logits = runner.forward(SchedulerOutput(rows), (), first)
    for rid, (token,) in zip(prompt, (r.token_ids for r in runner.collect(first))):
        reqs.tokens[rid][prompt[rid]] = token  # what the step in flight sampled
    expected = torch.stack([eager_logits(model, reqs.tokens[r])[prompt[r]] for r in order])
    return logits, expected


def test_decode_rows_in_the_order_of_the_step_before_take_its_tokens() -> None:
    logits, expected = prefill_then_decode(["a", "b"], with_chunk=False)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


def test_decode_rows_reordered_beside_a_prefill_chunk_take_their_own_tokens() -> None:
    logits, expected = prefill_then_decode(["b", "a"], with_chunk=True)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


def test_tokens_in_flight_from_a_step_sampled_row_by_row_come_from_its_results() -> None:
    model = build_model("llama")
    runner = make_runner(model)
    reqs = Requests()
    reqs.add("a", 8)
    reqs.add("b", 8)
    runner.execute(SchedulerOutput([reqs.chunk("a", 0, 7), reqs.chunk("b", 0, 7)]))
    # The batch's sampling failed and was redone per row: b's failed, a's gave token 42.
    previous = LaunchedStep(2, [0, 1], ["a", "b"], results=[sampled(42), sample_error("bad row")])
    logits = runner.forward(SchedulerOutput([in_flight(reqs, "a", 7)]), (), previous)
    reqs.tokens["a"][7] = 42
    torch.testing.assert_close(logits[0], eager_logits(model, reqs.tokens["a"])[7], atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("", max_num_seqs=4, num_pages=96)


def generate(llm: LLM, overlap: bool, params: SamplingParams) -> list[list[int]]:
    llm.engine.overlap = overlap
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400]]
    return [r.token_ids for r in llm.generate(prompts, params)]


def test_seeded_sampling_draws_the_same_tokens_with_and_without_overlap(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert params.schedules_ahead
    assert generate(llm, True, params) == generate(llm, False, params)


def test_min_tokens_counts_the_token_in_flight(llm: LLM) -> None:
    llm.engine.overlap = True
    prompt = [[1, 2, 3, 4, 5]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    k = next(k for k in range(3, 12) if greedy[k] not in greedy[:k])
    # Masked while fewer than k tokens exist, the stop id is free at output k, where greedy picks it.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, min_tokens=k, stop_token_ids=(greedy[k],))
    (result,) = llm.generate(prompt, params)
    assert result.token_ids == greedy[: k + 1] and result.finish_reason == "stop"


def test_late_launches_are_not_started_on_a_cpu_which_has_no_device_times(llm: LLM) -> None:
    assert not llm.engine.start_late_launches()
    assert llm.engine.late is None and llm.engine.launch_deadline() is None


def test_the_offline_llm_asks_for_no_late_launches_by_default(llm: LLM) -> None:
    """Nothing arrives while generate() drives the engine, so its steps are not held or timed."""
    assert llm.engine.scheduler.config.late_launch is False
