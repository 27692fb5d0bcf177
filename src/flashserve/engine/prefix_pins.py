"""Pinning each prefix-sharing group's prefix in the KV cache while the group runs.

A group's prefix is pinned when its first request is submitted and unpinned once every one of its
members has been submitted and every request submitted for it has ended, so the LRU never evicts a
prefix that requests of its group still need. Pinned pages are kept below capacity minus the largest
request's pages, so any request can still run whatever is pinned (the scheduler would otherwise
wait forever for pages a pin holds); a group past that budget runs unpinned. Used by
`LLM.generate` and by run-batch's engine loop; pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashserve.engine.prefix_groups import GroupPlan
from flashserve.kv_cache.hashing import PageHasher
from flashserve.kv_cache.manager import KVCacheManager


class GroupPins:
    def __init__(self, kv_cache: KVCacheManager, hasher: PageHasher, plan: GroupPlan,
                 prompts: Sequence[Sequence[int]], largest_request_tokens: int,
                 salts: Sequence[str | None] | None = None, lora_keys: Sequence[str | None] | None = None) -> None:
        """prompts[i]: the token ids of the plan's member i; salts[i]: its cache_salt, lora_keys[i]
        its LoRA adapter's key in the page hashes (`prefix_cache.lora_key`) (one of each per group)."""
        self.kv_cache = kv_cache
        self.hasher = hasher
        self.plan = plan
        self.prompts = prompts
        self.salts = salts
        self.lora_keys = lora_keys
        self.budget = kv_cache.capacity - kv_cache.num_pages_needed(largest_request_tokens)
        self._unseen = [set(group.members) for group in plan.groups]  # members with nothing submitted yet
        self._live = [0] * len(plan.groups)  # requests submitted and not ended
        self._pins: dict[int, tuple[int, int]] = {}  # group -> (pin handle, pages)
        self.pinned_pages = 0
        self.num_pinned_groups = 0

    def submitted(self, group: int, member: int) -> None:
        """A request of `member` (a prompt index) of `group` is about to enter the engine."""
        self._unseen[group].discard(member)
        self._live[group] += 1
        prefix_len = self.plan.groups[group].prefix_len
        pages = prefix_len // self.kv_cache.page_size
        if pages and group not in self._pins and self.pinned_pages + pages <= self.budget:
            hashes: list[bytes] = []
            salt = self.salts[member] if self.salts is not None else None
            lora_key = self.lora_keys[member] if self.lora_keys is not None else None
            self.hasher.extend(hashes, self.prompts[member][:prefix_len], salt, lora_key)
            self._pins[group] = (self.kv_cache.pin(hashes), pages)
            self.pinned_pages += pages
            self.num_pinned_groups += 1

    def finished(self, group: int) -> None:
        """A request submitted for `group` ended (output, error or abort)."""
        self._live[group] -= 1
        if not self._live[group] and not self._unseen[group] and group in self._pins:
            handle, pages = self._pins.pop(group)
            self.kv_cache.unpin(handle)
            self.pinned_pages -= pages

    def release_all(self) -> None:
        """Unpins every group (the run ended or was interrupted)."""
        for handle, _ in self._pins.values():
            self.kv_cache.unpin(handle)
        self._pins.clear()
        self.pinned_pages = 0
