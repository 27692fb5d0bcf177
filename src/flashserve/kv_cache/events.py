"""What the KV cache manager reports when its set of registered page hashes changes: the records
`KVCacheManager.take_events()` returns, in the order the changes happened. Pure data; the engine
core turns them into vLLM's wire events (`engine/kv_events.py`).

A page's hash enters the set when a request registers the page's computed K/V (`PagesStored`),
and leaves it when `allocate()` evicts the page for another use (`PagesRemoved`). Taking a
reference on a cached page, or freeing one that keeps its hash, changes nothing here: the page
stays reusable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PagesStored:
    """Consecutive pages of one hash chain registered together.

    `parent_hash`: the hash of the page before the first one (None when the first page starts the
    chain); `token_ids`: the pages' tokens, page_size per page; `cache_salt`: the chain's salt,
    which entered its root (so it matters to a consumer only when `parent_hash` is None);
    `lora_id`: the LoRA adapter whose K/V the pages hold (0: the base model), which entered the
    root too.
    """

    page_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    cache_salt: str | None
    lora_id: int = 0


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """Pages evicted: their hashes name no cached K/V any more."""

    page_hashes: list[bytes]


KVCacheEvent = PagesStored | PagesRemoved


def pages_stored(runs: list[list[int]], hashes: Sequence[bytes], token_ids: Sequence[int], page_size: int,
                 cache_salt: str | None, lora_id: int = 0) -> list[PagesStored]:
    """One `PagesStored` per run `[first, end)` of a request's newly registered pages; `hashes` and
    `token_ids`: the request's chain and tokens, covering at least the last run."""
    if len(token_ids) < runs[-1][1] * page_size:
        raise ValueError(f"events need the tokens of {runs[-1][1]} pages, got {len(token_ids)} tokens")
    return [PagesStored(list(hashes[first:end]), hashes[first - 1] if first else None,
                        list(token_ids[first * page_size : end * page_size]), cache_salt, lora_id)
            for first, end in runs]
