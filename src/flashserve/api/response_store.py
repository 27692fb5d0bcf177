"""The Responses API's stored responses, bounded in count and age: in this process's memory
(`ResponseStore`), or in a SQLite file that every front-end process of one `flashserve serve`
shares (`SharedResponseStore`), so that a `previous_response_id` works whichever front end the
next request reaches.

A stored response keeps its own input items and output items and the id of the response it
continued, so a conversation of n turns is held once, not n times; `conversation` walks the chain
back. Reading a response (to continue it, or by GET) counts as using it: the least recently used
goes first when the store is full, and a response expires `max_age_s` after its last use, so a
conversation in progress outlives idle ones. Nothing survives a restart, and each server (behind
a load balancer, each replica) has its own store.
"""

from __future__ import annotations

import json
import sqlite3
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


class _Chains:
    """`conversation` over a store's `get`."""

    def get(self, response_id: str) -> StoredResponse:
        raise NotImplementedError

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


def _check_bounds(max_entries: int, max_age_s: float) -> None:
    if max_entries < 0:
        raise ValueError(f"max_entries must be zero or more, got {max_entries}")
    if not max_age_s > 0:
        raise ValueError(f"max_age_s must be positive, got {max_age_s}")


class ResponseStore(_Chains):
    def __init__(self, max_entries: int, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        _check_bounds(max_entries, max_age_s)
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

    def _expire(self) -> None:
        horizon = self._clock() - self.max_age_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.last_used > horizon:
                break
            self._entries.popitem(last=False)


class SharedResponseStore(_Chains):
    """The same rules over a SQLite file that several processes open (`path`, made beforehand by
    `create`); `clock` is wall time, which every process reads alike. SQLite serialises the
    writers; a put, get or delete is one short transaction."""

    def __init__(self, path: str, max_entries: int, max_age_s: float, clock: Callable[[], float] = time.time) -> None:
        _check_bounds(max_entries, max_age_s)
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._clock = clock
        self._db = _connect(path)
        if self._db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":  # not made by `create`
            self._db.close()
            self.create(path)
            self._db = _connect(path)

    @staticmethod
    def create(path: str) -> None:
        """Makes the file, once, before the processes that share it start. Two processes that
        switch a new file to WAL at the same moment get "database is locked" at once (SQLite does
        not wait on that lock), so that is never left to them."""
        db = _connect(path)
        try:
            db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for a writer; kept in the file
            # last_used (the clock) for expiry; use (a counter) for the order of use, which two
            # uses within the clock's resolution would leave undecided.
            db.execute("CREATE TABLE IF NOT EXISTS responses "
                       "(id TEXT PRIMARY KEY, entry TEXT NOT NULL, last_used REAL NOT NULL, use INTEGER NOT NULL)")
            db.execute("CREATE INDEX IF NOT EXISTS responses_by_use ON responses (use)")
        finally:
            db.close()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        with self._db:
            self._expire()
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def put(self, entry: StoredResponse) -> None:
        if not self.enabled:
            return
        entry.last_used = self._clock()
        data = json.dumps({"response": entry.response, "input_items": entry.input_items,
                           "previous_id": entry.previous_id})
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._expire()
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                             (entry.response["id"], data, entry.last_used, self._next_use()))
            self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY use DESC "
                             "LIMIT -1 OFFSET ?)", (self.max_entries,))

    def get(self, response_id: str) -> StoredResponse:
        """The stored response, now counted as used; MissingResponse if it is not held."""
        now = self._clock()
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._expire()
            row = self._db.execute("SELECT entry FROM responses WHERE id = ?", (response_id,)).fetchone()
            if row is None:
                raise MissingResponse(response_id)
            self._db.execute("UPDATE responses SET last_used = ?, use = ? WHERE id = ?",
                             (now, self._next_use(), response_id))
        data = json.loads(row[0])
        return StoredResponse(data["response"], data["input_items"], data["previous_id"], now)

    def delete(self, response_id: str) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._expire()
            if self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 0:
                raise MissingResponse(response_id)

    def _next_use(self) -> int:
        return self._db.execute("SELECT COALESCE(MAX(use), 0) + 1 FROM responses").fetchone()[0]

    def _expire(self) -> None:
        self._db.execute("DELETE FROM responses WHERE last_used <= ?", (self._clock() - self.max_age_s,))


def _connect(path: str) -> sqlite3.Connection:
    return sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
