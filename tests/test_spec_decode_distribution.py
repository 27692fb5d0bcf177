"""Rejection sampling keeps the target's distribution: with n-gram drafts (one-hot), the tokens a
verified row emits are distributed as plain sampling from the target would give them. Checked with
a chi-square test on a small vocabulary, with fixed seeds."""

from __future__ import annotations

import torch

from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.rejection import verify
from flashserve.sample.sampler import Sampler
from flashserve.worker.input_batch import InputBatch

VOCAB = 6
DRAFTS = [2, 4]
DRAWS = 3000
CHI2_DF5_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_emitted_tokens_follow_the_targets_distribution_at_each_position():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(DRAFTS) + 1, VOCAB, generator=gen)
    logits[0, DRAFTS[0]] += 1.0  # drafts that are often, not always, accepted
    logits[1, DRAFTS[1]] += 1.0
    params = SamplingParams(temperature=0.8)
    target = torch.softmax(logits / 0.8, dim=-1)
    row = ScheduledRequest("r", [0, *DRAFTS], 4, [0], True, params, [1, 2, 3, 4], [], num_draft_tokens=len(DRAFTS))
    rows = InputBatch().update(SchedulerOutput([row]))
    sampler = Sampler(seed=1)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)  # after the first draft was emitted
    for _ in range(DRAWS):
        (tokens,) = verify(sampler, logits, rows)
        first[tokens[0]] += 1
        if tokens[0] == DRAFTS[0]:
            second[tokens[1]] += 1
    assert 0.2 < first[DRAFTS[0]] / DRAWS < 0.9  # both branches (accepted, rejected) were taken
    assert chi_square(first, target[0]) < CHI2_DF5_P001
    assert chi_square(second, target[1]) < CHI2_DF5_P001
