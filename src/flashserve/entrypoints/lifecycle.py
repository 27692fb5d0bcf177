"""A front-end process's rules for its life (`entrypoints/api_server.py` follows them).

Shutdown on SIGTERM (or Ctrl+C) is graceful: the server keeps listening but answers new requests
with 503, lets the running ones finish for up to `--shutdown-timeout` seconds, ends the rest with
an error, then stops and exits 0. A second signal stops at once.

If the engine core dies (a CUDA error poisons the process; nothing more can run on it), every open
request ends with an error, the server stops and the process exits 1, so that its supervisor
(Docker's restart policy, systemd, Kubernetes) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any, Awaitable, Callable


logger = logging.getLogger("flashserve")

# After aborting what outlived the shutdown timeout: how long its error events get to go out.
ABORT_GRACE_SECONDS = 5.0
# After the engine loop died: how long open requests get to receive their errors before the server
# stops, and how long stopping may take before the process exits anyway.
DEATH_GRACE_SECONDS = 1.0
DEATH_EXIT_SECONDS = 10.0
EXIT_ENGINE_DIED = 1


def graceful_server(config: Any, drain: Callable[[], Awaitable[None]]) -> Any:
    """A uvicorn.Server whose first SIGTERM/SIGINT runs `drain()` (which then sets should_exit)
    instead of closing the listening socket at once; uvicorn is imported only here."""
    import uvicorn

    class _GracefulServer(uvicorn.Server):
        def __init__(self) -> None:
            super().__init__(config)
            self._loop: asyncio.AbstractEventLoop | None = None
            self._draining = False

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the
            # process would die of it instead of exiting 0.
            if self._draining or self._loop is None or not self.started:
                self.force_exit = self._draining
                self.should_exit = True
                return
            self._draining = True
            self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

        def _start_drain(self, name: str) -> None:
            logger.info("received %s: draining", name)
            self._drain_task = asyncio.ensure_future(drain())  # keep a reference: tasks are weak

    return _GracefulServer()


async def drain(server: Any, state: Any, engine: Any, timeout: float) -> None:
    """Refuse new requests, wait up to `timeout` s for the running ones, abort the rest, stop."""
    state.draining = True
    logger.info("refusing new requests; waiting up to %.0f s for %d running", timeout, state.in_flight)
    if not await state.wait_idle(timeout):
        logger.warning("shutdown timeout: ending %d requests with an error", state.in_flight)
        engine.abort_all("the server is shutting down")
        await state.wait_idle(ABORT_GRACE_SECONDS)
    server.should_exit = True


def stop_when_dead(server: Any, state: Any) -> Callable[[str], None]:
    """The engine's `on_dead`: refuse new requests, stop the server after a grace period, and make
    sure the process ends even if stopping hangs on a poisoned device."""

    def on_dead(reason: str) -> None:
        logger.error("the engine loop died; stopping the server with exit code %d", EXIT_ENGINE_DIED)
        state.draining = True
        asyncio.get_running_loop().call_later(DEATH_GRACE_SECONDS, setattr, server, "should_exit", True)
        timer = threading.Timer(DEATH_GRACE_SECONDS + DEATH_EXIT_SECONDS, os._exit, (EXIT_ENGINE_DIED,))
        timer.daemon = True
        timer.start()

    return on_dead
