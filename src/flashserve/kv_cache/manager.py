"""KV cache pages with automatic prefix caching: pages addressed by the content they hold.

Pure Python. The pages themselves (the K/V tensors) belong to the attention backend; this module
decides which page ids a request owns and which full pages can be shared between requests.

A full page is named by a chained hash of every token up to its end (`kv_cache/hashing.py`). Once a request
has computed a page's K/V it registers the hash; a later request whose prefix hashes equal finds the
page with match() and takes a reference instead of recomputing it. When its last reference goes the
page keeps its hash and waits in the free queue, still reusable, until allocate() needs a fresh page
and evicts it (least recently freed first).

A pin keeps a chain of hashes cached whatever the LRU says (an offline batch's shared prefix, until
the last request that needs it ends): each pinned hash, once registered, holds one reference on
its page, so the page never enters the free queue and is never evicted. A pin may name hashes no
request has computed yet; they are held from the moment they are registered. Pinned pages count
as used pages.

Page 0 is reserved as a scratch page: padded slots of a CUDA-graph batch write their K/V there, so
it is never handed to a request and is not counted in `capacity`, `num_free_pages` or
`num_used_pages` (free + used == capacity == num_pages - 1).

Once `record_events()` is called the manager also keeps a log of what enters and leaves the set of
registered hashes (`kv_cache/events.py`), which the engine core drains once a step with
`take_events()` and publishes for KV-aware routers (`engine/kv_events.py`).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

from flashserve.kv_cache.events import KVCacheEvent, PagesRemoved, pages_stored
from flashserve.kv_cache.hashing import DEFAULT_HASH_SEED, PageHash

SCRATCH_PAGE: Final = 0


class KVCacheManagerError(RuntimeError):
    """The page bookkeeping is inconsistent (a bug, never a normal condition such as a full cache)."""


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True,
                 hash_seed: str = DEFAULT_HASH_SEED) -> None:
        """`hash_seed`: the seed of the PageHasher that names this cache's pages (PrefixCache)."""
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page {SCRATCH_PAGE} is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.hash_seed = hash_seed
        # Pages with no owner, head first: the head is taken (and evicted) first. Blank pages go to
        # the head, cached ones to the tail (LRU). A hit removes a page from the middle, so a deque
        # will not do. OrderedDict over a hand-written doubly linked list (prev/next lists indexed
        # by page id, page 0 as sentinel): per operation ~90 ns (pop head, push tail), ~75 ns
        # (remove), ~125 ns (push head via move_to_end) against ~150 ns for every list operation.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self._ref_counts = [0] * num_pages
        self._page_hash: list[PageHash | None] = [None] * num_pages
        self._hash_to_page: dict[PageHash, int] = {}
        self._num_cached_free = 0  # pages in _free that still hold a hash
        # Page tables as int32 arrays: a step's layout concatenates them by memcpy and hands them
        # to numpy and the device without converting an int at a time (67k page ids a step at 512
        # requests of 2k tokens: ~2.4 ms of host time as Python lists on an H200's host).
        self._tables: dict[str, array[int]] = {}
        # How many of a request's pages register() has already looked at: without it every step
        # would rescan every page of every running request.
        self._registered_upto: dict[str, int] = {}
        self._pins: dict[PageHash, int] = {}  # pinned hash -> how many pins name it
        self._pin_handles: dict[int, tuple[PageHash, ...]] = {}
        self._next_pin = 1
        self._events: list[KVCacheEvent] | None = None  # None: not recording (record_events)

    @property
    def capacity(self) -> int:
        """Pages that requests can hold: every page but the scratch page."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages owned by no request (blank or cached at ref 0): what allocate can take."""
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        """Pages owned by at least one request or held by a pin."""
        return self.capacity - len(self._free)

    @property
    def num_cached_pages(self) -> int:
        """Free pages that still hold a registered hash (reusable by a hit until evicted)."""
        return self._num_cached_free

    @property
    def num_pinned_pages(self) -> int:
        """Registered pages held by a pin (some may be in use by requests too)."""
        return sum(page_hash in self._hash_to_page for page_hash in self._pins)

    def record_events(self) -> None:
        """From now on, log every hash that enters or leaves the registered set, for take_events()."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The changes to the registered set since the last call, oldest first; [] when not recording."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def registered_hashes(self) -> set[PageHash]:
        """Hashes of every registered page: in use, pinned, or free but cached (what match() finds)."""
        return set(self._hash_to_page)

    def pages(self, request_id: str) -> array[int]:
        """The request's page table (int32), by reference (it grows in place); empty for an unknown id."""
        table = self._tables.get(request_id)
        return table if table is not None else array("i")

    def num_pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """Page ids of the longest prefix of `hashes` that is registered (pages in use by other
        requests or free-but-cached alike). Takes no references. [] when caching is off.

        The result is only valid until the next allocate() of any request, which may evict it.
        """
        if not self.enable_caching:
            return []
        found: list[int] = []
        for page_hash in hashes:
            page = self._hash_to_page.get(page_hash)
            if page is None:
                break
            found.append(page)
        return found

    def _plan(self, request_id: str, num_tokens: int, cached_pages: Sequence[int]) -> tuple[int, int]:
        """(fresh pages to take, free pages consumed in all) for allocate(); raises on misuse."""
        held = len(self.pages(request_id))
        needed = self.num_pages_needed(num_tokens)
        if not cached_pages:
            return needed - held, needed - held
        if held:
            raise ValueError(f"request {request_id!r} already holds pages: cached pages come with its first allocation")
        if len(cached_pages) > needed:
            raise ValueError(f"{len(cached_pages)} cached pages for {num_tokens} tokens ({needed} pages)")
        if len(set(cached_pages)) != len(cached_pages):
            raise ValueError(f"cached pages repeat a page: {list(cached_pages)}")
        from_free = 0
        for page in cached_pages:
            # A page match() returned can be evicted by any allocate() since: using it would hand
            # out a page whose K/V now belongs to someone else.
            if not 0 < page < self.num_pages or self._page_hash[page] is None:
                raise ValueError(f"page {page} holds no registered hash (stale match() result?)")
            from_free += self._ref_counts[page] == 0
        fresh = needed - len(cached_pages)
        return fresh, fresh + from_free

    def can_allocate(self, request_id: str, num_tokens: int, cached_pages: Sequence[int] = ()) -> bool:
        """Whether allocate() with the same arguments would succeed now (and raises as it would)."""
        return self._plan(request_id, num_tokens, cached_pages)[1] <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int, cached_pages: Sequence[int] = ()) -> bool:
        """Grow the request's table to hold `num_tokens` tokens in total. Never shrinks.

        On the request's FIRST allocation, `cached_pages` (from match(), called since the last
        allocate of any request) become the head of its table: each gets a reference (one at ref 0
        leaves the free queue, keeping its hash). Then fresh pages are taken from the free queue's
        head; a fresh page that held a hash loses it (eviction). Returns False and changes nothing
        when there are too few free pages (cached pages at ref 0 that the request takes count
        against the free pages too). Raises ValueError for cached pages passed to a request that
        already holds pages, or ones that are not registered, repeat, or exceed `num_tokens`.
        """
        if not cached_pages:  # a running request: most steps its last page has room
            table = self._tables.get(request_id)
            if table is not None and len(table) * self.page_size >= num_tokens:
                return True
        fresh, take = self._plan(request_id, num_tokens, cached_pages)
        if fresh <= 0 and not cached_pages:
            return True
        if take > len(self._free):
            return False
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = array("i")
        for page in cached_pages:
            self._take(page)
            table.append(page)
        evicted: list[PageHash] | None = None if self._events is None else []
        for _ in range(fresh):
            page, _ = self._free.popitem(last=False)
            if self._ref_counts[page] != 0:
                raise KVCacheManagerError(f"page {page} is on the free list but has an owner")
            old_hash = self._page_hash[page]
            if old_hash is not None:
                del self._hash_to_page[old_hash]
                self._page_hash[page] = None
                self._num_cached_free -= 1
                if evicted is not None:
                    evicted.append(old_hash)
            self._ref_counts[page] = 1
            table.append(page)
        if evicted:
            self._events.append(PagesRemoved(evicted))  # type: ignore[union-attr]
        return True

    def register(self, request_id: str, hashes: Sequence[PageHash], num_pages: int | None = None,
                 token_ids: Sequence[int] | Callable[[], Sequence[int]] = (), cache_salt: str | None = None,
                 lora_id: int = 0) -> None:
        """The request's first `num_pages` pages (default: len(hashes)) now hold computed K/V for
        `hashes[:num_pages]` (full pages only): record hash -> page for those not registered yet.
        Idempotent, and O(1) when nothing is new, so a caller may pass a request's whole (growing)
        hash list every step. `token_ids` (the request's tokens, at least its first `num_pages`
        pages, or a function that returns them, called only when a new page goes into the events)
        `cache_salt` (its salt) and `lora_id` (its LoRA adapter) only go into the events (record_events).

        If a different page already holds an equal hash (two requests computed the same prefix),
        the existing mapping stays and this page stays unregistered. Pages looked at by an earlier
        call are not looked at again. No-op when caching is off.
        """
        if not self.enable_caching:
            return
        num_pages = len(hashes) if num_pages is None else num_pages
        start = self._registered_upto.get(request_id, 0)
        if num_pages <= start:  # nothing new: most steps of a decoding request
            return
        table = self.pages(request_id)
        if num_pages > min(len(hashes), len(table)):
            raise ValueError(f"{num_pages} pages to register for request {request_id!r} holding "
                             f"{len(table)} pages with {len(hashes)} hashes")
        runs: list[list[int]] | None = None if self._events is None else []  # [first, end) of new pages
        for i in range(start, num_pages):
            page, page_hash = table[i], hashes[i]
            held = self._page_hash[page]
            if held is not None:
                if held != page_hash:
                    raise KVCacheManagerError(f"page {page} is registered under another hash")
                continue
            if page_hash not in self._hash_to_page:
                self._hash_to_page[page_hash] = page
                self._page_hash[page] = page_hash
                if page_hash in self._pins:
                    self._take(page)  # a pin waiting for this hash holds the page from now on
                if runs is not None:
                    if runs and runs[-1][1] == i:
                        runs[-1][1] = i + 1
                    else:
                        runs.append([i, i + 1])
        self._registered_upto[request_id] = num_pages
        if runs:
            self._events.extend(  # type: ignore[union-attr]
                pages_stored(runs, hashes, token_ids() if callable(token_ids) else token_ids, self.page_size, cache_salt,
                             lora_id))

    def free(self, request_id: str) -> None:
        """Drop the request's references; an unknown or already freed id is a no-op.

        Pages reaching ref 0 go to the free queue: pages with a hash to its tail (least recently
        used at the head, evicted first), the request's pages in reverse order so its last pages
        are evicted before its first ones (a later prefix hit needs the first ones); pages without
        a hash to the head, so they are reused before any cached page is evicted.
        """
        table = self._tables.pop(request_id, None)
        self._registered_upto.pop(request_id, None)
        if table is None:
            return
        for page in reversed(table):
            self._release(page)
        # The table stays as it was: a ScheduledRequest built from it still describes its step.

    def pin(self, hashes: Sequence[PageHash]) -> int:
        """Keep the pages of `hashes` (a PageHasher chain) cached until unpin(handle): a registered
        one gets a reference now, any other when it is registered. A hash stays pinned while any
        pin names it. A pin reserves nothing, but the pages it holds are not free for allocate():
        the caller bounds what it pins. With caching off nothing is registered, nothing held."""
        handle = self._next_pin
        self._next_pin += 1
        unique = tuple(dict.fromkeys(hashes))
        self._pin_handles[handle] = unique
        for page_hash in unique:
            count = self._pins.get(page_hash, 0)
            self._pins[page_hash] = count + 1
            page = self._hash_to_page.get(page_hash)
            if count == 0 and page is not None:
                self._take(page)
        return handle

    def unpin(self, handle: int) -> None:
        """Drop a pin: pages no other pin names lose its reference, and at ref 0 join the free
        queue as cached pages (evictable again). Raises ValueError for an unknown handle."""
        unique = self._pin_handles.pop(handle, None)
        if unique is None:
            raise ValueError(f"unknown or already released pin {handle}")
        for page_hash in reversed(unique):  # the chain's last pages are evicted before its first
            count = self._pins[page_hash] - 1
            if count:
                self._pins[page_hash] = count
                continue
            del self._pins[page_hash]
            page = self._hash_to_page.get(page_hash)
            if page is not None:
                self._release(page)

    def _take(self, page: int) -> None:
        """One more reference on a registered page (out of the free queue at ref 0, hash kept)."""
        if self._ref_counts[page] == 0:
            del self._free[page]
            self._num_cached_free -= 1
        self._ref_counts[page] += 1

    def _release(self, page: int) -> None:
        if page == SCRATCH_PAGE or self._ref_counts[page] <= 0:
            raise KVCacheManagerError(f"page {page} freed with no owner (double free)")
        self._ref_counts[page] -= 1
        if self._ref_counts[page]:
            return
        self._free[page] = None
        if self._page_hash[page] is not None:
            self._num_cached_free += 1
        else:
            self._free.move_to_end(page, last=False)
