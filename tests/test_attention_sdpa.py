"""The fused-kernel PyTorch backend (the CPU default) equals the reference backend, step by step."""

from __future__ import annotations

import pytest
import torch

from flashserve.attention import get_backend_cls, torch_sdpa
from flashserve.attention.base import BatchLayout
from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.attention.torch_sdpa import SdpaAttentionBackend
from flashserve.engine.outputs import ScheduledRequest
from flashserve.message.sampling_params import SamplingParams

PAGE = 16
HEAD_DIM = 64
KV_HEADS = 3
Q_HEADS = 9  # SmolLM2's grouping: 3 query heads per kv head
NUM_PAGES = 96
LAYERS = 2


def backends() -> tuple[TorchAttentionBackend, SdpaAttentionBackend]:
    args = (LAYERS, NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM, torch.float32, "cpu", None)
    return TorchAttentionBackend(*args, num_qo_heads=Q_HEADS), SdpaAttentionBackend(*args, num_qo_heads=Q_HEADS)


def page_lists(lengths: list[int], seed: int) -> list[list[int]]:
    """Shuffled, non-contiguous pages (never page 0, the scratch page) for each final length."""
    pool = torch.randperm(NUM_PAGES - 1, generator=torch.Generator().manual_seed(seed)).add(1).tolist()
    return [[pool.pop() for _ in range(-(-n // PAGE))] for n in lengths]


def run_steps(steps: list[list[tuple[int, int]]], lengths: list[int], seed: int = 0) -> None:
    """Each step lists (start, end) of every request's new tokens ((0, 0): not in this step).

    Both backends see the same layout and the same random q/k/v on every layer; their outputs
    must agree to float32 precision.
    """
    ref, fast = backends()
    pages = page_lists(lengths, seed)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams()
    for chunks in steps:
        requests = [
            ScheduledRequest(str(i), list(range(a, b)), a, pages[i], True, params)
            for i, (a, b) in enumerate(chunks) if b > a
        ]  # fmt: skip
        layout = BatchLayout.build(requests, PAGE)
        ref.plan(layout)
        fast.plan(layout)
        tokens = layout.num_tokens
        for layer in range(LAYERS):
            q = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=gen)
            k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
            v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
            torch.testing.assert_close(fast.forward(layer, q, k, v), ref.forward(layer, q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 32, 33])
def test_whole_prompts_match_the_reference_at_aligned_and_unaligned_lengths(length: int) -> None:
    run_steps([[(0, length)]], [length])


def test_ragged_batch_of_prompts_with_gqa_matches_the_reference() -> None:
    lengths = [16, 5, 32, 40, 1]
    run_steps([[(0, n) for n in lengths]], lengths)


def test_prompt_chunks_after_cached_tokens_match_the_reference() -> None:
    # Chunks ending at a page boundary, inside a page, and one token long (a continued prompt).
    run_steps([[(0, 16)], [(16, 32)], [(32, 45)], [(45, 46)], [(46, 47)]], [47])


def test_decode_batch_at_page_boundaries_matches_the_reference() -> None:
    lengths = [17, 33, 20]  # decodes at positions 16 and 32 start a new page
    run_steps([[(0, 16), (0, 32), (0, 19)], [(16, 17), (32, 33), (19, 20)]], lengths)


def test_mixed_step_of_decodes_continued_and_new_prompts_matches_the_reference() -> None:
    lengths = [33, 48, 24]
    run_steps([[(0, 32), (0, 16), (0, 0)], [(32, 33), (16, 48), (0, 24)]], lengths)


def test_decode_batches_split_by_the_slot_budget_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_sdpa, "_MAX_DECODE_SLOTS", 2 * PAGE)
    lengths = [10, 30, 17, 3]
    run_steps([[(0, 9), (0, 29), (0, 16), (0, 2)], [(9, 10), (29, 30), (16, 17), (2, 3)]], lengths)


def test_new_tokens_are_written_into_the_request_pages() -> None:
    ref, fast = backends()
    requests = [ScheduledRequest("a", list(range(20)), 0, [7, 3], True, SamplingParams())]
    layout = BatchLayout.build(requests, PAGE)
    ref.plan(layout)
    fast.plan(layout)
    q = torch.randn(20, Q_HEADS, HEAD_DIM)
    k, v = torch.randn(20, KV_HEADS, HEAD_DIM), torch.randn(20, KV_HEADS, HEAD_DIM)
    ref.forward(0, q, k, v)
    fast.forward(0, q, k, v)
    assert torch.equal(fast.kv_cache[0][0], ref.kv_cache[0][0])
    assert torch.equal(fast.kv_cache[0][1], ref.kv_cache[0][1])


def test_torch_backend_name_is_the_fused_path_and_reference_the_oracle() -> None:
    assert get_backend_cls("torch") is SdpaAttentionBackend
    assert get_backend_cls("reference") is TorchAttentionBackend


def test_forward_before_plan_is_refused() -> None:
    _, fast = backends()
    with pytest.raises(RuntimeError, match="plan"):
        fast.forward(0, torch.zeros(1, Q_HEADS, HEAD_DIM), torch.zeros(1, KV_HEADS, HEAD_DIM), torch.zeros(1, KV_HEADS, HEAD_DIM))


def test_a_chunk_whose_past_ends_mid_page_matches_the_reference() -> None:
    # Pasts of 21 and 45 tokens: the past's last page is partly filled by the chunk itself.
    run_steps([[(0, 21)], [(21, 45)], [(45, 70)]], [70])


def test_continued_chunks_without_the_lse_kernel_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_sdpa, "_FLASH_WITH_LSE", None)  # one masked call instead of two merged
    run_steps([[(0, 21)], [(21, 45)], [(45, 46)]], [46])

