"""Names for full KV pages by their content: a page's hash chains every token up to its end, so that
equal prefixes get equal hashes and a request can find pages another request computed
(`KVCacheManager.match`). Pure Python; the front ends' prefix-aware router computes the same hashes.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Final

# The chain's seed when none is configured (`--prefix-caching-hash-seed`): fixed, so that a page's
# hash is the same in every process and after every restart, as vLLM's default for sha256.
DEFAULT_HASH_SEED: Final = "flashserve"

PageHash = bytes

# sha256 rather than blake2b: for one page (32-byte parent + 16 int64 ids = 160 bytes) sha256 took
# ~630 ns here (OpenSSL uses SHA-NI), blake2b ~615-755 ns and blake2b cut to 32 bytes ~750-840 ns
# (two shared cores, noisy), so blake2b buys nothing. A whole chain step, id conversion included,
# costs ~1.2 us per page; array('q') once per extend() and struct.pack per page measured alike.
_HASH = hashlib.sha256
_ID_BYTES: Final = array("q").itemsize
_BIG_ENDIAN: Final = sys.byteorder == "big"


class PageHasher:
    """Chained hashes of full pages, sha256 throughout (documented in docs/production.md, so that a
    router can compute them itself):

        seed_digest = sha256(seed as UTF-8)
        root(salt)  = sha256(b"flashserve-kv-root\\x00" + seed_digest + adapter + key)
                      adapter = b"" for the base model, b"\\x02" + the adapter key's UTF-8 length
                                as 4 bytes big-endian + the adapter key as UTF-8 for a LoRA adapter
                      key = b"\\x00" without a salt, b"\\x01" + salt as UTF-8 with one
        hash_i      = sha256(hash_{i-1} (root(salt) for the first page)
                             + page i's token ids as little-endian int64)

    The seed (`--prefix-caching-hash-seed`, DEFAULT_HASH_SEED when unset) is fixed, so hashes
    are equal across processes and restarts; the salt (a request's `cache_salt`) and the LoRA
    adapter (the engine's key is the adapter's id in decimal) enter only the root, so two salts, or
    two adapters, never produce equal hashes.
    """

    def __init__(self, page_size: int, seed: str | bytes = DEFAULT_HASH_SEED) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        raw = seed.encode("utf-8", "surrogatepass") if isinstance(seed, str) else bytes(seed)
        self._seed = _HASH(raw).digest()

    def _root(self, extra_key: str | None, lora_key: str | None = None) -> PageHash:
        # The tag byte keeps None apart from "" (and any salt apart from any other): the seed's
        # digest has a fixed length, so digest + tag + salt is unambiguous. An adapter's key comes
        # first with its length, so no salt can end where an adapter's part would begin.
        key = b"\x00" if extra_key is None else b"\x01" + extra_key.encode("utf-8", "surrogatepass")
        if lora_key is not None:
            adapter = lora_key.encode("utf-8", "surrogatepass")
            key = b"\x02" + len(adapter).to_bytes(4, "big") + adapter + key
        return _HASH(b"flashserve-kv-root\x00" + self._seed + key).digest()

    def extend(self, hashes: list[PageHash], token_ids: Sequence[int], extra_key: str | None = None,
               lora_key: str | None = None) -> None:
        """Append to `hashes` (in place) the hash of every FULL page of `token_ids` not yet hashed
        (pages len(hashes) .. len(token_ids)//page_size - 1). A partial last page gets no hash.

        `extra_key` (the salt) and `lora_key` (the LoRA adapter; None: the base model) only enter
        the chain's root, so they matter only while `hashes` is empty; the caller keeps using the
        same keys for one request.
        """
        size = self.page_size
        start, end = len(hashes), len(token_ids) // size
        if start >= end:
            return
        ids = array("q", token_ids[start * size : end * size])
        if _BIG_ENDIAN:  # the documented byte order, wherever the hashes are computed
            ids.byteswap()
        data = ids.tobytes()
        width = size * _ID_BYTES
        parent = hashes[-1] if hashes else self._root(extra_key, lora_key)
        # The parent has a fixed length (one digest) and so has a page, so parent + page is unambiguous.
        for offset in range(0, len(data), width):
            parent = _HASH(parent + data[offset : offset + width]).digest()
            hashes.append(parent)
