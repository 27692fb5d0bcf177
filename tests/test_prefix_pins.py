"""GroupPins: a prefix-sharing group's prefix stays pinned in the KV cache from its first request's
submission until every member was submitted and every request of it ended, within a page budget."""

from __future__ import annotations

from flashserve.engine.prefix_groups import GroupPlan, PrefixGroup
from flashserve.engine.prefix_pins import GroupPins
from flashserve.kv_cache.hashing import PageHasher
from flashserve.kv_cache.manager import KVCacheManager

PAGE = 4
PREFIX = list(range(100, 108))  # two full pages
PROMPTS = [PREFIX + [1, 2], PREFIX + [3, 4], PREFIX + [5, 6]]
PLAN = GroupPlan((PrefixGroup((0, 1, 2), len(PREFIX)),))


def pins_over(num_pages: int, largest: int = 12) -> tuple[KVCacheManager, GroupPins]:
    kv = KVCacheManager(num_pages=num_pages, page_size=PAGE)
    hasher = PageHasher(PAGE)
    pins = GroupPins(kv, hasher, PLAN, PROMPTS, largest)
    # The prefix's K/V as a request of the group computes it: its two pages registered under the
    # hasher's chain, then freed (cached, evictable unless pinned).
    hashes: list[bytes] = []
    hasher.extend(hashes, PREFIX)
    assert kv.allocate("first", len(PREFIX))
    kv.register("first", hashes)
    kv.free("first")
    return kv, pins


def test_a_groups_prefix_is_pinned_from_its_first_submission() -> None:
    kv, pins = pins_over(16)
    pins.submitted(0, 0)
    assert kv.num_pinned_pages == 2 and pins.num_pinned_groups == 1


def test_the_pin_outlives_a_finished_member_while_others_are_not_yet_submitted() -> None:
    kv, pins = pins_over(16)
    pins.submitted(0, 0)
    pins.finished(0)
    assert kv.num_pinned_pages == 2


def test_the_pin_ends_when_the_last_member_ends() -> None:
    kv, pins = pins_over(16)
    for member in range(3):
        pins.submitted(0, member)
    for _ in range(3):
        pins.finished(0)
    assert kv.num_pinned_pages == 0 and kv.num_cached_pages == 2  # cached, evictable again


def test_a_group_past_the_pin_budget_runs_unpinned() -> None:
    kv, pins = pins_over(5, largest=12)  # 4 usable pages, the largest request needs 3: 1 page to pin
    pins.submitted(0, 0)
    assert kv.num_pinned_pages == 0 and pins.num_pinned_groups == 0


def test_release_all_unpins_what_an_interrupted_run_held() -> None:
    kv, pins = pins_over(16)
    pins.submitted(0, 0)
    pins.release_all()
    assert kv.num_pinned_pages == 0
