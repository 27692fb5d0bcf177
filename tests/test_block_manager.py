"""BlockManager: page accounting, page-aligned lengths, exhaustion, freeing, growth."""

from __future__ import annotations

import pytest

from flashserve.engine.block_manager import SCRATCH_PAGE, BlockManager, BlockManagerError


def test_free_plus_used_equals_capacity() -> None:
    bm = BlockManager(num_pages=10, page_size=16)
    assert bm.capacity == 9  # page 0 is the scratch page
    assert bm.num_free_pages == 9 and bm.num_used_pages == 0
    assert bm.allocate("a", 40)
    assert bm.allocate("b", 1)
    assert bm.num_used_pages == 4
    assert bm.num_free_pages + bm.num_used_pages == bm.capacity


def test_scratch_page_is_never_handed_out() -> None:
    bm = BlockManager(num_pages=5, page_size=4)
    assert bm.allocate("a", 16)
    assert SCRATCH_PAGE not in bm.pages("a")
    assert not bm.allocate("b", 1)


@pytest.mark.parametrize(("num_tokens", "pages"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_page_aligned_lengths_need_exact_pages(num_tokens: int, pages: int) -> None:
    bm = BlockManager(num_pages=8, page_size=16)
    assert bm.num_pages_needed(num_tokens) == pages
    assert bm.allocate("a", num_tokens)
    assert len(bm.pages("a")) == pages


def test_exhaustion_returns_false_and_changes_nothing() -> None:
    bm = BlockManager(num_pages=5, page_size=16)
    assert bm.allocate("a", 32)
    before = (bm.num_free_pages, list(bm.pages("a")))
    assert not bm.allocate("a", 100)  # needs 7 pages, holds 2, 2 free
    assert not bm.allocate("b", 48)
    assert (bm.num_free_pages, bm.pages("a")) == before
    assert bm.pages("b") == []


def test_free_returns_all_pages() -> None:
    bm = BlockManager(num_pages=6, page_size=16)
    assert bm.allocate("a", 50)
    assert bm.num_free_pages == 1
    bm.free("a")
    assert bm.num_free_pages == 5 and bm.num_used_pages == 0
    assert bm.pages("a") == []
    assert bm.allocate("b", 80)  # all five pages can be handed out again


def test_freeing_unknown_or_freed_id_is_a_noop() -> None:
    bm = BlockManager(num_pages=6, page_size=16)
    assert bm.allocate("a", 20)
    bm.free("a")
    bm.free("a")
    bm.free("never-seen")
    assert bm.num_free_pages == 5
    assert bm.allocate("b", 80)
    assert sorted(bm.pages("b")) == [1, 2, 3, 4, 5]  # no page came back twice


def test_releasing_a_free_page_raises() -> None:
    bm = BlockManager(num_pages=4, page_size=16)
    assert bm.allocate("a", 16)
    page = bm.pages("a")[0]
    bm.free("a")
    # Simulate a corrupt table that still names the freed page: the bookkeeping must refuse it.
    bm._tables["b"] = [page]
    with pytest.raises(BlockManagerError, match="double free"):
        bm.free("b")


def test_growth_one_token_at_a_time_adds_a_page_every_page_size_tokens() -> None:
    bm = BlockManager(num_pages=8, page_size=16)
    assert bm.allocate("a", 1)
    table = bm.pages("a")  # grows in place
    for n in range(2, 50):
        assert bm.allocate("a", n)
        assert len(table) == bm.num_pages_needed(n)
    assert len(table) == 4 and len(set(table)) == 4
    assert bm.num_used_pages == 4


def test_allocate_never_shrinks() -> None:
    bm = BlockManager(num_pages=8, page_size=16)
    assert bm.allocate("a", 40)
    assert bm.allocate("a", 5)
    assert len(bm.pages("a")) == 3


def test_requests_never_share_a_page() -> None:
    bm = BlockManager(num_pages=12, page_size=4)
    for rid, n in [("a", 9), ("b", 13), ("c", 5)]:
        assert bm.allocate(rid, n)
    pages = bm.pages("a") + bm.pages("b") + bm.pages("c")
    assert len(pages) == len(set(pages)) == 9


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_pages=1, page_size=16)
    with pytest.raises(ValueError):
        BlockManager(num_pages=8, page_size=0)
