"""The scheduler's side of automatic prefix caching: which of a request's pages are cached, which
are being computed by someone else, and when its computed pages become shareable.

The KV cache manager knows pages and their hashes; this module knows requests. It keeps each
request's chain of page hashes (prompt and output so far, salted with its `cache_salt` and keyed
by its LoRA adapter, so two adapters never share K/V for the same tokens), looks a
new request's pages up when it is admitted, registers its pages once their K/V is computed, and
remembers which uncached pages running requests are computing, so that requests that arrive
together with the same prefix compute it once: the first computes, the others wait until its
pages are registered (`lookup` answers None), as SGLang does.

Pure Python, called only from the scheduler (the engine loop).
"""

from __future__ import annotations

from flashserve.engine.request import Request
from flashserve.kv_cache.hashing import PageHash, PageHasher
from flashserve.kv_cache.manager import KVCacheManager


class PrefixCache:
    def __init__(self, kv_cache: KVCacheManager, hasher: PageHasher | None = None) -> None:
        self.kv_cache = kv_cache
        self.enabled = kv_cache.enable_caching
        self.page_size = kv_cache.page_size
        self.hasher = hasher if hasher is not None else PageHasher(kv_cache.page_size, kv_cache.hash_seed)
        # Hashes of pages that a running request will compute and has not registered yet.
        self._computing: dict[PageHash, str] = {}
        self._computing_range: dict[str, tuple[int, int]] = {}  # request id -> its page range there
        self.num_queries = 0  # tokens looked up, since start (the engine loop makes metrics of them)
        self.num_hits = 0  # tokens found cached

    def add(self, request: Request) -> None:
        """A new request: hash its prompt's full pages."""
        if self.enabled:
            self.hasher.extend(request.page_hashes, request.prompt_token_ids, request.cache_salt, lora_key(request))

    def lookup(self, request: Request) -> list[int] | None:
        """Cached pages that start the request's tokens (never all of them: the last token is always
        computed, for its logits), or None when the next page is being computed by another request
        and the request should wait for it. [] with caching off, and for a request that asks for its
        prompt's logprobs: they need the logits of every prompt token."""
        if not self.enabled or request.params.prompt_logprobs is not None:
            return []
        self._extend(request)
        hashes = request.page_hashes[: (request.num_tokens - 1) // self.page_size]
        cached = self.kv_cache.match(hashes)
        if len(cached) < len(hashes) and hashes[len(cached)] in self._computing:
            return None
        return cached

    def admitted(self, request: Request, cached_pages: list[int]) -> None:
        """The request got its pages, starting with `cached_pages` from `lookup`."""
        num_cached = len(cached_pages) * self.page_size
        request.num_computed_tokens = num_cached
        if not request.num_preemptions:
            request.num_cached_tokens = num_cached
        if not self.enabled:
            return
        self.num_queries += request.num_tokens
        self.num_hits += num_cached
        start, end = len(cached_pages), request.num_tokens // self.page_size
        for page_hash in request.page_hashes[start:end]:
            self._computing.setdefault(page_hash, request.request_id)
        self._computing_range[request.request_id] = (start, end)

    def appended(self, request: Request) -> None:
        """The request got a new output token."""
        if self.enabled and request.num_tokens % self.page_size == 0:
            self._extend(request)

    def computed(self, request: Request, num_tokens: int) -> None:
        """The request's K/V now covers its first `num_tokens` tokens (a step's results came back):
        its full pages among them become shareable."""
        if not self.enabled:
            return
        full = num_tokens // self.page_size
        # The tokens only for the events, and only when a page is new: concatenating them every
        # step would cost what the step's bookkeeping costs.
        self.kv_cache.register(request.request_id, request.page_hashes, full, lambda: request.all_token_ids,
                               request.cache_salt, request.lora_int_id)
        start, end = self._computing_range.get(request.request_id, (0, 0))
        if start < min(full, end):
            self._forget(request, start, min(full, end))
            self._computing_range[request.request_id] = (min(full, end), end)

    def released(self, request: Request) -> None:
        """The request left the running set (finished or preempted): it computes nothing more."""
        span = self._computing_range.pop(request.request_id, None)
        if span is not None:
            self._forget(request, *span)

    def _forget(self, request: Request, start: int, end: int) -> None:
        for page_hash in request.page_hashes[start:end]:
            if self._computing.get(page_hash) == request.request_id:
                del self._computing[page_hash]

    def _extend(self, request: Request) -> None:
        if len(request.page_hashes) < request.num_tokens // self.page_size:
            self.hasher.extend(request.page_hashes, request.all_token_ids, request.cache_salt, lora_key(request))


def lora_key(request: Request) -> str | None:
    """The request's adapter in its chain's root (`PageHasher`): its id; None for the base model.
    The engine core never gives an id to a second adapter, so pages of an unloaded adapter never
    answer for another."""
    return str(request.lora_int_id) if request.lora_int_id else None
