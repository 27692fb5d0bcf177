"""KV cache events for KV-aware routers (`--kv-events-config`), in the wire format of vLLM 0.33.0
(`vllm/distributed/kv_events.py` there), so that a consumer written for vLLM reads them unchanged.

The engine core drains the KV cache manager's log once a step (`kv_cache/events.py`) and hands it
to `KVEventPublisher.publish`, which only appends it to a deque: a thread of the publisher's own
encodes the events of the steps since it last sent (at most `COALESCE_SECONDS` late) as one
`KVEventBatch` and sends it on a ZMQ PUB socket as three frames, (topic, sequence number as 8
bytes big-endian, msgpack payload). The sequence numbers count batches from 0 in each engine core
process. The last `buffer_steps` batches are kept for the ROUTER socket at `replay_endpoint`: a
subscriber that sends a start sequence number (8 bytes big-endian) there gets every kept batch
from it on, each as (topic, sequence, payload), then (b"", -1 as 8 bytes, b"").

Mapping: a `PagesStored` run becomes one `BlockStored` (block_size = the page size, medium "GPU",
the primary KV pool as vLLM names it whatever the device, group_idx 0; `extra_keys` has one entry
per page, the chain's cache_salt as `(salt,)` on a page that starts a salted chain, None
elsewhere, as vLLM), a `PagesRemoved` one `BlockRemoved`. A page hash goes out as its 32 sha256
bytes, or, with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` as in vLLM, as the int of its last 8 bytes.

Under `--data-parallel-size` engine core r publishes on the endpoints' port plus r (an inproc://
endpoint gets the suffix `_dp{r}`), and its batches carry `data_parallel_rank` r.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import msgspec

from flashserve.config import KVEventsConfig
from flashserve.kv_cache.events import KVCacheEvent, PagesRemoved, PagesStored

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
# Once woken by a step's events, how long the publisher thread waits for more before it sends
# them all as one batch: the most a batch is late.
COALESCE_SECONDS = 0.005


# ---- the wire format: vLLM 0.33.0's structs, field for field, in its order ---------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVWireEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """vLLM's KVCacheEvent: a map tagged with the class name under "type"."""


class BlockStored(KVWireEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVWireEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVWireEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def int_hashes_from_env() -> bool:
    return os.environ.get(INT_HASHES_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def to_wire(events: list[KVCacheEvent], page_size: int, int_hashes: bool = False,
            lora_names: Mapping[int, str] | None = None) -> list[BlockStored | BlockRemoved]:
    """The manager's records as vLLM's events, in order. `lora_names`: adapter id -> name, for the
    `lora_name` of pages an adapter's request stored (their `lora_id` is the id; both None for
    the base model's, as vLLM sends them)."""

    def external(page_hash: bytes) -> bytes | int:
        return int.from_bytes(page_hash[-8:], "big") if int_hashes else page_hash

    out: list[BlockStored | BlockRemoved] = []
    for event in events:
        if isinstance(event, PagesStored):
            extra: list[tuple[Any, ...] | None] = [None] * len(event.page_hashes)
            if event.parent_hash is None and event.cache_salt is not None:
                extra[0] = (event.cache_salt,)
            parent = None if event.parent_hash is None else external(event.parent_hash)
            out.append(BlockStored(
                block_hashes=[external(h) for h in event.page_hashes], parent_block_hash=parent,
                token_ids=event.token_ids, block_size=page_size, lora_id=event.lora_id or None, medium=MEDIUM_GPU,
                lora_name=(lora_names or {}).get(event.lora_id) if event.lora_id else None,
                extra_keys=extra, group_idx=0))
        elif isinstance(event, PagesRemoved):
            out.append(BlockRemoved(block_hashes=[external(h) for h in event.page_hashes], medium=MEDIUM_GPU,
                                    group_idx=0))
    return out


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule for data parallel rank `rank`: a tcp:// port plus the rank (port 0 stays 0),
    an inproc:// name plus `_dp{rank}`; rank 0 and ipc:// endpoints unchanged."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return endpoint


def _binds(endpoint: str) -> bool:
    """vLLM's convention: bind a wildcard, ipc:// or inproc:// endpoint; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes one engine core's KV cache events (see the module's docstring).

    `publish` never blocks and costs the engine thread a deque append: the publisher thread sleeps
    until the first step's events after it last sent, then `COALESCE_SECONDS` more, and sends every
    step's events that came meanwhile as one batch (in order). A thread woken once a step (a queue
    and a condition) cost the engine core process 8-25% more CPU per token on a loaded 2-core
    machine with 2 ms steps: a wake-up and a GIL hand-over per step. With more than
    `max_queue_size` steps waiting, the oldest are dropped (counted in `num_dropped`)."""

    def __init__(self, config: KVEventsConfig, page_size: int, data_parallel_rank: int = 0,
                 int_hashes: bool | None = None) -> None:
        import zmq  # here: only a server that publishes needs pyzmq

        self.page_size = page_size
        self.rank = data_parallel_rank
        self.int_hashes = int_hashes_from_env() if int_hashes is None else int_hashes
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self.num_dropped = 0
        # LoRA adapter id -> name, filled by the engine core as adapters load (ids are never reused,
        # so a name stays right for events of pages stored before its adapter was unloaded).
        self.lora_names: dict[int, str] = {}
        self._topic = config.topic.encode("utf-8")
        self._max_pending = config.max_queue_size
        self._pending: deque[tuple[float, list[KVCacheEvent]] | None] = deque()
        self._signalled = False  # a wake-up is on its way to the thread
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(self.endpoint):  # type: ignore[arg-type]
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A whole replay and its end marker fit in the queue of a slow subscriber (as vLLM).
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._thread = threading.Thread(target=self._run, name="flashserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV cache events on %s%s", self.endpoint,
                    f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    @property
    def num_pending(self) -> int:
        """Steps' events not sent yet."""
        return len(self._pending)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Hand over one step's events (nothing for an empty list)."""
        if not events:
            return
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: %d steps' events dropped so far (the publisher thread fell behind)",
                               self.num_dropped)
        self._pending.append((time.time(), events))
        self._wake()

    def _wake(self) -> None:
        # The thread clears the flag before it drains `_pending`: an append it may miss is one
        # made after the clear, whose caller then sees the flag down and wakes it again.
        if not self._signalled:
            self._signalled = True
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def close(self, timeout: float = 1.0) -> None:
        """Send what is pending (for up to `timeout` s), then close the sockets."""
        self._pending.append(None)
        self._signalled = False
        self._wake()
        self._thread.join(timeout)
        self._close_sockets()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            ready = dict(poller.poll())
            if self._replay is not None and self._replay in ready:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except Exception:  # a bad request must not end publishing
                    logger.exception("KV event replay failed")
            if self._wake_r not in ready:
                continue
            time.sleep(COALESCE_SECONDS)  # let more steps' events come: one message for them all
            os.read(self._wake_r, 4096)
            self._signalled = False
            ts, events, done = 0.0, [], False
            while self._pending:
                item = self._pending.popleft()
                if item is None:
                    done = True
                    break
                ts = item[0]
                events += item[1]
            if events:
                try:
                    batch = KVEventBatch(ts=ts, events=to_wire(events, self.page_size, self.int_hashes, self.lora_names),
                                         data_parallel_rank=self.rank)
                    payload = encoder.encode(batch)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    seq += 1
                except Exception:
                    logger.exception("publishing KV events failed")
            if done:
                return

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3:
            logger.warning("ignoring a KV event replay request of %d frames", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))  # type: ignore[union-attr]
