"""`flashserve serve`'s process supervision: one engine core process and `--api-server-count` front
ends, which share one listening socket (bound here, so they all accept on one port and one queue).

    supervisor (this process: no model, no HTTP)
      |-- flashserve-core   scheduler, KV cache, runner (and tensor-parallel workers under it)
      |-- flashserve-api0   uvicorn + app + EngineCoreClient  --pipe--> flashserve-core
      `-- flashserve-api1 ...

- SIGTERM or SIGINT: passed on to the front ends as SIGTERM (they drain), then the engine core
  stops; exit 0. A second one makes the front ends stop at once.
- The engine core dies (a device error, kill -9): the front ends fail their open requests and exit
  1; so does this process.
- A front end dies: the others go on serving; once none is left, the engine core stops and this
  process exits 1 (0 if they all ended because they were told to).
- This process is killed: the children get SIGTERM from the kernel (PR_SET_PDEATHSIG).
The front ends' and the engine core's metrics meet in one prometheus-client multiprocess
directory, made here and removed at exit, so that every front end's /metrics shows them all.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, Callable

from flashserve.entrypoints import api_server, engine_core

logger = logging.getLogger("flashserve")

EXIT_FAILED = 1
# How long children get to end after being told to, before they are killed.
STOP_SECONDS = 15.0
# After the engine core died: how long the front ends get to fail their requests and exit.
FRONTEND_EXIT_SECONDS = 15.0


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """`load(args)` builds the engine core's parts in its process (a module-level function: it is
    pickled by name): the model's engine for `flashserve serve`, a fake device for benchmarks."""

    def __init__(self, args: Any, load: Callable[[Any], engine_core.CoreParts] = engine_core.load_serve_core) -> None:
        self.args = args
        self.load = load
        self.core: BaseProcess | None = None
        self.front_ends: list[BaseProcess] = []
        self.stopping = False

    def run(self) -> int:
        args = self.args
        count = args.api_server_count
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold a GPU
        sock = listening_socket(args.server.host, args.server.port)
        pipes = [context.Pipe(duplex=True) for _ in range(count)]
        self.core = context.Process(
            target=engine_core.main, name="flashserve-core",
            args=(self.load, args, [a for a, _ in pipes], args.queue_timeout,
                  args.server.log_level))
        self.core.start()
        for i, (_, b) in enumerate(pipes):
            front = context.Process(target=api_server.main, name=f"flashserve-api{i}", args=(i, b, sock, args))
            front.start()
            self.front_ends.append(front)
        for a, b in pipes:  # the children hold them now: a pipe whose far end is gone reads EOF
            a.close()
            b.close()
        sock.close()
        logger.info("engine core process %d; front-end processes %s; listening on %s:%d", self.core.pid,
                    [f.pid for f in self.front_ends], args.server.host, args.server.port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            return self._watch()
        finally:
            self._stop_all()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.info("received %s: stopping the front ends", signal.Signals(signum).name)
        self.stopping = True
        for front in self.front_ends:
            if front.is_alive() and front.pid is not None:
                os.kill(front.pid, signal.SIGTERM)

    def _watch(self) -> int:
        assert self.core is not None
        live = list(self.front_ends)
        while True:
            wait([self.core.sentinel, *(f.sentinel for f in live)])
            if not self.core.is_alive():
                logger.error("the engine core exited with code %s; stopping", self.core.exitcode)
                self._join(live, FRONTEND_EXIT_SECONDS)
                return EXIT_FAILED if self.core.exitcode != 0 or not self.stopping else 0
            for front in [f for f in live if not f.is_alive()]:
                live.remove(front)
                if front.exitcode != 0 or not self.stopping:
                    logger.error("front end %s exited with code %s; %d still serving", front.name,
                                 front.exitcode, len(live))
            if not live:
                ok = self.stopping and all(f.exitcode == 0 for f in self.front_ends)
                return 0 if ok else EXIT_FAILED

    def _join(self, processes: list[BaseProcess], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)

    def _stop_all(self) -> None:
        """Nothing outlives the supervisor: front ends first, then the engine core."""
        for front in self.front_ends:
            if front.is_alive():
                front.terminate()
        self._join(self.front_ends, STOP_SECONDS)
        if self.core is not None:
            if self.core.is_alive():
                self.core.terminate()
            self._join([self.core], STOP_SECONDS)


def is_launched_worker_rank(args: Any) -> bool:
    """Whether a launcher (torchrun) started this process as a tensor-parallel rank other than 0,
    which serves no HTTP: it runs rank 0's steps, here, until rank 0 ends them."""
    if args.model.tensor_parallel_size <= 1 or "WORLD_SIZE" not in os.environ:
        return False
    from flashserve.parallel.executor import launched_rank

    return launched_rank(args.model.tensor_parallel_size) not in (None, 0)


def run(args: Any, load: Callable[[Any], engine_core.CoreParts] = engine_core.load_serve_core) -> int:
    """Serves until shutdown; returns the exit code."""
    if is_launched_worker_rank(args):
        from flashserve.server_stack import load_engine

        load_engine(args)  # runs the rank's steps, then exits 0
        return 0
    metrics_dir = tempfile.mkdtemp(prefix="flashserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the children inherit it
    try:
        return Supervisor(args, load).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
