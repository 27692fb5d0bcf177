"""Cascade attention: the prefix level of a batch layout, and the reference backend's two levels.

The reference backend attends flat (tested against dense attention in test_attention_ref.py);
here its cascade result over the same cache must equal its flat one.
"""

from __future__ import annotations

import math
from array import array

import pytest
import torch

from flashserve.attention import torch_ref
from flashserve.attention.base import BatchLayout
from flashserve.attention.cascade import AUTO_MIN_SAVED_TOKENS, CascadePolicy, cascade_policy, find_groups
from flashserve.attention.torch_ref import TorchAttentionBackend, merge_attention_states
from flashserve.attention.torch_sdpa import SdpaAttentionBackend
from flashserve.engine.outputs import ScheduledRequest
from flashserve.message.sampling_params import SamplingParams

PAGE = 16
HEAD_DIM = 32
KV_HEADS = 2
Q_HEADS = 8
NUM_PAGES = 96
LAYERS = 2


class Pages:
    """Hands out shuffled page ids, never page 0 (the scratch page)."""

    def __init__(self, seed: int = 0) -> None:
        self.pool = torch.randperm(NUM_PAGES - 1, generator=torch.Generator().manual_seed(seed)).add(1).tolist()

    def take(self, n: int) -> list[int]:
        return [self.pool.pop() for _ in range(n)]


def req(i: int, pages: list[int], computed: int, new: int) -> ScheduledRequest:
    """Request `i` with `computed` tokens cached in `pages` and `new` tokens this step."""
    return ScheduledRequest(str(i), list(range(computed, computed + new)), computed, pages, True, SamplingParams())


def filled_backend(cls: type[TorchAttentionBackend] = TorchAttentionBackend, seed: int = 0) -> TorchAttentionBackend:
    """A backend whose every page holds random K/V: the cached tokens of any request."""
    backend = cls(LAYERS, NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM, torch.float32, "cpu", None, num_qo_heads=Q_HEADS)
    gen = torch.Generator().manual_seed(seed)
    for k_cache, v_cache in backend.kv_cache:
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
        v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    return backend


def step(backend: TorchAttentionBackend, layout: BatchLayout, seed: int = 1) -> list[torch.Tensor]:
    """Plans `layout` and attends every layer with seeded random q/k/v; the outputs per layer."""
    gen = torch.Generator().manual_seed(seed)
    backend.plan(layout)
    outs = []
    for layer in range(LAYERS):
        q = torch.randn(layout.num_tokens, Q_HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(layout.num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(layout.num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
        outs.append(backend.forward(layer, q, k, v))
    return outs


def assert_cascade_matches_flat(requests: list[ScheduledRequest], num_groups: int) -> BatchLayout:
    """The reference's cascade output equals its flat output on the same cache; returns the layout."""
    layout = BatchLayout.build(requests, PAGE, cascade=CascadePolicy())
    assert layout.prefix is not None and layout.prefix.num_groups == num_groups
    backend = filled_backend()
    # The same new K/V go to the same slots in both runs, so both attend over the same cache.
    flat = step(backend, BatchLayout.build(requests, PAGE))
    cascade = step(backend, layout)
    assert backend._plan is not None and backend._plan.prefix_groups
    for f, c in zip(flat, cascade):
        assert not c.isnan().any()
        torch.testing.assert_close(c, f, atol=1e-5, rtol=1e-5)
    return layout


# ---- the reference backend: cascade equals flat ------------------------------------------------


def test_several_groups_and_an_ungrouped_request_in_a_mixed_step_match_flat() -> None:
    p = Pages()
    a, b = p.take(3), p.take(2)
    requests = [
        req(0, a + p.take(1), 50, 1),  # group a: decodes and a prefill chunk
        req(1, a + p.take(2), 52, 7),
        req(2, a + p.take(1), 63, 1),
        req(3, p.take(2), 20, 5),  # in no group
        req(4, b + p.take(1), 40, 1),  # group b: decodes
        req(5, b + p.take(2), 33, 1),
    ]
    layout = assert_cascade_matches_flat(requests, num_groups=2)
    assert layout.prefix is not None and layout.prefix.prefix_pages == [3, 3, 3, 0, 2, 2]


def test_group_capped_by_a_member_whose_computed_tokens_end_mid_page_matches_flat() -> None:
    p = Pages()
    shared = p.take(3)
    # Request 1 computed 40 tokens: page 3 holds its new tokens, so the group shares 2 pages.
    requests = [req(0, shared + p.take(1), 60, 1), req(1, shared + p.take(1), 40, 9)]
    layout = assert_cascade_matches_flat(requests, num_groups=1)
    assert layout.prefix is not None and layout.prefix.prefix_pages == [2, 2]


def test_decode_only_step_with_groups_matches_flat() -> None:
    p = Pages()
    a, b = p.take(4), p.take(1)
    requests = [req(i, a + p.take(1), 64 + 3 * i, 1) for i in range(3)]
    requests += [req(3 + i, b + p.take(1), 16 + i, 1) for i in range(4)]
    layout = assert_cascade_matches_flat(requests, num_groups=2)
    assert layout.is_decode_only


@pytest.mark.parametrize("prompt_len", [32, 37])
def test_n_choices_of_one_prompt_decoding_match_flat(prompt_len: int) -> None:
    # The choices share the prompt's full pages; each has its own last page.
    p = Pages()
    prompt = p.take(prompt_len // PAGE)
    requests = [req(i, prompt + p.take(1), prompt_len + 3, 1) for i in range(4)]
    layout = assert_cascade_matches_flat(requests, num_groups=1)
    assert layout.prefix is not None and list(layout.prefix.kv_indices) == prompt


def test_prefill_chunks_behind_a_shared_system_prompt_match_flat() -> None:
    p = Pages()
    system = p.take(2)
    requests = [req(i, system + p.take(2), 32, n) for i, n in enumerate([10, 30, 17])]
    assert_cascade_matches_flat(requests, num_groups=1)


def test_prefix_groups_split_by_the_pair_budget_match_flat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_ref, "_MAX_PAIRS_PER_GROUP", 64)
    p = Pages()
    a, b = p.take(2), p.take(1)
    requests = [req(0, a + p.take(1), 33, 1), req(1, a + p.take(1), 40, 4), req(2, p.take(1), 3, 2)]
    requests += [req(3, b + p.take(1), 16, 1), req(4, b + p.take(1), 20, 1)]
    assert_cascade_matches_flat(requests, num_groups=2)


def test_sdpa_backend_given_a_cascade_layout_matches_the_reference_cascade() -> None:
    p = Pages()
    a = p.take(2)
    requests = [req(0, a + p.take(1), 40, 1), req(1, a + p.take(1), 35, 6), req(2, p.take(1), 5, 3)]
    layout = BatchLayout.build(requests, PAGE, cascade=CascadePolicy())
    for fast, ref in zip(step(filled_backend(SdpaAttentionBackend), layout), step(filled_backend(), layout)):
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


# ---- merging two partial results ----------------------------------------------------------------


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, D] over k/v [L, D] -> (o [N, D], natural-log lse [N])."""
    scores = q @ k.T / math.sqrt(q.shape[-1])
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def test_merge_of_two_key_halves_equals_attention_over_all_keys() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, HEAD_DIM, generator=gen) for n in (5, 24, 24))
    o_a, s_a = partial_attention(q, k[:9], v[:9])
    o_b, s_b = partial_attention(q, k[9:], v[9:])
    o_all, s_all = partial_attention(q, k, v)
    o, s = merge_attention_states(o_a, s_a, o_b, s_b)
    torch.testing.assert_close(o, o_all, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s, s_all, atol=1e-6, rtol=1e-5)


def test_merge_with_an_empty_side_returns_the_other_side_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    o, s = torch.randn(4, 3, HEAD_DIM, generator=gen), torch.randn(4, 3, generator=gen)
    empty_o, empty_s = torch.zeros_like(o), torch.full_like(s, float("-inf"))
    merged = [merge_attention_states(empty_o, empty_s, o, s), merge_attention_states(o, s, empty_o, empty_s)]
    for merged_o, merged_s in merged:
        assert torch.equal(merged_o, o) and torch.equal(merged_s, s)


def test_merge_of_two_empty_sides_is_zero_without_nan() -> None:
    o, s = torch.zeros(2, 3, HEAD_DIM), torch.full((2, 3), float("-inf"))
    merged_o, merged_s = merge_attention_states(o, s, o, s)
    assert torch.equal(merged_o, o) and torch.equal(merged_s, s)


# ---- the layout ---------------------------------------------------------------------------------


def test_cascade_false_builds_the_flat_layout_without_a_prefix_level() -> None:
    p = Pages()
    a = p.take(2)
    requests = [req(0, a + p.take(1), 33, 1), req(1, a + p.take(1), 32, 3)]  # they share 2 pages
    flat = BatchLayout.build(requests, PAGE)
    pages = array("i", requests[0].page_ids + requests[1].page_ids)  # build concatenates into an int32 array
    assert flat == BatchLayout(PAGE, [0, 1, 4], [0, 3, 6], pages, [2, 3], [33, 32, 33, 34])
    assert flat.prefix is None and flat.saved_kv_reads() == 0


def test_cascade_keeps_the_flat_fields_unchanged() -> None:
    p = Pages()
    a = p.take(2)
    requests = [req(0, a + p.take(1), 33, 1), req(1, p.take(1), 3, 2), req(2, a + p.take(2), 40, 9)]
    requests.insert(1, req(3, a + p.take(1), 35, 1))
    cascade, flat = BatchLayout.build(requests, PAGE, cascade=CascadePolicy()), BatchLayout.build(requests, PAGE)
    assert cascade.prefix is not None
    assert cascade == BatchLayout(flat.page_size, flat.qo_indptr, flat.kv_indptr, flat.kv_indices,
                                  flat.kv_last_page_len, flat.positions, cascade.prefix)  # fmt: skip


def test_groups_of_consecutive_requests_sharing_pages_are_found_in_csr_form() -> None:
    p = Pages()
    a, b = p.take(3), p.take(1)
    requests = [req(0, p.take(1), 4, 4), req(1, a + p.take(1), 48, 1), req(2, a + p.take(1), 50, 2)]
    requests += [req(3, b + p.take(1), 17, 1), req(4, b + p.take(1), 16, 5), req(5, b + p.take(1), 20, 1)]
    prefix = BatchLayout.build(requests, PAGE, cascade=CascadePolicy()).prefix
    assert prefix is not None
    assert (prefix.request_start, prefix.request_end) == ([1, 3], [3, 6])
    assert prefix.token_start == [4, 7] and prefix.qo_indptr == [0, 3, 10]
    assert prefix.kv_indptr == [0, 3, 4] and list(prefix.kv_indices) == a + b
    assert prefix.kv_last_page_len == [PAGE, PAGE]  # prefixes are whole pages
    assert prefix.prefix_pages == [0, 3, 3, 1, 1, 1]


def grouped_step() -> tuple[BatchLayout, list[int], list[int]]:
    """A lone request (4 new tokens), a group of two (3 tokens) behind pages a, a group of three
    (7 tokens) behind page b, then a lone request (2 tokens)."""
    p = Pages()
    a, b = p.take(3), p.take(1)
    requests = [req(0, p.take(1), 4, 4), req(1, a + p.take(1), 48, 1), req(2, a + p.take(1), 50, 2)]
    requests += [req(3, b + p.take(1), 17, 1), req(4, b + p.take(1), 16, 5), req(5, b + p.take(1), 20, 1)]
    requests += [req(6, p.take(1), 3, 2)]
    return BatchLayout.build(requests, PAGE, cascade=CascadePolicy()), a, b


def test_row_segments_cover_every_row_in_step_order_groups_over_their_prefix_others_over_scratch() -> None:
    layout, a, b = grouped_step()
    assert layout.prefix is not None
    segments = layout.prefix.row_segments(layout.num_tokens, scratch_page=0)
    assert segments is not None
    assert segments.qo_indptr == [0, 4, 7, 14, 16]
    assert list(segments.kv_indices) == [0, *a, *b, 0] and segments.kv_indptr == [0, 1, 4, 5, 6]
    assert segments.kv_last_page_len == [1, PAGE, PAGE, 1]
    assert list(segments.merge) == [0] * 4 + [1] * 10 + [0] * 2


def test_row_segments_of_a_graph_step_pad_its_rows_and_segments_to_fixed_counts() -> None:
    layout, a, b = grouped_step()
    assert layout.prefix is not None
    segments = layout.prefix.row_segments(layout.num_tokens, scratch_page=0, rows=20, slots=7)
    assert segments is not None and segments.num_segments == 7
    assert segments.qo_indptr == [0, 4, 7, 14, 20, 20, 20, 20]  # padding rows, then empty segments
    assert list(segments.kv_indices) == [0, *a, *b, 0, 0, 0, 0] and segments.kv_last_page_len[3:] == [1] * 4
    assert list(segments.merge) == [0] * 4 + [1] * 10 + [0] * 6


def test_row_segments_refuse_a_step_needing_more_segments_than_the_graph_has() -> None:
    layout, _, _ = grouped_step()
    assert layout.prefix is not None
    assert layout.prefix.row_segments(layout.num_tokens, 0, rows=20, slots=3) is None


def test_the_segment_count_a_graph_is_chosen_by_is_the_count_built() -> None:
    p = Pages()
    a, b = p.take(2), p.take(1)
    requests = [req(0, a + p.take(1), 33, 1), req(1, a + p.take(1), 40, 1), req(2, p.take(1), 3, 1)]
    requests += [req(3, b + p.take(1), 17, 1), req(4, b + p.take(1), 20, 1)]
    for members in (requests, requests[2:], requests[:2] + requests[3:]):
        layout = BatchLayout.build(members, PAGE, cascade=CascadePolicy())
        assert layout.prefix is not None
        for rows in (len(members), len(members) + 3):
            segments = layout.prefix.row_segments(layout.num_tokens, 0, rows=rows)
            assert segments is not None
            assert layout.prefix.num_row_segments(layout.num_tokens, rows) == segments.num_segments


def test_suffix_level_is_each_requests_pages_after_its_prefix() -> None:
    p = Pages()
    a = p.take(2)
    requests = [req(0, p.take(1), 4, 1), req(1, a + p.take(2), 40, 9), req(2, a + p.take(1), 33, 1)]
    layout = BatchLayout.build(requests, PAGE, cascade=CascadePolicy())
    assert layout.prefix is not None
    own = [requests[0].page_ids, requests[1].page_ids[2:], requests[2].page_ids[2:]]
    assert list(layout.prefix.suffix_kv_indices) == [page for pages in own for page in pages]
    assert layout.prefix.suffix_kv_indptr == [0, 1, 3, 4]


def test_shared_prefix_is_capped_at_the_fewest_computed_whole_pages() -> None:
    p = Pages()
    shared = p.take(4)
    # The same four page ids, but one member has computed only 2.5 pages.
    requests = [req(0, shared, 63, 1), req(1, shared + p.take(1), 64, 1), req(2, shared, 40, 24)]
    assert find_groups(requests, PAGE) == [(0, 3, 2)]


def test_a_member_with_less_than_a_computed_page_breaks_the_group() -> None:
    p = Pages()
    shared = p.take(2)
    requests = [req(0, shared + p.take(1), 33, 1), req(1, shared, 15, 10), req(2, shared + p.take(1), 40, 1)]
    assert BatchLayout.build(requests, PAGE, cascade=CascadePolicy()).prefix is None


def test_requests_sharing_pages_but_not_adjacent_form_no_group() -> None:
    p = Pages()
    a = p.take(2)
    requests = [req(0, a + p.take(1), 33, 1), req(1, p.take(1), 5, 1), req(2, a + p.take(1), 40, 1)]
    assert BatchLayout.build(requests, PAGE, cascade=CascadePolicy()).prefix is None


def test_min_group_leaves_smaller_groups_out() -> None:
    p = Pages()
    a, b = p.take(2), p.take(2)
    requests = [req(i, a + p.take(1), 33, 1) for i in range(3)]
    requests += [req(3 + i, b + p.take(1), 33, 1) for i in range(2)]
    assert find_groups(requests, PAGE) == [(0, 3, 2), (3, 5, 2)]
    assert find_groups(requests, PAGE, min_group=3) == [(0, 3, 2)]


def test_min_pages_leaves_shorter_prefixes_out() -> None:
    p = Pages()
    a, b = p.take(3), p.take(1)
    requests = [req(i, a + p.take(1), 49, 1) for i in range(2)]
    requests += [req(2 + i, b + p.take(1), 17, 1) for i in range(2)]
    assert find_groups(requests, PAGE, min_pages=2) == [(0, 2, 3)]
    assert BatchLayout.build(requests, PAGE, cascade=CascadePolicy(min_pages=4)).prefix is None


def test_nested_sharing_picks_the_split_that_saves_most_reads() -> None:
    # Four pairs of choices share 1 system page; each pair also shares 5 prompt pages.
    p = Pages(seed=1)
    system = p.take(1)
    pairs = [system + p.take(5) for _ in range(4)]
    requests = [req(2 * j + c, pairs[j] + p.take(1), 96, 1) for j in range(4) for c in range(2)]
    # Pairs: 4 * 1 * 6 pages = 24 saved; one group of 8 over the system page: 7 * 1 = 7.
    assert find_groups(requests, PAGE) == [(0, 2, 6), (2, 4, 6), (4, 6, 6), (6, 8, 6)]
    # A long system prompt under short pair prompts: one group of eight, 7 * 20 > 4 * 24.
    system = p.take(20)
    pairs = [system + p.take(4) for _ in range(4)]
    requests = [req(2 * j + c, pairs[j] + p.take(1), 384, 1) for j in range(4) for c in range(2)]
    assert find_groups(requests, PAGE) == [(0, 8, 20)]


def test_saved_kv_reads_count_members_minus_one_times_prefix_tokens() -> None:
    p = Pages()
    a, b = p.take(3), p.take(2)
    requests = [req(i, a + p.take(1), 48, 1) for i in range(4)]
    requests += [req(4 + i, b + p.take(1), 40, 1) for i in range(2)]
    layout = BatchLayout.build(requests, PAGE, cascade=CascadePolicy())
    assert layout.saved_kv_reads() == (3 * 3 + 1 * 2) * PAGE


@pytest.mark.parametrize(("min_group", "min_pages"), [(1, 1), (2, 0)])
def test_group_thresholds_below_their_minimum_are_refused(min_group: int, min_pages: int) -> None:
    with pytest.raises(ValueError, match="at least"):
        BatchLayout.build([req(0, [1], 0, 3)], PAGE, cascade=CascadePolicy(min_group, min_pages))


@pytest.mark.parametrize(("mode", "policy"), [
    ("on", CascadePolicy()), ("off", None), ("auto", CascadePolicy(min_saved_tokens=AUTO_MIN_SAVED_TOKENS)),
])
def test_cascade_modes_pick_the_group_thresholds(mode: str, policy: CascadePolicy | None) -> None:
    assert cascade_policy(mode) == policy


def test_a_step_whose_groups_save_too_few_reads_attends_flat() -> None:
    p = Pages()
    a, b = p.take(3), p.take(2)
    requests = [req(i, a + p.take(1), 48, 1) for i in range(4)]
    requests += [req(4 + i, b + p.take(1), 40, 1) for i in range(2)]
    saved = (3 * 3 + 1 * 2) * PAGE  # the groups' (members - 1) * prefix tokens
    assert BatchLayout.build(requests, PAGE, CascadePolicy(min_saved_tokens=saved)).prefix is not None
    assert BatchLayout.build(requests, PAGE, CascadePolicy(min_saved_tokens=saved + 1)).prefix is None


def test_unknown_cascade_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, on, off"):
        cascade_policy("always")



@pytest.mark.parametrize("seed", range(20))
def test_common_pages_of_two_page_tables_is_their_common_prefix_whatever_the_hint(seed: int) -> None:
    from flashserve.attention.cascade import _common_pages

    rng = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=rng))
    shared = int(torch.randint(0, n + 1, (1,), generator=rng))
    a = array("i", range(1, n + 1))
    b = array("i", list(range(1, shared + 1)) + list(range(100, 100 + n - shared)))
    limit = int(torch.randint(0, n + 1, (1,), generator=rng))
    for hint in (0, shared, limit, int(torch.randint(0, n + 1, (1,), generator=rng))):
        assert _common_pages(a, b, limit, hint) == min(shared, limit)
        assert _common_pages(list(a), list(b), limit, hint) == min(shared, limit)
