"""The Responses API's stored responses: in this process's memory, bounded in count and age.

A stored response keeps its own input items and output items and the id of the response it
continued, so a conversation of n turns is held once, not n times; `conversation` walks the chain
back. Reading a response (to continue it, or by GET) counts as using it: the least recently used
goes first when the store is full, and a response expires `max_age_s` after its last use, so a
conversation in progress outlives idle ones. Nothing survives a restart, and each server process
(behind a load balancer, each replica) has its own store.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    input_items: list[dict[str, Any]]  # this turn's input, as items (instructions left out)
    previous_id: str | None
    last_used: float = field(default=0.0)

    @property
    def output_items(self) -> list[dict[str, Any]]:
        return self.response["output"]


class MissingResponse(KeyError):
    """A response id this store does not hold (never stored, deleted, evicted or expired)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    def __init__(self, max_entries: int, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be zero or more, got {max_entries}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s}")
        self.max_entries = max_entries  # 0: nothing is stored
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        self._expire()
        entry.last_used = self._clock()
        self._entries[entry.response["id"]] = entry
        self._entries.move_to_end(entry.response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response, now counted as used; MissingResponse if it is not held."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            raise MissingResponse(response_id)
        entry.last_used = self._clock()
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self._expire()
        if self._entries.pop(response_id, None) is None:
            raise MissingResponse(response_id)

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every turn's input and output items up to and including `response_id`'s, oldest first;
        MissingResponse naming the first link of the chain that is gone."""
        turns: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None:
            entry = self.get(next_id)
            turns.append(entry)
            next_id = entry.previous_id
        items: list[dict[str, Any]] = []
        for entry in reversed(turns):
            items += entry.input_items + entry.output_items
        return items

    def _expire(self) -> None:
        horizon = self._clock() - self.max_age_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.last_used > horizon:
                break
            self._entries.popitem(last=False)
