"""The sockets `flashserve serve` listens on, as the front ends' event loops use them."""

from __future__ import annotations

import asyncio
import socket

from flashserve.entrypoints.serve import listening_sockets


def test_front_end_connections_send_small_writes_at_once_without_nagle_delays() -> None:
    # A streamed chunk, or a response body after its headers, must not wait for the client's
    # delayed ACK (40 ms on Linux): the loop sets TCP_NODELAY on what a front end's socket accepts.
    async def accepted_nodelay() -> int:
        sock = listening_sockets("127.0.0.1", 0, 1)[0]
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                conn = transport.get_extra_info("socket")
                seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
