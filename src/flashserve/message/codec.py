"""The messages between the front ends and the engine core, and their codec.

Everything that crosses is plain data: dataclasses of ints, floats, strings, lists and tuples (a
request's grammar travels as its spec, which the engine core compiles). A message is sent whole
through a pipe (`multiprocessing.connection`, a Unix socket pair, which frames it): one byte that
names its kind, then its body. The messages of every step and request (`StepOutputs`,
`AddRequest`, `Abort`) are MessagePack by msgspec, decoded straight into their classes; the rare
ones (`Hello`, `EngineSetup` with its tokenizer, the LoRA adapter updates, `Dead`) are pickled. msgspec, not pickle, for the
hot ones: the engine core encodes a step's outputs once per front end every step, and for 512
streams msgspec encodes them in 44 us against pickle's 517 (`benchmark/codec_bench.py`). Each
output (`RequestOutput`, a msgspec Struct) travels as an array, not a map of its twelve field
names: a third of the bytes, and a sixth of the encoding time, of the map it was.

The front end speaks first: `Hello(PROTOCOL_VERSION)`; the engine core answers with an
`EngineSetup` of the same version or a `Dead` that says why not. A front end and an engine core of
different versions never exchange requests.

Neither side blocks on a write: a front end writes through `FrameWriter`, on its event loop; the
engine core through a `FrameQueue` per front end, flushed between steps. Two processes blocked on
full pipes to each other (a burst of long prompts one way, a step's outputs the other) would wait
forever, and an engine core blocked on one front end that stopped reading would stall every other.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from flashserve.message.grammar_spec import GrammarSpec
from flashserve.message.lora import LoRARequest
from flashserve.message.outputs import RequestOutput
from flashserve.message.requests import Abort, Add

# Bump whenever a message below changes shape.
PROTOCOL_VERSION = 6


@dataclass(frozen=True)
class Hello:
    """A front end's first message."""

    version: int
    frontend: int  # its index among the front ends, for the engine core's logs


@dataclass(frozen=True)
class EngineSetup:
    """What a front end needs from the engine core, sent once the model is loaded."""

    version: int
    tokenizer: Any  # the HF tokenizer (pickles as its files' contents), or None
    model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_num_seqs: int = 256  # requests one step holds, as resolved for the engine core's device
    lora_enabled: bool = False  # --enable-lora
    lora_adapters: tuple[LoRARequest, ...] = ()  # the LoRA adapters loaded (--lora-modules at start)


@dataclass(frozen=True)
class AddRequest:
    """A new request: `add.params.grammar` is None; `grammar_spec` is the grammar the engine core
    compiles for it, or None. `prefix_member`: (group, member) of an offline batch's prefix-sharing
    plan (run-batch), whose group's prefix the engine core keeps pinned while the group runs."""

    add: Add
    grammar_spec: GrammarSpec | None = None
    prefix_member: tuple[int, int] | None = None

    @property
    def lora_int_id(self) -> int:
        """The request's LoRA adapter (`add.lora_request`), 0 for the base model."""
        return self.add.lora_int_id


@dataclass(frozen=True)
class StepOutputs:
    """One step's outputs for the requests of one front end (only the ones that got tokens or
    finished), and the engine's queue length, which front ends check `--max-waiting` against."""

    outputs: list[RequestOutput] = field(default_factory=list)
    num_waiting: int = 0


@dataclass(frozen=True)
class LoRAUpdate:
    """A front end asks the engine core to load an adapter (`lora_path` set) or unload one (None);
    the core answers the asking front end with a `LoRAUpdateDone` of the same `call_id`."""

    call_id: int
    lora_name: str
    lora_path: str | None = None
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoRAUpdateDone:
    """The answer to a `LoRAUpdate`: `error` None when it was done, else why not, with `error_kind`
    the name of the `message.lora` error class (LoRAAdapterError, LoRANotFound, LoRAInUse)."""

    call_id: int
    error: str | None = None
    error_kind: str | None = None


@dataclass(frozen=True)
class LoRAAdapters:
    """The engine core's adapters after a change, sent to every front end."""

    adapters: tuple[LoRARequest, ...]


@dataclass(frozen=True)
class Dead:
    """The engine core is gone, or cannot serve this front end: every open request fails."""

    reason: str


Message = Hello | EngineSetup | AddRequest | Abort | StepOutputs | LoRAUpdate | LoRAUpdateDone | LoRAAdapters | Dead

# The first byte of a message: its kind. Kinds not listed are pickled.
_TYPED: tuple[type, ...] = (StepOutputs, AddRequest, Abort)
_PICKLED = 255
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = [msgspec.msgpack.Decoder(kind) for kind in _TYPED]
_TAGS = {kind: bytes([i]) for i, kind in enumerate(_TYPED)}


def encode(message: Message) -> bytes:
    tag = _TAGS.get(type(message))
    if tag is None:
        return bytes([_PICKLED]) + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return tag + _ENCODER.encode(message)


def decode(data: bytes) -> Message:
    tag, body = data[0], memoryview(data)[1:]
    if tag == _PICKLED:
        return pickle.loads(body)
    return _DECODERS[tag].decode(body)


def send(conn: Connection, message: Message) -> None:
    """Raises OSError (BrokenPipeError) when the far end is gone."""
    conn.send_bytes(encode(message))


def recv(conn: Connection) -> Message:
    """Raises EOFError (or OSError) when the far end is gone."""
    return decode(conn.recv_bytes())


class FrameQueue:
    """Messages to one far end, written without blocking: what the pipe cannot take now waits here,
    in order, and goes out on a later `put` or `flush` as the far end reads. `conn` is a duplex
    `Connection`, or run-batch's `Duplex` of two pipes (written on its `writer`). Frames are
    `Connection`'s own (a 4-byte big-endian length, or -1 and an 8-byte one), so the far end reads
    them with `recv_bytes`. Each write makes the descriptor non-blocking for its own duration only,
    so the reads on it (in the same thread, never at the same time) still block until a message is
    whole."""

    def __init__(self, conn: Any) -> None:
        self.fd = getattr(conn, "writer", conn).fileno()
        self._pending: deque[memoryview] = deque()
        self._backlog = 0

    @property
    def pending(self) -> bool:
        """Whether something waits for the far end to read."""
        return bool(self._pending)

    @property
    def backlog(self) -> int:
        """Bytes waiting for the far end."""
        return self._backlog

    def put(self, message: Message) -> bool:
        """Sends the message, or as much of it as the pipe takes, after what waits already; returns
        whether something still waits. Raises OSError (BrokenPipeError) when the far end is gone."""
        payload = encode(message)
        n = len(payload)
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        frame = memoryview(header + payload)
        self._pending.append(frame)
        self._backlog += len(frame)
        return self.flush()

    def flush(self) -> bool:
        """Sends what waits, as far as the pipe takes it now; returns whether something still
        waits. Raises OSError when the far end is gone."""
        pending = self._pending
        while pending:
            chunk = pending[0]
            sent = self._write(chunk)
            self._backlog -= sent
            if sent < len(chunk):
                pending[0] = chunk[sent:]
                return True
            pending.popleft()
        return False

    def clear(self) -> None:
        """Drops what waits (the far end is going away with it)."""
        self._pending.clear()
        self._backlog = 0

    def _write(self, data: memoryview) -> int:
        os.set_blocking(self.fd, False)
        try:
            return os.write(self.fd, data)
        except BlockingIOError:
            return 0
        finally:
            os.set_blocking(self.fd, True)


class FrameWriter(FrameQueue):
    """A `FrameQueue` on an event loop: what waits goes out as the far end reads (`add_writer`).
    Reads on the same descriptor happen on the same loop, so never during a write."""

    def __init__(self, conn: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(conn)
        self._loop = loop
        self._watching = False

    def write(self, message: Message) -> None:
        """Queues the message; raises OSError (BrokenPipeError) when the far end is gone."""
        if self.put(message) and not self._watching:
            self._loop.add_writer(self.fd, self._on_writable)
            self._watching = True

    def close(self) -> None:
        """Drops what waits (the far end is going away with it)."""
        self.clear()
        self._unwatch()

    def _on_writable(self) -> None:
        try:
            if self.flush():
                return
        except OSError:  # the far end is gone; its reader reports that
            self.clear()
        self._unwatch()

    def _unwatch(self) -> None:
        if self._watching:
            self._loop.remove_writer(self.fd)
            self._watching = False
