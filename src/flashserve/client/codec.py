"""The messages between the front ends and the engine core, and their codec.

Everything that crosses is plain data: dataclasses of ints, floats, strings, lists and tuples (a
request's grammar travels as its spec, which the engine core compiles). One message is one pickled
tuple `(kind, payload)` sent whole through a pipe (`multiprocessing.connection`, a Unix socket
pair). Pickle, not msgspec: a step's outputs for 100 streams (one token each) encode and decode in
about the same time either way here (benchmark/codec_bench.py), pickle needs no schema for the
nested dataclasses, and the pipes frame messages already.

The front end speaks first: `Hello(PROTOCOL_VERSION)`; the engine core answers with an
`EngineSetup` of the same version or a `Dead` that says why not. A front end and an engine core of
different versions never exchange requests.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from flashserve.engine.outputs import RequestOutput
from flashserve.engine.streams import Abort, Add

# Bump whenever a message below changes shape.
PROTOCOL_VERSION = 1


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


@dataclass(frozen=True)
class AddRequest:
    """A new request: `add.params.grammar` is None; `grammar_spec` (an `api.structured.GrammarSpec`,
    itself plain data) is the grammar the engine core compiles for it, or None."""

    add: Add
    grammar_spec: Any = None


@dataclass(frozen=True)
class StepOutputs:
    """One step's outputs for the requests of one front end (only the ones that got tokens or
    finished), and the engine's queue length, which front ends check `--max-waiting` against."""

    outputs: list[RequestOutput] = field(default_factory=list)
    num_waiting: int = 0


@dataclass(frozen=True)
class Dead:
    """The engine core is gone, or cannot serve this front end: every open request fails."""

    reason: str


Message = Hello | EngineSetup | AddRequest | Abort | StepOutputs | Dead


def encode(message: Message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    return pickle.loads(data)


def send(conn: Connection, message: Message) -> None:
    """Raises OSError (BrokenPipeError) when the far end is gone."""
    conn.send_bytes(encode(message))


def recv(conn: Connection) -> Message:
    """Raises EOFError (or OSError) when the far end is gone."""
    return decode(conn.recv_bytes())
