"""The reference paged attention equals dense causal attention computed from scratch."""

from __future__ import annotations

import math

import pytest
import torch

from flashserve.attention import torch_ref
from flashserve.attention.base import BatchLayout
from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.engine.outputs import ScheduledRequest
from flashserve.message.sampling_params import SamplingParams

PAGE = 16
HEAD_DIM = 64
KV_HEADS = 2
NUM_PAGES = 64


class Sequence:
    """One request's full q/k/v, its shuffled pages, and its dense causal attention output."""

    def __init__(self, length: int, q_heads: int, pages: list[int], gen: torch.Generator) -> None:
        self.q = torch.randn(length, q_heads, HEAD_DIM, generator=gen)
        self.k = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen)
        self.v = torch.randn(length, KV_HEADS, HEAD_DIM, generator=gen)
        self.pages = pages
        self.expected = dense_causal_attention(self.q, self.k, self.v)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Token p attends to tokens 0..p; kv heads repeated to the query heads."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    n = q.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).float()


def make_sequences(lengths: list[int], q_heads: int, seed: int = 0) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(NUM_PAGES, generator=gen).tolist()  # non-contiguous, shuffled pages
    seqs = []
    for length in lengths:
        n_pages = (length + PAGE - 1) // PAGE
        seqs.append(Sequence(length, q_heads, [pool.pop() for _ in range(n_pages)], gen))
    return seqs


def run_step(backend: TorchAttentionBackend, seqs: list[Sequence], chunks: list[tuple[int, int]]) -> None:
    """Runs one step over chunk [start, end) of each sequence on every layer; checks the output."""
    params = SamplingParams()
    requests = [
        ScheduledRequest(str(i), list(range(a, b)), a, s.pages, True, params)
        for i, (s, (a, b)) in enumerate(zip(seqs, chunks))
    ]
    backend.plan(BatchLayout.build(requests, PAGE))
    q = torch.cat([s.q[a:b] for s, (a, b) in zip(seqs, chunks)])
    k = torch.cat([s.k[a:b] for s, (a, b) in zip(seqs, chunks)])
    v = torch.cat([s.v[a:b] for s, (a, b) in zip(seqs, chunks)])
    expected = torch.cat([s.expected[a:b] for s, (a, b) in zip(seqs, chunks)])
    for layer in range(backend.num_layers):
        out = backend.forward(layer, q, k, v)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def make_backend(dtype: torch.dtype = torch.float32, num_layers: int = 1) -> TorchAttentionBackend:
    return TorchAttentionBackend(num_layers, NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM, dtype, "cpu", None)


@pytest.mark.parametrize("length", [1, 7, 16, 21, 32, 33])
def test_single_prefill_matches_dense_at_aligned_and_unaligned_lengths(length: int) -> None:
    seqs = make_sequences([length], q_heads=KV_HEADS * 4)
    run_step(make_backend(), seqs, [(0, length)])


@pytest.mark.parametrize("group", [1, 3, 4])
def test_mixed_prefill_and_decode_batch_matches_dense(group: int) -> None:
    # Prefixes of 16 and 32 (page-aligned), 5 and 37 (unaligned), and one request new this step.
    prefixes = [16, 32, 5, 37, 0]
    new = [1, 9, 1, 12, 20]
    seqs = make_sequences([p + n + 3 for p, n in zip(prefixes, new)], q_heads=KV_HEADS * group)
    backend = make_backend(num_layers=2)
    run_step(backend, seqs[:4], [(0, p) for p in prefixes[:4]])
    run_step(backend, seqs, [(p, p + n) for p, n in zip(prefixes, new)])
    for step in range(3):  # decode steps for everyone after the mixed step
        run_step(backend, seqs, [(p + n + step, p + n + step + 1) for p, n in zip(prefixes, new)])


def test_chunked_prefill_across_steps_matches_dense() -> None:
    seqs = make_sequences([50, 20], q_heads=KV_HEADS * 3)
    backend = make_backend()
    run_step(backend, seqs, [(0, 16), (0, 7)])
    run_step(backend, seqs, [(16, 33), (7, 20)])
    run_step(backend, seqs[:1], [(33, 50)])


def test_decode_at_page_boundary_attends_to_the_full_prefix() -> None:
    # kv_len 16 and 32 fill their last page exactly (last_page_len == page_size, never 0).
    seqs = make_sequences([17, 33], q_heads=KV_HEADS)
    backend = make_backend()
    run_step(backend, seqs, [(0, 15), (0, 31)])
    run_step(backend, seqs, [(15, 16), (31, 32)])
    run_step(backend, seqs, [(16, 17), (32, 33)])


def test_append_writes_kv_into_the_slots_of_the_request_pages() -> None:
    seqs = make_sequences([21], q_heads=KV_HEADS)
    backend = make_backend()
    run_step(backend, seqs, [(0, 21)])
    k_cache, v_cache = backend.kv_cache[0]
    pages = seqs[0].pages
    torch.testing.assert_close(k_cache[pages[0]], seqs[0].k[:16])
    torch.testing.assert_close(k_cache[pages[1], :5], seqs[0].k[16:21])
    torch.testing.assert_close(v_cache[pages[1], :5], seqs[0].v[16:21])


def test_small_group_budget_splits_the_batch_without_changing_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_ref, "_MAX_PAIRS_PER_GROUP", 64)
    seqs = make_sequences([10, 31, 3, 18], q_heads=KV_HEADS * 4)
    backend = make_backend()
    run_step(backend, seqs, [(0, 9), (0, 30), (0, 2), (0, 17)])
    assert len(backend._plan.groups) > 1
    run_step(backend, seqs, [(9, 10), (30, 31), (2, 3), (17, 18)])


def test_bfloat16_cache_stays_close_to_dense() -> None:
    seqs = make_sequences([24, 5], q_heads=KV_HEADS * 2)
    backend = make_backend(dtype=torch.bfloat16)
    requests = [
        ScheduledRequest(str(i), list(range(len(s.q))), 0, s.pages, True, SamplingParams()) for i, s in enumerate(seqs)
    ]
    backend.plan(BatchLayout.build(requests, PAGE))
    q = torch.cat([s.q for s in seqs]).bfloat16()
    out = backend.forward(0, q, torch.cat([s.k for s in seqs]), torch.cat([s.v for s in seqs]))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.cat([s.expected for s in seqs]), atol=5e-2, rtol=5e-2)


def test_query_heads_other_than_the_model_heads_are_refused() -> None:
    backend = TorchAttentionBackend(1, NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM, torch.float32, "cpu", None,
                                    num_qo_heads=KV_HEADS * 2)
    seqs = make_sequences([5], q_heads=KV_HEADS * 4)
    with pytest.raises(ValueError, match="built for"):
        run_step(backend, seqs, [(0, 5)])


@pytest.mark.parametrize(
    ("cached", "new", "first"),
    [
        ([40, 100, 0, 0], [1, 30, 20, 17], 2),  # decodes and a chunk after its prefix, then two fresh prompts
        ([0, 0], [5, 33], 0),  # only fresh prompts
        ([0, 40], [16, 1], 2),  # the last request decodes: no trailing fresh prompt
        ([0, 16, 0], [7, 16, 32], 2),  # a fresh prompt before a chunk after a page-aligned prefix
    ],
)
def test_fresh_prompts_at_the_end_of_a_step_are_found(cached: list[int], new: list[int], first: int) -> None:
    """`fresh_rows_from` is where the step's trailing prompts with nothing cached start: those
    rows attend only K/V of this step (the FlashInfer backend attends them apart)."""
    params = SamplingParams()
    rows = [ScheduledRequest(str(i), [1] * n, c, list(range(1 + 10 * i, 11 + 10 * i)), True, params)
            for i, (c, n) in enumerate(zip(cached, new))]  # fmt: skip
    assert BatchLayout.build(rows, 16).fresh_rows_from() == first


def layout_of(cached: list[int], new: list[int]) -> BatchLayout:
    """Request i's pages are 1 + 10 * i, 2 + 10 * i, ...; page size 16."""
    params = SamplingParams()
    rows = [ScheduledRequest(str(i), [1] * n, c, list(range(1 + 10 * i, 1 + 10 * i + -(-(c + n) // 16))), True, params)
            for i, (c, n) in enumerate(zip(cached, new))]  # fmt: skip
    return BatchLayout.build(rows, 16)


@pytest.mark.parametrize(
    ("cached", "new", "min_tokens", "first"),
    [
        ([40, 100, 21, 0], [1, 30, 20, 17], 2, 1),  # a decode, two continued prompts, a fresh one
        ([40, 100, 21, 0], [1, 30, 20, 17], 25, 3),  # the 20-token chunk is below the minimum: none
        ([0, 21, 0], [7, 30, 5], 2, 1),  # a fresh prompt before the continued one stops the run
        ([40, 0], [1, 30], 2, 1),  # a decode before the fresh prompt: no continued prompt
    ],
)
def test_continued_prompts_before_the_fresh_ones_are_found(cached: list[int], new: list[int], min_tokens: int,
                                                            first: int) -> None:  # fmt: skip
    """`continued_rows_from` is where the run of prompts continued over cached tokens, just before
    the fresh ones, starts: those rows may attend apart too, their cached tokens in a second pass."""
    layout = layout_of(cached, new)
    assert layout.continued_rows_from(layout.fresh_rows_from(), min_tokens) == first


def test_prefix_pages_hold_only_the_tokens_cached_before_the_step() -> None:
    """A continued prompt's cached tokens: its first pages, the last one filled to where its new
    tokens start (page-aligned: full), over those rows alone."""
    layout = layout_of([40, 100, 32], [1, 30, 20])
    assert layout.prefix_pages(range(1, 3)) == ([0, 7, 9], [11, 12, 13, 14, 15, 16, 17, 21, 22], [4, 16])
