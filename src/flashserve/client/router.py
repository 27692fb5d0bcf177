"""Which engine core of `--data-parallel-size N` serves a request: the one with the longest cached
prefix for it, then the least loaded.

The KV cache names a full page by a chained hash of every token up to its end, its root salted by
the request's `cache_salt` and keyed by its LoRA adapter (`kv_cache/hashing.py`, PageHasher;
here the adapter's name, which every engine core knows it by). The front end hashes each
prompt the same way and keeps, per engine, a bounded LRU record of the page hashes it sent there:
an approximation of what that engine has cached, as SGLang's cache-aware router keeps a radix tree
per worker. The alternative, engines reporting the hashes they register and evict, would be exact
but puts a message per step on every pipe and a seed shared by all processes into the hashes; the
record needs neither and errs only in ways routing survives (a page evicted there still attracts
its prefix: one miss, then it is cached again).

Load is this front end's open requests on each engine (exact for one front end; with several,
each balances its own share). A prefix match counts only on engines whose load is within
`BALANCE_SLACK` of the least loaded, so that one hot prefix (a long shared system prompt) does not
pile every request onto one engine; SGLang's router guards the same way. Nor does it count on an
engine that has no free slot (`slots`: its `max_num_seqs`, this front end's share of it) while
another has one: there the request would wait for a running one to finish, seconds, where
computing its prefix again on the other engine takes milliseconds. (A burst of 32 groups x 16
shared-prefix prompts on two engines of 256 slots put 271 requests on one engine and 242 on the
other without this rule: 15 waited a whole round of decoding, P99 TTFT 8.2 s against 4.0 s with
least-load routing.) Ties go round-robin.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from flashserve.kv_cache.hashing import PageHash, PageHasher

# Open requests by which an engine may exceed the least loaded and still win on its cached prefix.
BALANCE_SLACK = 32
# Page hashes remembered per engine (a million tokens at 16 per page; about 10 MB).
RECORD_PAGES = 1 << 16


class PrefixRouter:
    """`prefix_routing=False`: least load only (round-robin among equals). Event-loop only."""

    def __init__(self, num_engines: int, page_size: int, prefix_routing: bool = True,
                 record_pages: int = RECORD_PAGES, slots: int | None = None) -> None:
        self.num_engines = num_engines
        self.prefix_routing = prefix_routing
        self.slots = slots  # open requests an engine runs at once for this front end (None: no limit)
        self.record_pages = record_pages
        self._hasher = PageHasher(page_size)
        self._records: list[OrderedDict[PageHash, None]] = [OrderedDict() for _ in range(num_engines)]
        self._next = 0  # where the round-robin among equals starts

    def choose(self, prompt_token_ids: Sequence[int], cache_salt: str | None, loads: Sequence[int],
               lora_name: str | None = None) -> int:
        """The engine for a request, given each engine's load; remembers the prompt's pages there.
        `lora_name`: the request's LoRA adapter, whose pages never serve another adapter's prompt
        (nor the base model's), so it keys the prompt's pages here too."""
        hashes: list[PageHash] = []
        if self.prefix_routing:
            self._hasher.extend(hashes, prompt_token_ids, cache_salt, lora_name)
        least = min(loads)
        # An engine at its slots would queue the request: passed over while the least loaded has a free one.
        free_slot = self.slots is not None and least < self.slots
        best, best_key = 0, (-1, 0)
        for k in range(self.num_engines):
            i = (self._next + k) % self.num_engines
            if loads[i] > least + BALANCE_SLACK or (free_slot and loads[i] >= self.slots):
                continue
            key = (self.matched_pages(i, hashes), -loads[i])
            if key > best_key:
                best, best_key = i, key
        self._next = (best + 1) % self.num_engines
        self._remember(best, hashes)
        return best

    def matched_pages(self, engine: int, hashes: Sequence[PageHash]) -> int:
        """How many leading pages of `hashes` were sent to `engine` (and not yet forgotten)."""
        record = self._records[engine]
        n = 0
        for page_hash in hashes:
            if page_hash not in record:
                break
            n += 1
        return n

    def _remember(self, engine: int, hashes: list[PageHash]) -> None:
        if not hashes:
            return
        record = self._records[engine]
        for page_hash in hashes:
            record[page_hash] = None
            record.move_to_end(page_hash)
        while len(record) > self.record_pages:
            record.popitem(last=False)
