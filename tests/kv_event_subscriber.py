"""A KV cache event subscriber written to vLLM 0.33.0's format, as a KV-aware router would write it
against vLLM: its own msgspec structs (strict decoding: a field of the wrong type fails), the
PUB/SUB framing and the ROUTER replay protocol. It rebuilds a publisher's set of cached blocks from
the events alone, asking for a replay whenever it sees a gap in the sequence numbers (at start, and
after a restart from a saved state)."""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=True):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = -1


def documented_hash(parent: bytes | None, tokens: list[int], salt: str | None, seed: str = "flashserve") -> bytes:
    """docs/production.md's page hash: what a router that hashes token ids itself computes."""
    if parent is None:
        key = b"\x00" if salt is None else b"\x01" + salt.encode()
        parent = hashlib.sha256(b"flashserve-kv-root\x00" + hashlib.sha256(seed.encode()).digest() + key).digest()
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


class Subscriber:
    """Follows one publisher (`endpoint`, `replay_endpoint`: where to connect). State: `blocks`
    (hash -> (parent hash, salt of its chain, token ids)), `last_seq`; pass a saved state to
    resume after a restart."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "",
                 blocks: dict[Any, tuple[Any, str | None, list[int]]] | None = None, last_seq: int = -1) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.blocks = dict(blocks or {})
        self.last_seq = last_seq
        self.batches: list[KVEventBatch] = []  # every batch applied, in order
        self.num_replayed = 0

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)

    @property
    def cached(self) -> set[Any]:
        return set(self.blocks)

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return  # already applied (a replay overlapping the live stream)
        assert seq == self.last_seq + 1, f"applying {seq} after {self.last_seq}"
        batch = DECODER.decode(payload)
        for event in batch.events:
            if isinstance(event, BlockStored):
                salt = None
                if event.parent_block_hash is None:
                    first = event.extra_keys[0] if event.extra_keys else None
                    salt = first[0] if first else None
                elif event.parent_block_hash in self.blocks:
                    salt = self.blocks[event.parent_block_hash][1]
                parent = event.parent_block_hash
                size = event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * size : (i + 1) * size]
                    self.blocks[block_hash] = (parent, salt, tokens)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    del self.blocks[block_hash]
            else:
                self.blocks.clear()
        self.batches.append(batch)
        self.last_seq = seq

    def request_replay(self, timeout_s: float = 10.0) -> None:
        """Everything from last_seq + 1 that the publisher still keeps."""
        self.replay.send_multipart((b"", (self.last_seq + 1).to_bytes(8, "big")))
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.replay.poll(max(0, int((deadline - time.monotonic()) * 1000))), "no replay answer"
            _, topic, seq_bytes, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                return
            self.num_replayed += 1
            self._apply(seq, payload)

    def poll(self, quiet_s: float = 0.3, timeout_s: float = 10.0) -> None:
        """Apply live batches until none comes for `quiet_s`; a gap in the sequence asks for a replay."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.sub.poll(int(quiet_s * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq + 1:
                self.request_replay()
            self._apply(seq, payload)
