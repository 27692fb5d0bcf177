"""KV cache pages: a free list, per-request page tables and per-page reference counts.

Pure Python. The pages themselves (the K/V tensors) belong to the attention backend; this module
only decides which page ids a request owns. Reference counts are kept so that prefix sharing can
later hand one page to several requests; today every page has at most one owner.

Page 0 is reserved as a scratch page: padded slots of a CUDA-graph batch write their K/V there, so
it is never handed to a request and is not counted in `capacity`, `num_free_pages` or
`num_used_pages` (free + used == capacity == num_pages - 1).
"""

from __future__ import annotations

from collections import deque
from typing import Final

SCRATCH_PAGE: Final = 0


class BlockManagerError(RuntimeError):
    """The page bookkeeping is inconsistent (a bug, never a normal condition such as a full cache)."""


class BlockManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page {SCRATCH_PAGE} is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._ref_counts = [0] * num_pages
        self._tables: dict[str, list[int]] = {}

    @property
    def capacity(self) -> int:
        """Pages that requests can hold: every page but the scratch page."""
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.capacity - len(self._free)

    def pages(self, request_id: str) -> list[int]:
        """The request's page table, by reference (it grows in place); [] for an unknown id."""
        return self._tables.get(request_id, [])

    def num_pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        missing = self.num_pages_needed(num_tokens) - len(self.pages(request_id))
        return missing <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's pages to hold `num_tokens` tokens in total.

        Returns False, changing nothing, when there are not enough free pages. Never shrinks.
        """
        table = self._tables.get(request_id)
        held = len(table) if table is not None else 0
        missing = self.num_pages_needed(num_tokens) - held
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        if table is None:
            table = self._tables[request_id] = []
        for _ in range(missing):
            page = self._free.popleft()
            if self._ref_counts[page] != 0:
                raise BlockManagerError(f"page {page} is on the free list but has an owner")
            self._ref_counts[page] = 1
            table.append(page)
        return True

    def free(self, request_id: str) -> None:
        """Return all the request's pages; an unknown or already freed id is a no-op."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        for page in table:
            self._release(page)
        # The list stays as it was: a ScheduledRequest built from it still describes its step.

    def _release(self, page: int) -> None:
        if page == SCRATCH_PAGE or self._ref_counts[page] <= 0:
            raise BlockManagerError(f"page {page} freed with no owner (double free)")
        self._ref_counts[page] -= 1
        if self._ref_counts[page] == 0:
            self._free.append(page)
