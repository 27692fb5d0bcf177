"""Rank 0's steps to the workers on one node through shared memory, without a collective.

A step sent with `broadcast_object_list` over gloo costs two TCP collectives and their thread
hand-offs each time (0.65 ms median for a batch-1 decode step between two processes on a 2-core
machine), and both ends wait for it. `StepChannel` is one writer (rank 0) and N-1 readers over a
shared-memory file: rank 0 writes the pickled step into the slot and bumps a sequence number; each
worker polls the number, copies the step out and acknowledges it. Rank 0 writes the next step
once every worker has acknowledged the last (with overlap scheduling a worker is at most a step
behind). A step larger than the slot travels over the gloo group instead: the slot then says so.

The channel also tells rank 0 when each worker is about to join the group (`arrive`), so that
a worker that dies while it starts (an import, its GPU) fails the start at once rather than after
the rendezvous timeout. The file lives in /dev/shm only while the ranks start: rank 0 unlinks it
once every rank has joined the group, after which only the mappings hold it, so nothing is left
behind however the processes end. Ranks that a launcher started (torchrun, possibly on several
nodes) keep the gloo broadcast.

Waiting: a reader spins (yielding the GIL and the core) for `SPIN_S` after each message, then
sleeps 50 us between polls, and 1 ms after a second with no message, so an idle server's workers
cost next to nothing and the first step after a pause waits at most about a millisecond.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 4 << 20  # a step of 256 requests with long page lists fits; larger ones go over gloo
_MAX_READERS = 15
_HEADER = 16 + 16 * _MAX_READERS  # seq (u64), length (i64), then per reader an acknowledgement and an arrival
_ARRIVALS = 16 + 8 * _MAX_READERS
_OVER_GLOO = -1  # the length field of a step that travels over the gloo group
SPIN_S = 0.002
_IDLE_S = 1.0

_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier: taking and releasing a lock is one (the stores before it are seen
    before those after it on every CPU, weakly ordered ones included)."""
    with _fence_lock:
        pass


def available(world_size: int) -> bool:
    return SHM_DIR.is_dir() and 1 < world_size <= _MAX_READERS + 1


class StepChannel:
    """One side of the channel: rank 0 `send`s, the others `receive`. `control` is the gloo group
    that carries steps too large for the slot (every rank passes the same group)."""

    def __init__(self, path: Path, rank: int, world_size: int, control: Any, *, create: bool) -> None:
        self.path, self.rank, self.world_size, self.control = path, rank, world_size, control
        size = _HEADER + SLOT_BYTES
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._seq = ctypes.c_uint64.from_buffer(self._map, 0)
        self._length = ctypes.c_int64.from_buffer(self._map, 8)
        self._acks = [ctypes.c_uint64.from_buffer(self._map, 16 + 8 * i) for i in range(world_size - 1)]
        self._arrivals = [ctypes.c_uint64.from_buffer(self._map, _ARRIVALS + 8 * i) for i in range(world_size - 1)]
        self._last = 0  # the last sequence number this side sent or received

    @classmethod
    def create(cls, world_size: int) -> StepChannel:
        """Rank 0's end, on a new file (`path` goes to the workers; `control` is set once the
        group has formed)."""
        path = SHM_DIR / f"flashserve-steps-{os.getpid()}-{secrets.token_hex(4)}"
        return cls(path, 0, world_size, None, create=True)

    def arrive(self) -> None:
        """A worker: about to join the group (its imports and its device are in order)."""
        self._arrivals[self.rank - 1].value = 1

    def wait_arrivals(self, alive: Callable[[], None], timeout: float) -> None:
        """Rank 0, before it joins the group: waits until every worker has arrived, calling
        `alive` (which raises when a worker has died) meanwhile, so that a worker that dies while
        it starts fails the start at once instead of after the rendezvous timeout."""
        deadline = time.monotonic() + timeout
        while not all(arrival.value for arrival in self._arrivals):
            alive()
            if time.monotonic() > deadline:
                missing = [i + 1 for i, arrival in enumerate(self._arrivals) if not arrival.value]
                raise TimeoutError(f"ranks {missing} did not start within {timeout:.0f} s")
            time.sleep(0.01)

    def unlink(self) -> None:
        """Removes the file once every rank has it mapped (rank 0, after the group has formed)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def send(self, step: Any, alive: Callable[[], None] = lambda: None) -> None:
        """Rank 0: publishes `step` once every reader has taken the last one. `alive` is called
        while waiting and raises when a reader has died."""
        waited = 0
        while any(ack.value != self._last for ack in self._acks):
            waited += 1
            if waited % 1024 == 0:
                alive()
            time.sleep(0 if waited < 4096 else 5e-5)
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        over_gloo = len(data) > SLOT_BYTES
        if not over_gloo:
            self._map[_HEADER : _HEADER + len(data)] = data
        self._length.value = _OVER_GLOO if over_gloo else len(data)
        _fence()
        self._last += 1
        self._seq.value = self._last
        if over_gloo:
            dist.broadcast_object_list([step], src=0, group=self.control)

    def receive(self) -> Any:
        """A worker: the next step rank 0 sent (waits for it)."""
        start = time.monotonic()
        while self._seq.value == self._last:
            idle = time.monotonic() - start
            time.sleep(0 if idle < SPIN_S else 5e-5 if idle < _IDLE_S else 1e-3)
        _fence()
        self._last += 1
        length = self._length.value
        step = pickle.loads(self._map[_HEADER : _HEADER + length]) if length != _OVER_GLOO else None
        _fence()
        self._acks[self.rank - 1].value = self._last
        if length == _OVER_GLOO:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            step = box[0]
        return step

    def close(self) -> None:
        del self._seq, self._length, self._acks, self._arrivals
        self._map.close()

    def discard(self) -> None:
        """Rank 0, when the ranks failed to start: the file and the mapping go."""
        self.unlink()
        self.close()


class GlooSteps:
    """Steps over the gloo group alone (`broadcast_object_list`): ranks a launcher started,
    possibly on several nodes, or a machine without /dev/shm. `StepChannel`'s send, receive and
    close."""

    def __init__(self, control: Any) -> None:
        self.control = control

    def send(self, step: Any, alive: Callable[[], None] = lambda: None) -> None:
        dist.broadcast_object_list([step], src=0, group=self.control)

    def receive(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        pass
