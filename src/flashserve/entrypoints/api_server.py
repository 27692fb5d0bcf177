"""A front-end process of `flashserve serve`: uvicorn and the OpenAI app on the shared listening
socket, over an `EngineCoreClient` to the engine core (with `--data-parallel-size N`, a
`DataParallelClient` over one per engine core).

Its life follows the rules of `flashserve.entrypoints.lifecycle`: SIGTERM drains (new requests get 503, running
ones finish for up to `--shutdown-timeout` s) and exits 0; a dead engine core fails every open
request and exits 1.

It serves from its first moments: while the engine core loads the model (and warms it up), a thread
waits for its setup and uvicorn answers through a `StartupGate` (`/health`: 503 "loading model");
once the setup is here the OpenAI app takes over. SIGTERM meanwhile exits 0 at once; an engine
core that cannot serve makes it exit 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from flashserve.entrypoints.processes import FRONTEND_NAME, become_child
from flashserve.message.codec import Dead, EngineSetup, Hello, PROTOCOL_VERSION, recv, send

if TYPE_CHECKING:
    from flashserve.serve_args import ServeArgs

logger = logging.getLogger("flashserve")

EXIT_ENGINE_DIED = 1


def main(index: int, conns: list[Connection], sock: socket.socket, args: ServeArgs) -> None:
    """The process's target: front end number `index` of a server started with `args` (ServeArgs),
    with a pipe to each engine core in `conns` (several under `--data-parallel-size`)."""
    become_child(FRONTEND_NAME.format(index), args.server.log_level)
    # Told to stop before it serves (while the model loads): nothing to drain. uvicorn installs
    # its own handlers once it serves.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    code = asyncio.run(serve(conns, sock, args, index))
    sys.exit(code)


class EngineNotReady(Exception):
    """The engine core exited, or said it cannot serve, before it was ready."""


def _handshake(index: int, conn: Connection) -> EngineSetup:
    """The engine core's setup (it comes once the model is loaded); raises EngineNotReady."""
    try:
        send(conn, Hello(PROTOCOL_VERSION, index))
        setup = recv(conn)
    except (EOFError, OSError):
        raise EngineNotReady("the engine core exited before it was ready") from None
    if isinstance(setup, Dead) or not isinstance(setup, EngineSetup) or setup.version != PROTOCOL_VERSION:
        raise EngineNotReady(f"the engine core cannot serve: {getattr(setup, 'reason', repr(setup))}")
    return setup


def _prepare(index: int, conns: list[Connection]) -> list[EngineSetup]:
    """In a thread, while the gate answers: the app's imports, then every engine core's setup."""
    from flashserve.entrypoints.run_batch.app import import_tokenizer_classes

    import flashserve.api.server  # noqa: F401  (FastAPI, the app's modules: seconds of imports)

    import_tokenizer_classes()  # while the engine core loads the model
    return [_handshake(index, conn) for conn in conns]


def _in_thread(fn: Any, *args: Any) -> asyncio.Future[Any]:
    """`fn(*args)` in a daemon thread (one blocked on a pipe must not hold the process at exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # handed to the event loop, which decides
            result, error = None, exc
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="flashserve-handshake", daemon=True).start()
    return future


def engine_client(conns: list[Connection], setups: list[EngineSetup], args: ServeArgs) -> Any:
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


async def serve(conns: list[Connection], sock: socket.socket, args: ServeArgs, index: int = 0) -> int:
    import uvicorn

    from flashserve.api.startup import StartupGate
    from flashserve.entrypoints.lifecycle import drain, graceful_server

    gate = StartupGate()
    config = uvicorn.Config(gate, log_level=args.server.log_level, access_log=args.access_log,
                            timeout_graceful_shutdown=5)
    server: Any = None
    ready: dict[str, Any] = {}  # state and engine, once the app serves

    async def on_signal() -> None:
        if not ready:  # still loading: nothing to drain
            server.should_exit = True
            return
        await drain(server, ready["state"], ready["engine"], args.shutdown_timeout)

    server = graceful_server(config, on_signal)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    loading = _in_thread(_prepare, index, conns)
    await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # told to stop while the model loads
        await serving
        return 0
    try:
        setups = loading.result()
    except EngineNotReady as exc:
        logger.error("%s", exc)
        gate.reason = "the model did not load"
        server.should_exit = True
        await serving
        return EXIT_ENGINE_DIED
    return await _serve_app(server, serving, gate, conns, setups, args, ready)


async def _serve_app(server: Any, serving: asyncio.Future[None], gate: Any, conns: list[Connection],
                     setups: list[EngineSetup], args: ServeArgs, ready: dict[str, Any]) -> int:
    """The OpenAI app over the engine cores' setups, behind `gate` from now on, until the server stops."""
    from flashserve.api.options import ServerState
    from flashserve.api.server import build_app
    from flashserve.entrypoints.lifecycle import stop_when_dead
    from flashserve.metrics import Metrics

    setup = setups[0]
    names = list(args.model.served_model_names) or [setup.model_name]
    metrics, state = Metrics(model_name=names[0]), ServerState()
    engine = engine_client(conns, setups, args)
    app = build_app(engine, setup.tokenizer, names, setup.max_model_len, eos_token_ids=setup.eos_token_ids,
                    options=args.api, metrics=metrics, state=state, vocab_size=setup.vocab_size)
    engine.on_dead = stop_when_dead(server, state)
    engine.start()
    ready.update(state=state, engine=engine)
    gate.open(app)
    try:
        await serving
    finally:
        engine.shutdown()
        if app.state.tracer is not None:
            app.state.tracer.shutdown()
    return EXIT_ENGINE_DIED if engine.dead_reason is not None else 0
