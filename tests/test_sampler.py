"""The sampler's specification: one behaviour per test, on CPU tensors."""

from __future__ import annotations

import warnings
from array import array

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from flashserve.worker.input_batch import BatchRow


def make_request(
    prompt: list[int] | None = None, output: list[int] | None = None, **params: object
) -> BatchRow:
    """A runner's row of a request that samples this step."""
    return BatchRow("r", SamplingParams(max_tokens=64, **params), array("i", prompt or []), array("i", output or []),
                    array("i", [0]), [0], 0, True)


def random_logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(4, 100)
    ids = Sampler().sample(logits, [make_request(temperature=0.0) for _ in range(4)])
    assert ids == logits.argmax(dim=-1).tolist()


def test_sample_leaves_the_callers_logits_untouched() -> None:
    logits = random_logits(2, 50)
    before = logits.clone()
    Sampler().sample(logits, [make_request(output=[1, 2], repetition_penalty=1.5, top_k=5)] * 2)
    assert torch.equal(logits, before)


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = random_logits(3, 40)
    k = torch.tensor([1, 5, 40])
    out = apply_top_k_top_p(logits, k, None)
    for row in range(3):
        kept = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert kept == set(logits[row].topk(int(k[row])).indices.tolist())
        assert torch.equal(out[row][list(kept)], logits[row][list(kept)])


def reference_top_p(probs: list[float], p: float) -> set[int]:
    """The smallest set of most likely tokens whose probability reaches p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("p", [0.05, 0.3, 0.62, 0.9, 0.999])
def test_top_p_keeps_the_smallest_prefix_reaching_p(p: float) -> None:
    logits = random_logits(4, 30, seed=1)
    out = apply_top_k_top_p(logits, None, torch.full((4,), p))
    for row in range(4):
        kept = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert kept == reference_top_p(logits[row].softmax(-1).tolist(), p)


def test_top_p_keeps_at_least_one_token() -> None:
    logits = torch.tensor([[10.0, 0.0, -1.0, -2.0]])
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-6]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_top_k_applies_before_top_p() -> None:
    # Probabilities 0.4, 0.3, 0.2, 0.1: top-k=2 renormalises to 4/7, 3/7, so top-p=0.5 keeps one.
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_min_p_masks_tokens_below_a_fraction_of_the_top_probability() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.5, 0.2, 0.15, 0.1, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.25, 0.0]))
    # 0.25 * 0.5 = 0.125: keep 0.5, 0.2, 0.15.
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False], [True] * 5]


def test_repetition_penalty_matches_hf() -> None:
    logits = random_logits(3, 60, seed=2)
    prompts, outputs, penalties = [[1, 5, 7, 7], [3, 59], [2]], [[9, 5, 11], [0], [4]], [1.3, 0.7, 1.0]
    ours = logits.clone()
    apply_penalties(
        ours, [make_request(p, o, repetition_penalty=rp) for p, o, rp in zip(prompts, outputs, penalties)]
    )
    for row, (p, o, rp) in enumerate(zip(prompts, outputs, penalties)):
        expected = RepetitionPenaltyLogitsProcessor(rp)(torch.tensor([p + o]), logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], expected)


def test_repetition_penalty_pushes_negative_logits_down() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    apply_penalties(logits, [make_request([0, 1], [], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 1.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = random_logits(2, 20, seed=3)
    requests = [
        make_request([4, 4, 4], [1, 2, 2, 7, 2], frequency_penalty=0.5, presence_penalty=0.25),
        make_request([1], [3, 3], frequency_penalty=-1.0, presence_penalty=1.5),
    ]
    expected = logits.clone()
    for row, r in enumerate(requests):
        for tok in set(r.output_token_ids):
            count = r.output_token_ids.count(tok)
            expected[row, tok] -= r.params.frequency_penalty * count + r.params.presence_penalty
    ours = logits.clone()
    apply_penalties(ours, requests)
    torch.testing.assert_close(ours, expected)


def test_penalties_stay_exact_over_steps() -> None:
    sampler = Sampler()
    logits = random_logits(1, 30, seed=6)
    prompt = [1, 2, 3]
    request = make_request(prompt, [], temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4)
    for _ in range(6):
        expected = logits.clone()
        apply_penalties(expected, [make_request(prompt, list(request.output_token_ids), **_penalties(request))])
        assert sampler.sample(logits, [request]) == expected.argmax(-1).tolist()
        request.output_token_ids.append(sampler.sample(logits, [request])[0])  # as the runner's collect does


def _penalties(r: BatchRow) -> dict[str, float]:
    p = r.params
    return dict(repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty)


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 2] = 100.0  # EOS is by far the most likely
    logits[:, 5] = 50.0  # then a stop token id
    common = dict(temperature=0.0, eos_token_ids=(2,), stop_token_ids=(5,), min_tokens=3)
    requests = [
        make_request(output=[1, 1], **common),  # below min_tokens: both masked
        make_request(output=[1, 1, 1], **common),  # reached: EOS allowed
        make_request(output=[], ignore_eos=True, **common),  # EOS is not masked when ignored
    ]
    assert Sampler().sample(logits, requests) == [0, 2, 2]


def test_temperature_zero_applies_penalties_before_argmax() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    requests = [make_request([0], [0], temperature=0.0, repetition_penalty=2.0)]
    assert Sampler().sample(logits, requests) == [1]


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    logits = random_logits(6, 100, seed=4)
    requests = [make_request(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    ids = Sampler().sample(logits, requests)
    assert ids[1::2] == logits[1::2].argmax(-1).tolist()


def test_seeded_request_is_the_same_alone_and_in_a_batch() -> None:
    vocab = 1000
    row = torch.zeros(vocab)  # uniform: every token equally likely, so only the noise decides
    seeded = make_request(output=[3, 4, 5], seed=1234, top_p=0.9)
    alone = Sampler(seed=0).sample(row.unsqueeze(0), [seeded])
    others = [make_request(output=[1] * i, temperature=0.5 + 0.1 * i) for i in range(4)]
    batch = torch.cat([random_logits(2, vocab), row.unsqueeze(0), random_logits(2, vocab, 9)])
    in_batch = Sampler(seed=99).sample(batch, others[:2] + [seeded] + others[2:])
    assert in_batch[2] == alone[0]


def test_seeded_request_repeats_after_recompute() -> None:
    logits = torch.zeros(1, 500)
    tokens = []
    for _ in range(2):  # the same request sampled twice at each output position
        output: list[int] = []
        for _ in range(8):
            output.append(Sampler().sample(logits, [make_request(output=list(output), seed=7)])[0])
        tokens.append(output)
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0])) > 1  # and the draws differ from one position to the next


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(8, 1000)
    ids = Sampler().sample(logits, [make_request(seed=s) for s in range(8)])
    assert len(set(ids)) > 4


def test_unseeded_rows_draw_fresh_noise() -> None:
    sampler = Sampler()
    logits = torch.zeros(1, 1000)
    ids = [sampler.sample(logits, [make_request()])[0] for _ in range(8)]
    assert len(set(ids)) > 4


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_sampled_frequencies_follow_the_softmax(temperature: float) -> None:
    draws = 40_000
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5, 2.0])
    ids = Sampler(seed=1).sample(
        base.expand(draws, -1).contiguous(), [make_request(temperature=temperature)] * draws
    )
    counts = torch.bincount(torch.tensor(ids), minlength=base.numel()).double()
    expected = (base.double() / temperature).softmax(-1) * draws
    # Each count is binomial: allow 5 standard deviations.
    sigma = (expected * (1 - expected / draws)).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1).all(), (counts, expected)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0  # 5 degrees of freedom: p < 0.001


def test_sampling_never_picks_a_masked_token() -> None:
    draws = 5_000
    logits = random_logits(1, 50, seed=5).expand(draws, -1).contiguous()
    top5 = set(logits[0].topk(5).indices.tolist())
    ids = Sampler().sample(logits, [make_request(top_k=5, temperature=2.0)] * draws)
    assert set(ids) <= top5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampling_syncs_once_and_matches_seeded_rows() -> None:
    vocab = 32_000
    logits = random_logits(4, vocab).cuda()
    requests = [
        make_request([1, 2], [3, 3], repetition_penalty=1.2, frequency_penalty=0.5, top_k=50),
        make_request(output=[1], seed=5, top_p=0.8, min_p=0.05),
        make_request(temperature=0.0, min_tokens=4, eos_token_ids=(2,)),
        make_request(temperature=0.7),
    ]
    sampler = Sampler()
    sampler.sample(logits, requests)  # warm-up: first-use allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ids = sampler.sample(logits, requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]  # the final .tolist()
    masked = logits[2].clone()
    masked[2] = float("-inf")
    assert ids[2] == int(masked.argmax())
    assert ids[1] == sampler.sample(logits[1:2], requests[1:2])[0]


def test_logit_bias_minus_100_bans_the_greedy_token() -> None:
    logits = random_logits(2, 100)
    top = logits.argmax(dim=-1).tolist()
    requests = [make_request(temperature=0.0, logit_bias=((top[0], -100.0),)), make_request(temperature=0.0)]
    ids = Sampler().sample(logits, requests)
    assert ids[0] != top[0] and ids[0] == logits[0].topk(2).indices[1].item()
    assert ids[1] == top[1]  # a row without a bias is left alone


def test_logit_bias_plus_100_forces_a_token_when_sampling() -> None:
    logits = random_logits(8, 100)
    requests = [make_request(temperature=1.0, top_p=0.9, logit_bias=((37, 100.0),)) for _ in range(8)]
    assert Sampler(3).sample(logits, requests) == [37] * 8


def test_logit_bias_adds_to_the_logits_before_the_softmax() -> None:
    logits = torch.zeros(1, 4)
    request = make_request(temperature=1.0, logit_bias=((1, 2.0), (3, -1.0)))
    probs = torch.softmax(torch.tensor([0.0, 2.0, 0.0, -1.0]), dim=0)
    counts = torch.bincount(torch.tensor([Sampler(s).sample(logits, [request])[0] for s in range(2000)]), minlength=4)
    assert torch.allclose(counts / 2000, probs, atol=0.04)
