"""KVCacheManager and PageHasher: page accounting, hash chains, prefix hits, sharing, LRU eviction,
and a randomized run against a plain list-based reference model."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from flashserve.kv_cache.hashing import PageHash, PageHasher
from flashserve.kv_cache.manager import SCRATCH_PAGE, KVCacheManager, KVCacheManagerError

SEED = b"0123456789abcdef"


def chain(tokens: Sequence[int], page_size: int = 4, salt: str | None = None, seed: bytes = SEED) -> list[PageHash]:
    hashes: list[PageHash] = []
    PageHasher(page_size, seed).extend(hashes, tokens, salt)
    return hashes


def computed(kv: KVCacheManager, rid: str, tokens: Sequence[int], salt: str | None = None) -> list[PageHash]:
    """Allocate `tokens` for a new request with whatever prefix hits, then register its full pages."""
    hashes = chain(tokens, kv.page_size, salt)
    assert kv.allocate(rid, len(tokens), kv.match(hashes))
    kv.register(rid, hashes)
    return hashes


# --- the BlockManager behaviours ---------------------------------------------------------------


def test_free_plus_used_equals_capacity() -> None:
    kv = KVCacheManager(num_pages=10, page_size=16)
    assert kv.capacity == 9  # page 0 is the scratch page
    assert kv.num_free_pages == 9 and kv.num_used_pages == 0 and kv.num_cached_pages == 0
    assert kv.allocate("a", 40)
    assert kv.allocate("b", 1)
    assert kv.num_used_pages == 4
    assert kv.num_free_pages + kv.num_used_pages == kv.capacity


def test_scratch_page_is_never_handed_out() -> None:
    kv = KVCacheManager(num_pages=5, page_size=4)
    assert kv.allocate("a", 16)
    assert SCRATCH_PAGE not in kv.pages("a")
    assert not kv.allocate("b", 1)


@pytest.mark.parametrize(("num_tokens", "pages"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_page_aligned_lengths_need_exact_pages(num_tokens: int, pages: int) -> None:
    kv = KVCacheManager(num_pages=8, page_size=16)
    assert kv.num_pages_needed(num_tokens) == pages
    assert kv.allocate("a", num_tokens)
    assert len(kv.pages("a")) == pages


def test_exhaustion_returns_false_and_changes_nothing() -> None:
    kv = KVCacheManager(num_pages=5, page_size=16)
    assert kv.allocate("a", 32)
    before = (kv.num_free_pages, list(kv.pages("a")))
    assert not kv.can_allocate("a", 100) and not kv.allocate("a", 100)  # needs 7 pages, holds 2, 2 free
    assert not kv.allocate("b", 48)
    assert (kv.num_free_pages, list(kv.pages("a"))) == before
    assert list(kv.pages("b")) == []


def test_free_returns_all_pages() -> None:
    kv = KVCacheManager(num_pages=6, page_size=16)
    assert kv.allocate("a", 50)
    assert kv.num_free_pages == 1
    kv.free("a")
    assert kv.num_free_pages == 5 and kv.num_used_pages == 0
    assert list(kv.pages("a")) == []
    assert kv.allocate("b", 80)  # all five pages can be handed out again


def test_free_leaves_the_table_list_intact() -> None:
    kv = KVCacheManager(num_pages=6, page_size=16)
    assert kv.allocate("a", 40)
    table = kv.pages("a")
    held = list(table)
    kv.free("a")
    assert list(table) == held  # a step built from it still describes that step


def test_freeing_unknown_or_freed_id_is_a_noop() -> None:
    kv = KVCacheManager(num_pages=6, page_size=16)
    assert kv.allocate("a", 20)
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_pages == 5
    assert kv.allocate("b", 80)
    assert sorted(kv.pages("b")) == [1, 2, 3, 4, 5]  # no page came back twice


def test_releasing_a_free_page_raises() -> None:
    kv = KVCacheManager(num_pages=4, page_size=16)
    assert kv.allocate("a", 16)
    page = kv.pages("a")[0]
    kv.free("a")
    # Simulate a corrupt table that still names the freed page: the bookkeeping must refuse it.
    kv._tables["b"] = [page]
    with pytest.raises(KVCacheManagerError, match="double free"):
        kv.free("b")


def test_growth_one_token_at_a_time_adds_a_page_every_page_size_tokens() -> None:
    kv = KVCacheManager(num_pages=8, page_size=16)
    assert kv.allocate("a", 1)
    table = kv.pages("a")  # grows in place
    for n in range(2, 50):
        assert kv.allocate("a", n)
        assert len(table) == kv.num_pages_needed(n)
    assert len(table) == 4 and len(set(table)) == 4
    assert kv.num_used_pages == 4


def test_allocate_never_shrinks() -> None:
    kv = KVCacheManager(num_pages=8, page_size=16)
    assert kv.allocate("a", 40)
    assert kv.allocate("a", 5)
    assert len(kv.pages("a")) == 3


def test_requests_without_hits_never_share_a_page() -> None:
    kv = KVCacheManager(num_pages=12, page_size=4)
    for rid, n in [("a", 9), ("b", 13), ("c", 5)]:
        assert kv.allocate(rid, n)
    pages = kv.pages("a") + kv.pages("b") + kv.pages("c")
    assert len(pages) == len(set(pages)) == 9


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(num_pages=1, page_size=16)
    with pytest.raises(ValueError):
        KVCacheManager(num_pages=8, page_size=0)
    with pytest.raises(ValueError):
        PageHasher(page_size=0)


# --- hash chains -------------------------------------------------------------------------------


def test_equal_prefixes_give_equal_hashes() -> None:
    assert chain(range(12)) == chain(list(range(12)) + [99, 98])[:3]


def test_same_page_tokens_after_a_different_parent_hash_differently() -> None:
    a, b = chain([1, 2, 3, 4, 9, 9, 9, 9]), chain([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[0] != b[0] and a[1] != b[1]


def test_partial_last_page_gets_no_hash() -> None:
    assert len(chain(range(11))) == 2
    assert chain(range(3)) == []


def test_extend_is_incremental_and_equals_a_from_scratch_extend() -> None:
    hasher, tokens = PageHasher(4, SEED), list(range(100, 130))
    hashes: list[PageHash] = []
    for n in range(len(tokens) + 1):
        hasher.extend(hashes, tokens[:n], "salt")
        assert len(hashes) == n // 4
    assert hashes == chain(tokens, salt="salt")


def test_different_extra_keys_never_give_equal_hashes() -> None:
    firsts = [chain(range(4), salt=salt)[0] for salt in (None, "", "a", "b", "\x00")]
    assert len(set(firsts)) == len(firsts)


def test_hashes_are_equal_across_hashers_with_the_default_seed() -> None:
    a: list[PageHash] = []
    b: list[PageHash] = []
    PageHasher(4).extend(a, range(8))
    PageHasher(4).extend(b, range(8))
    assert a == b


def test_hashes_depend_on_the_seed() -> None:
    a, b = chain(range(8), seed=b"x"), chain(range(8), seed=b"y")
    assert a[0] != b[0] and a[1] != b[1]
    assert chain(range(8), seed=b"x") == chain(range(8), seed=b"x")


def test_hashes_follow_the_documented_algorithm() -> None:
    """docs/production.md: a router can compute the engine's page hashes from the token ids."""
    import hashlib
    import struct

    def documented(tokens: list[int], salt: str | None, seed: str) -> list[bytes]:
        key = b"\x00" if salt is None else b"\x01" + salt.encode()
        parent = hashlib.sha256(b"flashserve-kv-root\x00" + hashlib.sha256(seed.encode()).digest() + key).digest()
        out = []
        for i in range(0, len(tokens) - len(tokens) % 4, 4):
            parent = hashlib.sha256(parent + struct.pack("<4q", *tokens[i : i + 4])).digest()
            out.append(parent)
        return out

    tokens = [5, 49151, 0, 7, 300, 1, 2, 3, 9]
    for salt in (None, "tenant-a"):
        hashes: list[PageHash] = []
        PageHasher(4).extend(hashes, tokens, salt)
        assert hashes == documented(tokens, salt, "flashserve")
        hashes = []
        PageHasher(4, "my-seed").extend(hashes, tokens, salt)
        assert hashes == documented(tokens, salt, "my-seed")


# --- prefix hits -------------------------------------------------------------------------------


def test_match_finds_the_registered_prefix_and_stops_at_the_first_miss() -> None:
    kv = KVCacheManager(num_pages=10, page_size=4)
    computed(kv, "a", range(10))  # two full pages registered, the partial third is not
    assert kv.match(chain(range(10))) == list(kv.pages("a")[:2])
    assert kv.match(chain(list(range(8)) + [7, 7, 7, 7])) == list(kv.pages("a")[:2])
    assert kv.match(chain([0, 1, 2, 3, 0, 0, 0, 0])) == list(kv.pages("a")[:1])
    assert kv.match(chain([9, 1, 2, 3, 4, 5, 6, 7])) == []


def test_unregistered_pages_never_match() -> None:
    kv = KVCacheManager(num_pages=10, page_size=4)
    assert kv.allocate("a", 12)
    assert kv.match(chain(range(12))) == []


def test_different_salts_never_match() -> None:
    kv = KVCacheManager(num_pages=10, page_size=4)
    computed(kv, "a", range(8), salt="alice")
    assert kv.match(chain(range(8), salt="bob")) == []
    assert kv.match(chain(range(8))) == []
    assert len(kv.match(chain(range(8), salt="alice"))) == 2


def test_hit_on_a_free_cached_page_takes_it_out_of_the_free_queue() -> None:
    kv = KVCacheManager(num_pages=6, page_size=4)
    computed(kv, "a", range(8))
    kv.free("a")
    assert (kv.num_free_pages, kv.num_cached_pages) == (5, 2)
    hit = kv.match(chain(range(10)))
    assert len(hit) == 2
    assert kv.allocate("b", 10, hit)
    assert list(kv.pages("b")[:2]) == hit
    assert (kv.num_free_pages, kv.num_used_pages, kv.num_cached_pages) == (2, 3, 0)
    assert kv.match(chain(range(8))) == hit  # taking the page kept its hash


def test_two_requests_share_a_page_in_use() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    computed(kv, "a", range(6))
    shared = kv.pages("a")[0]
    computed(kv, "b", list(range(4)) + [50, 51])
    assert kv.pages("b")[0] == shared and kv._ref_counts[shared] == 2
    assert kv.num_used_pages == 3


def test_freeing_one_sharer_keeps_the_page_in_use() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    computed(kv, "a", range(6))
    computed(kv, "b", range(6))
    shared = kv.pages("b")[0]
    kv.free("a")
    assert kv._ref_counts[shared] == 1 and shared not in kv._free
    assert kv.num_cached_pages == 0 and kv.num_used_pages == 2  # a's partial page went back


def test_freeing_every_sharer_makes_the_page_cached() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    computed(kv, "a", range(6))
    computed(kv, "b", range(6))
    shared = kv.pages("a")[0]
    kv.free("a")
    kv.free("b")
    assert kv.num_used_pages == 0 and kv.num_cached_pages == 1
    assert kv.match(chain(range(4))) == [shared]


def test_free_plus_used_equals_capacity_with_cached_pages() -> None:
    kv = KVCacheManager(num_pages=10, page_size=4)
    for rid, start in [("a", 0), ("b", 0), ("c", 100)]:
        computed(kv, rid, range(start, start + 13))
        assert kv.num_free_pages + kv.num_used_pages == kv.capacity
    kv.free("a")
    kv.free("c")
    assert kv.num_cached_pages == 3 and kv.num_used_pages == 4
    assert kv.num_free_pages + kv.num_used_pages == kv.capacity


# --- eviction ----------------------------------------------------------------------------------


def test_least_recently_freed_cached_page_is_evicted_first() -> None:
    kv = KVCacheManager(num_pages=3, page_size=4)
    computed(kv, "old", range(4))
    computed(kv, "new", range(10, 14))
    kv.free("old")
    kv.free("new")
    assert kv.allocate("c", 1)
    assert kv.match(chain(range(4))) == [] and len(kv.match(chain(range(10, 14)))) == 1


def test_a_requests_last_page_is_evicted_before_its_first() -> None:
    kv = KVCacheManager(num_pages=4, page_size=4)
    computed(kv, "a", range(12))
    first, second, last = kv.pages("a")
    kv.free("a")
    assert kv.allocate("b", 1) and list(kv.pages("b")) == [last]
    assert kv.allocate("b", 5) and list(kv.pages("b")) == [last, second]
    assert kv.match(chain(range(12))) == [first]


def test_blank_pages_are_reused_before_cached_ones() -> None:
    kv = KVCacheManager(num_pages=5, page_size=4)
    computed(kv, "a", range(8))
    assert kv.allocate("blank", 8)
    blank = list(kv.pages("blank"))
    kv.free("a")
    kv.free("blank")  # freed after the cached pages, yet reused first
    assert kv.allocate("b", 8) and sorted(kv.pages("b")) == sorted(blank)
    assert kv.num_cached_pages == 2


def test_eviction_drops_the_hash() -> None:
    kv = KVCacheManager(num_pages=2, page_size=4)
    computed(kv, "a", range(4))
    kv.free("a")
    assert kv.allocate("b", 4) and kv.num_cached_pages == 0
    assert kv.match(chain(range(4))) == []
    kv.register("b", chain(range(50, 54)))  # the evicted page can take a new hash
    assert kv.match(chain(range(50, 54))) == list(kv.pages("b"))


def test_a_page_in_use_is_never_evicted_under_pressure() -> None:
    kv = KVCacheManager(num_pages=6, page_size=4)
    computed(kv, "a", range(8))
    held = list(kv.pages("a"))
    assert kv.allocate("b", 12)
    assert not kv.allocate("c", 1)  # the cache is full: a's registered pages are not taken
    assert kv.match(chain(range(8))) == held and not set(held) & set(kv.pages("b"))


# --- allocate with cached pages ------------------------------------------------------------------


def test_cached_pages_at_ref_zero_count_against_free_pages() -> None:
    kv = KVCacheManager(num_pages=5, page_size=4)
    computed(kv, "a", range(8))
    kv.free("a")
    hit = kv.match(chain(range(8)))
    assert kv.can_allocate("b", 16, hit)  # 2 cached + 2 fresh of 4 free
    assert not kv.can_allocate("b", 20, hit)  # 2 cached + 3 fresh


def test_failed_allocate_with_cached_pages_changes_nothing() -> None:
    kv = KVCacheManager(num_pages=5, page_size=4)
    computed(kv, "a", range(8))
    kv.free("a")
    hit = kv.match(chain(range(8)))
    before = (list(kv._free), list(kv._ref_counts), dict(kv._hash_to_page), kv.num_cached_pages)
    assert not kv.allocate("b", 20, hit)
    assert (list(kv._free), list(kv._ref_counts), dict(kv._hash_to_page), kv.num_cached_pages) == before
    assert list(kv.pages("b")) == [] and "b" not in kv._tables


def test_cached_pages_after_the_first_allocation_raise() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    computed(kv, "a", range(8))
    assert kv.allocate("b", 3)
    with pytest.raises(ValueError, match="already holds pages"):
        kv.allocate("b", 8, kv.match(chain(range(8))))


def test_cached_pages_that_were_evicted_raise() -> None:
    kv = KVCacheManager(num_pages=2, page_size=4)
    computed(kv, "a", range(4))
    kv.free("a")
    stale = kv.match(chain(range(4)))
    assert kv.allocate("b", 1)  # evicts it
    kv.free("b")
    with pytest.raises(ValueError, match="no registered hash"):
        kv.allocate("c", 4, stale)


# --- register ----------------------------------------------------------------------------------


def test_register_is_idempotent() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    hashes = computed(kv, "a", range(8))
    state = (dict(kv._hash_to_page), list(kv._page_hash))
    kv.register("a", hashes)
    kv.register("a", hashes[:1])
    assert (dict(kv._hash_to_page), list(kv._page_hash)) == state


def test_a_duplicate_hash_keeps_the_existing_page() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    hashes = computed(kv, "a", range(4))
    assert kv.allocate("b", 4)  # computed the same page without a hit
    duplicate = kv.pages("b")[0]
    kv.register("b", hashes)
    assert kv.match(hashes) == list(kv.pages("a")) != [duplicate]
    kv.free("b")  # its unregistered page comes back blank, to the head
    assert kv.num_cached_pages == 0 and next(iter(kv._free)) == duplicate


def test_a_preempted_request_registers_its_new_pages() -> None:
    kv = KVCacheManager(num_pages=3, page_size=4)
    hashes = computed(kv, "a", range(8))
    kv.free("a")  # preempted: its id comes back for the recompute
    assert kv.allocate("b", 8)  # evicts both pages
    kv.free("b")
    assert kv.allocate("a", 8, kv.match(hashes))
    kv.register("a", hashes)
    assert kv.match(hashes) == list(kv.pages("a"))


def test_register_rejects_more_hashes_than_pages() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    assert kv.allocate("a", 4)
    with pytest.raises(ValueError):
        kv.register("a", chain(range(8)))


# --- caching off -------------------------------------------------------------------------------


def test_caching_off_never_matches_and_frees_blank_pages() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4, enable_caching=False)
    hashes = chain(range(8))
    assert kv.allocate("a", 8, kv.match(hashes))
    kv.register("a", hashes)
    assert kv.match(hashes) == [] and kv._hash_to_page == {}
    kv.free("a")
    assert kv.num_cached_pages == 0 and kv.num_free_pages == 7


# --- pins --------------------------------------------------------------------------------------


def test_a_pinned_prefix_survives_pressure_that_would_evict_it() -> None:
    kv = KVCacheManager(num_pages=5, page_size=4)
    hashes = computed(kv, "a", range(8))
    held = list(kv.pages("a"))
    kv.pin(hashes)
    kv.free("a")
    assert kv.allocate("b", 8)  # takes the two blank pages, not the pinned ones
    assert not kv.allocate("c", 4)  # the cache is full: pinned pages are not evicted
    assert kv.match(hashes) == held


def test_unpinning_makes_the_prefix_evictable_again() -> None:
    kv = KVCacheManager(num_pages=3, page_size=4)
    hashes = computed(kv, "a", range(8))
    kv.unpin(kv.pin(hashes))
    kv.free("a")
    assert kv.num_cached_pages == 2
    assert kv.allocate("b", 8)  # evicts both
    assert kv.match(hashes) == []


def test_pinned_pages_at_no_request_count_as_used_not_free_or_cached() -> None:
    kv = KVCacheManager(num_pages=6, page_size=4)
    hashes = computed(kv, "a", range(12))
    kv.pin(hashes[:2])
    kv.free("a")
    assert (kv.num_used_pages, kv.num_free_pages, kv.num_cached_pages) == (2, 3, 1)
    assert kv.num_free_pages + kv.num_used_pages == kv.capacity
    assert kv.num_pinned_pages == 2


def test_a_pin_on_hashes_not_yet_computed_holds_them_once_registered() -> None:
    kv = KVCacheManager(num_pages=4, page_size=4)
    hashes = chain(range(8))
    kv.pin(hashes)
    assert kv.num_pinned_pages == 0 and kv.num_free_pages == 3  # nothing held before the K/V exists
    assert kv.allocate("a", 8)
    kv.register("a", hashes)
    held = list(kv.pages("a"))
    kv.free("a")
    assert kv.num_used_pages == 2 and kv.num_cached_pages == 0
    assert kv.allocate("b", 4) and not kv.allocate("c", 4)
    assert kv.match(hashes) == held


def test_pins_nest_until_the_last_one_is_dropped() -> None:
    kv = KVCacheManager(num_pages=3, page_size=4)
    hashes = computed(kv, "a", range(8))
    first, second = kv.pin(hashes), kv.pin(hashes[:1])
    kv.free("a")
    kv.unpin(first)
    assert kv.num_used_pages == 1 and kv.num_cached_pages == 1  # the first page is still pinned
    kv.unpin(second)
    assert kv.num_used_pages == 0 and kv.num_cached_pages == 2


def test_a_hit_on_a_pinned_page_takes_no_free_page() -> None:
    kv = KVCacheManager(num_pages=4, page_size=4)
    hashes = computed(kv, "a", range(8))
    kv.pin(hashes)
    kv.free("a")
    hit = kv.match(hashes)
    assert kv.allocate("b", 12, hit)  # 2 pinned pages + 1 fresh of the 1 free
    kv.free("b")
    assert kv.num_used_pages == 2 and kv.num_free_pages == 1


def test_unpinning_an_unknown_or_released_handle_raises() -> None:
    kv = KVCacheManager(num_pages=4, page_size=4)
    handle = kv.pin(chain(range(4)))
    kv.unpin(handle)
    with pytest.raises(ValueError, match="unknown"):
        kv.unpin(handle)


# --- randomized run against a reference model --------------------------------------------------


class RefModel:
    """The same contract written the slow, obvious way: a plain list as the free queue."""

    def __init__(self, num_pages: int, page_size: int, caching: bool) -> None:
        self.page_size, self.caching = page_size, caching
        self.free_list = list(range(1, num_pages))
        self.refs = [0] * num_pages
        self.page_hash: list[PageHash | None] = [None] * num_pages
        self.tables: dict[str, list[int]] = {}
        self.upto: dict[str, int] = {}

    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        out: list[int] = []
        for h in hashes if self.caching else ():
            if h not in self.page_hash:
                break
            out.append(self.page_hash.index(h))
        return out

    def allocate(self, rid: str, num_tokens: int, cached: list[int]) -> bool:
        fresh = -(-num_tokens // self.page_size) - len(self.tables.get(rid, [])) - len(cached)
        if fresh <= 0 and not cached:
            return True
        if fresh + sum(self.refs[p] == 0 for p in cached) > len(self.free_list):
            return False
        table = self.tables.setdefault(rid, [])
        for p in cached:
            if self.refs[p] == 0:
                self.free_list.remove(p)
            self.refs[p] += 1
        for _ in range(fresh):
            p = self.free_list.pop(0)
            self.page_hash[p], self.refs[p] = None, 1
            cached.append(p)
        table.extend(cached)
        return True

    def register(self, rid: str, hashes: list[PageHash]) -> None:
        table, start = self.tables[rid], self.upto.get(rid, 0)
        for i in range(start, len(hashes) if self.caching else 0):
            if self.page_hash[table[i]] is None and hashes[i] not in self.page_hash:
                self.page_hash[table[i]] = hashes[i]
        self.upto[rid] = max(start, len(hashes))

    def free(self, rid: str) -> None:
        self.upto.pop(rid, None)
        for p in reversed(self.tables.pop(rid, [])):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_list.insert(len(self.free_list) if self.page_hash[p] else 0, p)


def check(kv: KVCacheManager, ref: RefModel, content: dict[int, PageHash | None], in_use: dict[int, PageHash]) -> None:
    assert list(kv._free) == ref.free_list and kv._ref_counts == ref.refs and kv._page_hash == ref.page_hash
    assert {rid: list(t) for rid, t in kv._tables.items()} == ref.tables
    assert kv.num_free_pages + kv.num_used_pages == kv.capacity
    owners = [p for table in kv._tables.values() for p in table]
    assert SCRATCH_PAGE not in owners and SCRATCH_PAGE not in kv._free and kv._ref_counts[SCRATCH_PAGE] == 0
    for page in range(1, kv.num_pages):
        assert kv._ref_counts[page] == owners.count(page)
        assert (page in kv._free) != (kv._ref_counts[page] > 0)  # exactly one state
    assert kv.num_cached_pages == sum(kv._page_hash[p] is not None for p in kv._free)
    assert {h: p for p, h in enumerate(kv._page_hash) if h is not None} == kv._hash_to_page
    for h, p in kv._hash_to_page.items():
        assert content[p] == h  # the page really holds the K/V the hash names
    for p, h in in_use.items():
        assert kv._page_hash[p] == h  # a page in use before this step kept its hash


@pytest.mark.parametrize(("seed", "caching"), [(0, True), (1, True), (2, True), (3, False)])
def test_random_operations_match_the_reference_model(seed: int, caching: bool) -> None:
    rng = random.Random(seed)
    kv, ref = KVCacheManager(24, 4, caching), RefModel(24, 4, caching)
    hasher = PageHasher(4, SEED)
    bases = [[rng.randrange(3) for _ in range(rng.randrange(24))] for _ in range(4)]
    reqs: dict[str, tuple[list[int], str | None, list[PageHash]]] = {}
    content: dict[int, PageHash | None] = {}
    freed: set[str] = set()
    for step in range(1500):
        in_use = {p: h for p, h in enumerate(kv._page_hash) if h is not None and kv._ref_counts[p]}
        op, live = rng.random(), sorted(reqs)
        if op < 0.3 or not live:
            # Reusing a freed id is what a preempted request does when it comes back.
            rid = rng.choice(sorted(freed)) if freed and rng.random() < 0.2 else f"r{step}"
            salt = rng.choice([None, None, "s"])
            tokens = rng.choice(bases) + [rng.randrange(3) for _ in range(rng.randrange(9))]
            hashes: list[PageHash] = []
            hasher.extend(hashes, tokens, salt)
            hit = kv.match(hashes)
            assert hit == ref.match(hashes)
            hit = hit[: rng.randrange(len(hit) + 1)]
            for i, p in enumerate(hit):
                assert content[p] == hashes[i]  # a hit hands out the very K/V this prompt needs
            ok = kv.can_allocate(rid, len(tokens), hit)
            assert kv.allocate(rid, len(tokens), hit) == ok == ref.allocate(rid, len(tokens), list(hit))
            if ok:
                reqs[rid] = (tokens, salt, hashes)
                freed.discard(rid)
                content.update((p, None) for p in kv.pages(rid)[len(hit) :])
        elif op < 0.55:
            rid = rng.choice(live)
            tokens, salt, hashes = reqs[rid]
            held, more = len(kv.pages(rid)), [rng.randrange(3) for _ in range(rng.randrange(1, 7))]
            ok = kv.can_allocate(rid, len(tokens) + len(more))
            assert kv.allocate(rid, len(tokens) + len(more)) == ok == ref.allocate(rid, len(tokens) + len(more), [])
            if ok:
                tokens += more
                hasher.extend(hashes, tokens, salt)
                content.update((p, None) for p in kv.pages(rid)[held:])
        elif op < 0.8:
            rid = rng.choice(live)
            hashes = reqs[rid][2][: rng.randrange(len(reqs[rid][2]) + 1)]
            kv.register(rid, hashes)
            ref.register(rid, hashes)
            content.update(zip(kv.pages(rid), hashes))  # the request computed these pages
        else:
            rid = rng.choice(live) if rng.random() < 0.95 else "unknown"
            kv.free(rid)
            ref.free(rid)
            if reqs.pop(rid, None) is not None:
                freed.add(rid)
        check(kv, ref, content, in_use)
    assert caching == (kv._hash_to_page != {})
