"""A front-end process of `flashserve serve`: uvicorn and the OpenAI app on the shared listening
socket, over an `EngineCoreClient` to the engine core (with `--data-parallel-size N`, a
`DataParallelClient` over one per engine core).

Its life follows the rules of `flashserve.entrypoints.lifecycle`: SIGTERM drains (new requests get 503, running
ones finish for up to `--shutdown-timeout` s) and exits 0; a dead engine core fails every open
request and exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any

from flashserve.client.codec import PROTOCOL_VERSION, Dead, EngineSetup, Hello, recv, send
from flashserve.entrypoints.processes import FRONTEND_NAME, become_child

logger = logging.getLogger("flashserve")

EXIT_ENGINE_DIED = 1


def main(index: int, conns: list[Connection], sock: socket.socket, args: Any) -> None:
    """The process's target: front end number `index` of a server started with `args` (ServeArgs),
    with a pipe to each engine core in `conns` (several under `--data-parallel-size`)."""
    become_child(FRONTEND_NAME.format(index), args.server.log_level)
    # Told to stop before it serves (while the model loads): nothing to drain. uvicorn installs
    # its own handlers once it serves.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    from flashserve.entrypoints.run_batch.app import import_tokenizer_classes

    import_tokenizer_classes()  # while the engine core loads the model
    setups = [_handshake(index, conn) for conn in conns]
    code = asyncio.run(serve(conns, sock, setups, args))
    sys.exit(code)


def _handshake(index: int, conn: Connection) -> EngineSetup:
    """The engine core's setup, or exit 1 if it cannot serve."""
    try:
        send(conn, Hello(PROTOCOL_VERSION, index))
        setup = recv(conn)
    except (EOFError, OSError):
        logger.error("the engine core exited before it was ready")
        sys.exit(EXIT_ENGINE_DIED)
    if isinstance(setup, Dead) or not isinstance(setup, EngineSetup) or setup.version != PROTOCOL_VERSION:
        logger.error("the engine core cannot serve: %s", getattr(setup, "reason", repr(setup)))
        sys.exit(EXIT_ENGINE_DIED)
    return setup


def engine_client(conns: list[Connection], setups: list[EngineSetup], args: Any) -> Any:
    """One EngineCoreClient, or a DataParallelClient over one per engine core."""
    from flashserve.client.core_client import EngineCoreClient

    clients = [EngineCoreClient(conn, setup, max_waiting=args.max_waiting) for conn, setup in zip(conns, setups)]
    if len(clients) == 1:
        return clients[0]
    from flashserve.client.dp_client import DataParallelClient
    from flashserve.client.router import PrefixRouter

    # Each front end balances its own requests, so it counts on its share of an engine's slots.
    slots = max(1, setups[0].max_num_seqs // args.api_server_count)
    router = PrefixRouter(len(clients), args.cache.page_size, args.data_parallel_routing == "prefix", slots=slots)
    return DataParallelClient(clients, router)


async def serve(conns: list[Connection], sock: socket.socket, setups: list[EngineSetup], args: Any) -> int:
    import uvicorn

    from flashserve.api.options import ServerState
    from flashserve.api.server import build_app
    from flashserve.entrypoints.lifecycle import drain, graceful_server, stop_when_dead
    from flashserve.metrics import Metrics

    setup = setups[0]
    names = list(args.model.served_model_names) or [setup.model_name]
    metrics, state = Metrics(model_name=names[0]), ServerState()
    engine = engine_client(conns, setups, args)
    app = build_app(engine, setup.tokenizer, names, setup.max_model_len, eos_token_ids=setup.eos_token_ids,
                    options=args.api, metrics=metrics, state=state, vocab_size=setup.vocab_size)
    config = uvicorn.Config(app, log_level=args.server.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=5)
    server: Any = None
    server = graceful_server(config, lambda: drain(server, state, engine, args.shutdown_timeout))
    engine.on_dead = stop_when_dead(server, state)
    engine.start()
    try:
        await server.serve(sockets=[sock])
    finally:
        engine.shutdown()
    return EXIT_ENGINE_DIED if engine.dead_reason is not None else 0
