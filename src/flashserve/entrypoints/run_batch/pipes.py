"""The pipes between run-batch's two processes: one each way, each as large as the system allows.

The engine process reads between steps, so a step's worth of the app's requests should fit in the
pipe: at the default 64 KiB five to seven requests of a 2,200-token prompt did, and the rest waited
for the engine's next step (once in the app's blocked event loop; now in its `FrameWriter`). A socket pair (what a duplex
`multiprocessing.Pipe` is) holds about 200 KiB unless the system's limits were raised; a pipe can be
set to 1 MiB, Linux's default most for an unprivileged process. `Duplex` makes the two one-way
pipes of one end look like the duplex connection that `EngineCore` and `EngineCoreClient` speak
their messages over.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

try:
    import fcntl
except ImportError:  # not on Windows
    fcntl = None  # type: ignore[assignment]

PIPE_BYTES = 1 << 20


def pipe(context: Any) -> tuple[Connection, Connection]:
    """(reader, writer) of a pipe that holds up to `PIPE_BYTES` where the system allows it, else
    the default 64 KiB."""
    reader, writer = context.Pipe(duplex=False)
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if set_size is not None:
        try:
            fcntl.fcntl(writer.fileno(), set_size, PIPE_BYTES)
        except OSError:  # above this system's limit: the default stays
            pass
    return reader, writer


class Duplex:
    """One end of two one-way pipes, with the part of a duplex `Connection` that the codec
    (`send_bytes`, `recv_bytes`), `EngineCore` (`multiprocessing.connection.wait`, `poll`, `close`)
    and `EngineCoreClient` (`fileno` for the event loop's reader, `closed`) use."""

    def __init__(self, reader: Connection, writer: Connection) -> None:
        self.reader, self.writer = reader, writer

    def fileno(self) -> int:
        return self.reader.fileno()

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.reader.poll(timeout)

    def recv_bytes(self) -> bytes:
        return self.reader.recv_bytes()

    def send_bytes(self, data: bytes) -> None:
        self.writer.send_bytes(data)

    @property
    def closed(self) -> bool:
        return self.reader.closed

    def close(self) -> None:
        self.reader.close()
        self.writer.close()
