"""The engine core's side of its pipes to the front ends: the handshake, waiting for what they send
while what waits for them goes out, one message per front end per step, and the notice of a loop
that died.

Outputs go out without blocking (a `FrameQueue` per front end): a front end that stops reading for
a while (its event loop busy) gets its messages later, in order, and the other front ends' streams
do not wait for it. One that leaves more than `MAX_UNREAD_BYTES` unread is taken for stuck and
dropped as if it had gone (its pipe closes, so it fails its requests when it reads again), rather
than held in this process's memory without end. A front end that goes away (its pipe reads EOF or
refuses a write) is dropped too; `on_drop` hears of each, so that its requests are aborted.
"""

from __future__ import annotations

import logging
import selectors
import time
from multiprocessing.connection import Connection
from typing import Callable, Mapping

from flashserve.message.codec import (
    PROTOCOL_VERSION, Dead, EngineSetup, FrameQueue, Hello, Message, StepOutputs, recv, send,
)
from flashserve.message.outputs import RequestOutput

logger = logging.getLogger(__name__)

# Outputs a front end may leave unread before it is dropped: a step's message for 100 streams is
# about 6.5 KB (`benchmark.codec_bench`), so this is some 40,000 steps of a stalled event loop.
MAX_UNREAD_BYTES = 256 << 20
# When the step loop died: how long the front ends get to read what waits for them and the `Dead`
# (a front end that does not read by then still sees the pipe close when this process exits).
DEAD_NOTICE_SECONDS = 5.0


class FrontEnds:
    """The front ends connected to one engine core. `on_drop(conn)` is called for each one dropped,
    before its pipe closes."""

    def __init__(self, on_drop: Callable[[Connection], None]) -> None:
        self.on_drop = on_drop
        self.conns: list[Connection] = []
        self._waiting_sent: dict[Connection, int] = {}  # the queue length each front end last heard
        self._out: dict[Connection, FrameQueue] = {}  # what each front end has yet to read
        # One selector for the whole run (multiprocessing's `wait` builds one per call): every
        # front end's read side, and the write side of those with outputs waiting.
        self._selector = selectors.DefaultSelector()
        self._interests: dict[int, int] = {}  # descriptor -> events registered

    def __bool__(self) -> bool:
        return bool(self.conns)

    def __contains__(self, conn: Connection) -> bool:
        return conn in self._waiting_sent

    def pending(self, conn: Connection) -> bool:
        """Whether outputs wait for `conn` to read them."""
        return bool(self._out[conn].pending)

    def connect(self, conn: Connection, setup: EngineSetup | None) -> bool:
        """The handshake with one front end: its Hello, then `setup` (or a Dead on a version
        mismatch); False if it did not come through."""
        try:
            hello = recv(conn)
            if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
                send(conn, Dead(f"front end speaks {hello!r}; this engine core speaks version {PROTOCOL_VERSION}"))
                return False
            send(conn, setup)
        except (EOFError, OSError):
            return False
        self.conns.append(conn)
        self._waiting_sent[conn] = 0
        self._out[conn] = FrameQueue(conn)
        self._interest(conn.fileno(), selectors.EVENT_READ, True)
        return True

    def readable(self, timeout: float | None) -> list[Connection]:
        """The front ends with messages to read, after up to `timeout` s (None: until one has).
        Meanwhile what waits for a front end goes out as it reads."""
        behind = []
        for conn in self.conns:
            queue = self._out[conn]
            self._interest(queue.fd, selectors.EVENT_WRITE, queue.pending)
            if queue.pending:
                behind.append(conn)
        ready = {key.fd: mask for key, mask in self._selector.select(timeout)}
        for conn in behind:
            if ready.get(self._out[conn].fd, 0) & selectors.EVENT_WRITE:
                try:
                    self._out[conn].flush()
                except OSError:
                    self.drop(conn)
        return [conn for conn in self.conns if ready.get(conn.fileno(), 0) & selectors.EVENT_READ]

    def _interest(self, fd: int, event: int, on: bool) -> None:
        """Waits for `event` on `fd` from now on, or no longer."""
        before = self._interests.get(fd, 0)
        after = before | event if on else before & ~event
        if after == before:
            return
        if not before:
            self._selector.register(fd, after)
        elif not after:
            self._selector.unregister(fd)
        else:
            self._selector.modify(fd, after)
        if after:
            self._interests[fd] = after
        else:
            del self._interests[fd]

    def drop(self, conn: Connection) -> None:
        """A front end is gone (or taken for stuck): forget it, tell `on_drop`, close its pipe."""
        if conn not in self._waiting_sent:
            return
        self.conns.remove(conn)
        del self._waiting_sent[conn]
        queue = self._out.pop(conn)
        queue.clear()
        self._interest(queue.fd, selectors.EVENT_WRITE, False)
        self._interest(conn.fileno(), selectors.EVENT_READ, False)
        self.on_drop(conn)
        conn.close()

    def send_step(self, outputs: Mapping[Connection, list[RequestOutput]], num_waiting: int) -> None:
        """One message per front end that has outputs, or whose idea of the queue length is stale."""
        for conn in list(self.conns):
            mine = outputs.get(conn)
            if mine is None and self._waiting_sent[conn] == num_waiting:
                continue
            self._waiting_sent[conn] = num_waiting
            queue = self._out[conn]
            try:
                queue.put(StepOutputs(mine or [], num_waiting))
            except OSError:
                self.drop(conn)
                continue
            if queue.backlog > MAX_UNREAD_BYTES:
                logger.error("a front end left %.1f MB of outputs unread; dropping it", queue.backlog / 1e6)
                self.drop(conn)

    def send(self, conn: Connection, message: Message) -> None:
        """One message to one front end, after what waits for it (a front end gone is dropped)."""
        try:
            self._out[conn].put(message)
        except OSError:
            self.drop(conn)

    def send_all(self, message: Message) -> None:
        for conn in list(self.conns):
            self.send(conn, message)

    def send_dead(self, reason: str) -> None:
        """Every front end hears why, after what waits for it, for up to DEAD_NOTICE_SECONDS."""
        behind = []
        for conn in list(self.conns):
            try:
                if self._out[conn].put(Dead(reason)):
                    behind.append(conn)
            except OSError:
                pass
        deadline = time.monotonic() + DEAD_NOTICE_SECONDS
        while behind and (left := deadline - time.monotonic()) > 0:
            with selectors.DefaultSelector() as selector:
                for conn in behind:
                    selector.register(self._out[conn].fd, selectors.EVENT_WRITE, conn)
                writable = [key.data for key, _ in selector.select(left)]
            for conn in writable:
                try:
                    if not self._out[conn].flush():
                        behind.remove(conn)
                except OSError:
                    behind.remove(conn)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        self._selector.close()
