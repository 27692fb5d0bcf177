"""The FlashInfer sampler keeps the CPU sampler's contract on a GPU."""

from __future__ import annotations

from dataclasses import replace

import torch

from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.flashinfer import FlashInferSampler
from flashserve.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p
from flashserve.worker.input_batch import BatchRow, InputBatch


def request(
    params: SamplingParams, output: list[int] | None = None, prompt: list[int] | None = None, request_id: str = "r"
) -> BatchRow:
    """A runner's row of a request that samples this step."""
    (row,) = InputBatch().update(SchedulerOutput([
        ScheduledRequest(request_id, [0], 0, [], True, params, prompt or [1, 2, 3], output or [])]))
    return row


def designed_logits(rows: int) -> torch.Tensor:
    """Probabilities 0.4, 0.3, 0.15, 0.1, 0.04, then 0.01 spread over 59 tokens: every filter
    threshold below sits well inside a gap."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04] + [0.01 / 59] * 59)
    return probs.log().repeat(rows, 1).cuda()


def allowed_by_cpu_rules(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens the CPU sampler's filters keep for row 0 (temperature applied first)."""
    row = logits[:1] / p.temperature
    vocab = row.shape[1]
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab], device=row.device)
    row = apply_top_k_top_p(row, k, torch.tensor([p.top_p], device=row.device))
    if p.min_p > 0:
        row = apply_min_p(row, torch.tensor([p.min_p], device=row.device))
    return set(torch.isfinite(row[0]).nonzero().flatten().tolist())


def draw_many(sampler: FlashInferSampler, logits: torch.Tensor, p: SamplingParams, calls: int = 8) -> list[int]:
    reqs = [request(p)] * logits.shape[0]
    return [t for _ in range(calls) for t in sampler.sample(logits, reqs)]


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(16, 1000, device="cuda") * 3
    sampler = FlashInferSampler(seed=0)
    greedy = SamplingParams(temperature=0.0)
    assert sampler.sample(logits, [request(greedy)] * 16) == logits.argmax(-1).tolist()
    mixed = [request(greedy if i % 2 == 0 else SamplingParams(temperature=1.0)) for i in range(16)]
    ids = sampler.sample(logits, mixed)
    assert ids[::2] == logits.argmax(-1).tolist()[::2]


def test_filtered_samples_stay_in_the_allowed_set() -> None:
    sampler = FlashInferSampler(seed=1)
    logits = designed_logits(512)
    cases = [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.65), {0, 1}),
        (SamplingParams(top_p=0.8), {0, 1, 2}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),
        (SamplingParams(top_k=3, top_p=0.9, min_p=0.5), {0, 1}),
        (SamplingParams(temperature=0.5, top_k=4, top_p=0.7), {0, 1}),
    ]
    for params, expected in cases:
        assert allowed_by_cpu_rules(logits, params) == expected, params
        drawn = set(draw_many(sampler, logits, params))
        # Inside the allowed set, and over 4096 draws every allowed token shows up.
        assert drawn == expected, (params, drawn)
        # Seeded rows are drawn one by one (scalar parameters): 128 of them, each its own seed.
        seeded = [request(replace(params, seed=11), output=[0] * j, request_id=str(j)) for j in range(128)]
        drawn_seeded = set(sampler.sample(logits[:128], seeded))
        assert drawn_seeded == expected, (params, drawn_seeded)


def test_top_k_on_random_logits_keeps_the_k_largest() -> None:
    sampler = FlashInferSampler(seed=2)
    logits = torch.randn(256, 5000, device="cuda") * 2
    params = SamplingParams(top_k=7)
    reqs = [request(params)] * 256
    top7 = logits.topk(7, dim=-1).indices
    for _ in range(8):
        ids = torch.tensor(sampler.sample(logits, reqs), device="cuda")
        assert (top7 == ids[:, None]).any(-1).all()


def test_seeded_request_draws_the_same_token_in_any_batch() -> None:
    sampler = FlashInferSampler(seed=3)
    logits = torch.randn(1, 32000, device="cuda")
    seeded = SamplingParams(temperature=1.0, seed=1234)
    tokens = []
    for step in range(12):
        alone = sampler.sample(logits, [request(seeded, output=[5] * step)])[0]
        batch_logits = torch.cat([torch.randn(2, 32000, device="cuda"), logits, torch.randn(1, 32000, device="cuda")])
        batch = [
            request(SamplingParams(temperature=1.0)),
            request(SamplingParams(temperature=0.8, seed=99)),
            request(seeded, output=[5] * step),
            request(SamplingParams(temperature=0.0)),
        ]
        assert sampler.sample(batch_logits, batch)[2] == alone
        tokens.append(alone)
    # The seed mixes in the output length: a flat distribution gives different tokens per step.
    assert len(set(tokens)) > 6


def test_distribution_matches_softmax_over_temperature() -> None:
    sampler = FlashInferSampler(seed=4)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3]], device="cuda")
    temperature = 0.7
    draws = draw_many(sampler, logits.repeat(4096, 1), SamplingParams(temperature=temperature), calls=8)
    freq = torch.bincount(torch.tensor(draws), minlength=8).double() / len(draws)
    expected = torch.softmax(logits[0].double().cpu() / temperature, dim=-1)
    # 32768 draws: one standard deviation is at most 0.0028.
    assert (freq - expected).abs().max().item() < 0.012, (freq, expected)
    sigma = (expected * (1 - expected) / len(draws)).sqrt()
    print(f"ERR sampler max |freq - p| / sigma = {((freq - expected).abs() / sigma).max().item():.2f}")


def test_penalties_and_min_tokens_match_the_cpu_sampler() -> None:
    gen = torch.Generator("cuda").manual_seed(5)
    logits = torch.randn(4, 300, device="cuda", generator=gen) * 3
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0.0, min_tokens=2, eos_token_ids=(top[2],)),
        SamplingParams(temperature=0.0, repetition_penalty=0.5),
    ]
    reqs = [request(p, output=[top[i], top[i], 11], prompt=[top[i], 7], request_id=str(i)) for i, p in enumerate(params)]
    reqs[2] = request(params[2], output=[3], request_id="2")
    expected = Sampler(seed=0).sample(logits, reqs)
    assert FlashInferSampler(seed=0).sample(logits, reqs) == expected
    assert expected[2] != top[2]
