"""Speculative decoding on the GPU: FlashInfer's chain_speculative_sampling keeps the target's
distribution, and greedy verify steps (eager, bf16) give plain decoding's tokens except where the
top-2 logit gap is a near-tie (a verify step sums in another order than a decode step)."""

from __future__ import annotations

import pytest
import torch

from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.flashinfer import FlashInferSampler
from flashserve.sample.rejection import verify
from flashserve.worker.input_batch import InputBatch

NEAR_TIE = 0.05  # logits closer than this may flip between a verify step and a decode step in bf16


def test_chain_speculative_sampling_keeps_the_targets_distribution():
    vocab, drafts, draws = 6, [2, 4], 4000
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen, device="cuda")
    logits[0, 2] += 1.0
    params = SamplingParams(temperature=1.0)
    rows = InputBatch().update(SchedulerOutput([ScheduledRequest("r", [0, *drafts], 4, [0], True, params, [1, 2, 3, 4],
                                                                 [], num_draft_tokens=2)]))
    sampler = FlashInferSampler(seed=1)
    counts = torch.zeros(vocab)
    for _ in range(draws):
        counts[verify(sampler, logits, rows)[0][0]] += 1
    expected = torch.softmax(logits[0].float(), -1).cpu() * draws
    assert float(((counts - expected) ** 2 / expected).sum()) < 20.52  # chi-square, 5 dof, p = 0.001


@pytest.fixture(scope="module")
def llm() -> LLM:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return LLM("llama-3.2-1b", load_format="dummy", num_pages=256, max_num_seqs=8, speculative_config=spec)


class Replay:
    """A proposer that replays a recorded greedy run (dummy weights' outputs hold no n-grams to
    look up), every third draft token wrong so that verify steps reject too."""

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        done = len(token_ids) - len(self.prompt)
        drafts = self.output[done : done + k]
        return [t if (done + j) % 3 else (t + 1) % 1000 for j, t in enumerate(drafts)]


def test_greedy_tokens_match_plain_decoding_up_to_near_ties(llm):
    prompt = list(range(100, 140)) * 4
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
    scheduler = llm.engine.scheduler
    speculator, scheduler.speculator = scheduler.speculator, None
    try:
        off = llm.generate([prompt], params)[0]
    finally:
        scheduler.speculator = speculator
    speculator.proposer = Replay(prompt, off.token_ids)
    on = llm.generate([prompt], params)[0]
    assert scheduler.spec_stats is not None and scheduler.spec_stats.num_accepted_tokens > 0
    first_diff = next((i for i, (a, b) in enumerate(zip(on.token_ids, off.token_ids)) if a != b), None)
    if first_diff is None:
        return
    # The first difference must be a near-tie of the target at that position.
    engine = llm.engine
    engine.add_request("lp", prompt, params)
    entries = []
    while engine.has_unfinished:
        for out in engine.step():
            entries += out.logprobs or []
    (_, top1), (_, top2) = entries[first_diff].top[:2]
    assert top1 - top2 < NEAR_TIE, f"position {first_diff} differs with a top-2 gap of {top1 - top2}"
