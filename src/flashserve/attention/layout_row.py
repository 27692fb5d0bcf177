"""What a batch layout reads of a request: the rows that `base.BatchLayout` and the cascade's
prefix level are built from."""

from __future__ import annotations

from typing import Protocol, Sequence


class LayoutRow(Protocol):
    """A request's share of a step as a layout reads it (`input_batch.BatchRow`, or a new
    `ScheduledRequest`, whose `page_ids` is its whole table)."""

    request_id: str
    num_computed_tokens: int
    page_ids: Sequence[int]  # the request's whole page table

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def kv_len(self) -> int: ...
