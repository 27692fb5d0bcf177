"""`flashserve serve`'s process supervision: one engine core process and `--api-server-count` front
ends, all accepting on one port. Each front end has a listening socket of its own on that port
(SO_REUSEPORT, bound here), and the kernel spreads new connections over them evenly; one shared
socket would leave it to whichever front end wakes first, which on a busy host may take them all.

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
- `--data-parallel-size N`: N engine cores (flashserve-dp0 ...), each on GPUs of its own
  (`CUDA_VISIBLE_DEVICES`: core i gets [i*tp, (i+1)*tp) of the visible ones), each front end with
  a pipe to every one and a router that picks one per request (`client/router.py`). One engine
  core that dies takes the server down, as the one engine core does.
The front ends' and the engine core's metrics meet in one prometheus-client multiprocess
directory, made here and removed at exit, so that every front end's /metrics shows them all.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Callable

from flashserve.api.response_store import SharedResponseStore
from flashserve.entrypoints import api_server, core_process
from flashserve.entrypoints.processes import DP_ENGINE_CORE_NAME, ENGINE_CORE_NAME

if TYPE_CHECKING:
    from flashserve.serve_args import ServeArgs

logger = logging.getLogger("flashserve")

EXIT_FAILED = 1
# How long children get to end after being told to, before they are killed.
STOP_SECONDS = 15.0
# After the engine core died: how long the front ends get to fail their requests and exit.
FRONTEND_EXIT_SECONDS = 15.0


def bound_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of
    # a socket that says it is TCP. With it on, every response write after the first of a
    # keep-alive connection waited for the client's delayed ACK: 40 ms on each request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    sock = bound_socket(host, port, reuse_port)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One listening socket per front end, all on `host:port` (port 0: one free port for all).
    On Linux they are SO_REUSEPORT sockets, over which the kernel balances new connections (by a
    hash of each connection's addresses); elsewhere, or with one front end, one socket that every
    front end shares. A port already taken is an error (OSError), as with one socket: a second
    server started on it does not quietly share its connections."""
    if count == 1 or not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        return [listening_socket(host, port)] * count
    with bound_socket(host, port) as probe:  # fails if the port is taken, even by SO_REUSEPORT sockets
        port = probe.getsockname()[1]
    return [listening_socket(host, port, reuse_port=True) for _ in range(count)]


class Supervisor:
    """`load(args)` builds the engine core's parts in its process (a module-level function: it is
    pickled by name): the model's engine for `flashserve serve`, a fake device for benchmarks."""

    def __init__(self, args: ServeArgs, load: Callable[[ServeArgs], core_process.CoreParts] = core_process.load_serve_core) -> None:
        self.args = args
        self.load = load
        self.cores: list[BaseProcess] = []  # one per --data-parallel-size
        self.front_ends: list[BaseProcess] = []
        self.stopping = False

    def run(self) -> int:
        args = self.args
        count, num_cores = args.api_server_count, args.data_parallel_size
        devices = core_devices(num_cores, args.model.tensor_parallel_size, args.model.device)
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold a GPU
        socks = listening_sockets(args.server.host, args.server.port, count)
        # pipes[e][f]: between engine core e and front end f.
        pipes = [[context.Pipe(duplex=True) for _ in range(count)] for _ in range(num_cores)]
        for e, row in enumerate(pipes):
            name = ENGINE_CORE_NAME if num_cores == 1 else DP_ENGINE_CORE_NAME.format(e)
            core = context.Process(
                target=core_process.main, name=name,
                args=(self.load, args, [a for a, _ in row], args.queue_timeout, args.server.log_level, e, name))
            with visible_devices(devices[e] if devices else None):  # a spawned child takes this environment
                core.start()
            self.cores.append(core)
        for i in range(count):
            front = context.Process(target=api_server.main, name=f"flashserve-api{i}",
                                    args=(i, [row[i][1] for row in pipes], socks[i], args))
            front.start()
            self.front_ends.append(front)
        for a, b in (pipe for row in pipes for pipe in row):  # the children hold them now: a pipe
            a.close()  # whose far end is gone reads EOF
            b.close()
        for sock in set(socks):  # the front ends hold them now
            sock.close()
        logger.info("engine core processes %s%s; front-end processes %s; listening on %s:%d",
                    [c.pid for c in self.cores], f" on GPUs {devices}" if devices else "",
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
        live = list(self.front_ends)
        while True:
            wait([*(c.sentinel for c in self.cores), *(f.sentinel for f in live)])
            gone = [c for c in self.cores if not c.is_alive()]
            if gone:  # one engine core is gone: the server with it (the front ends fail and exit)
                if self.stopping and gone[0].exitcode == 0:  # its front ends stopped first, as asked
                    logger.info("engine core %s exited after its front ends", gone[0].name)
                else:
                    logger.error("engine core %s exited with code %s; stopping", gone[0].name, gone[0].exitcode)
                self._join(live, FRONTEND_EXIT_SECONDS)
                return EXIT_FAILED if gone[0].exitcode != 0 or not self.stopping else 0
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
        for core in self.cores:
            if core.is_alive():
                core.terminate()
        self._join(self.cores, STOP_SECONDS)


def core_devices(num_cores: int, tp: int, device: str) -> list[str] | None:
    """The CUDA devices of each engine core (`CUDA_VISIBLE_DEVICES` values): core i takes GPUs
    [i*tp, (i+1)*tp) of those visible. None with one engine core, on the CPU, or on a machine
    without NVIDIA GPUs (the cores run on the CPU then, as one would)."""
    if num_cores == 1 or device == "cpu":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        # CUDA numbers the GPUs it sees 0..n-1, whatever the device nodes' numbers (a container
        # may hold /dev/nvidia3 and /dev/nvidia5 only).
        gpus = [str(i) for i in range(len(list(Path("/dev").glob("nvidia[0-9]*"))))]
    if not gpus and device == "auto":
        return None
    needed = num_cores * tp
    if len(gpus) < needed:
        raise SystemExit(f"--data-parallel-size {num_cores} x --tensor-parallel-size {tp} needs {needed} GPUs; "
                         f"{len(gpus)} visible")
    return [",".join(gpus[i * tp:(i + 1) * tp]) for i in range(num_cores)]


@contextmanager
def visible_devices(devices: str | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to `devices` (unless None) for the processes started meanwhile."""
    if devices is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def is_launched_worker_rank(args: ServeArgs) -> bool:
    """Whether a launcher (torchrun) started this process as a tensor-parallel rank other than 0,
    which serves no HTTP: it runs rank 0's steps, here, until rank 0 ends them."""
    if args.model.tensor_parallel_size <= 1 or "WORLD_SIZE" not in os.environ:
        return False
    from flashserve.executor.tensor_parallel import launched_rank

    return launched_rank(args.model.tensor_parallel_size) not in (None, 0)


METRICS_DIR_PREFIX = "flashserve-metrics-"


def remove_stale_metrics_dirs(parent: str) -> list[str]:
    """Removes the metrics directories of supervisors that no longer run (killed with -9, they could
    not clean up): `flashserve-metrics-<pid>-*` whose pid is gone. Returns what it removed."""
    removed = []
    for entry in Path(parent).glob(f"{METRICS_DIR_PREFIX}*-*"):
        pid = entry.name[len(METRICS_DIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not entry.is_dir() or _alive(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(str(entry))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: it runs, as someone else's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def run(args: ServeArgs, load: Callable[[ServeArgs], core_process.CoreParts] = core_process.load_serve_core) -> int:
    """Serves until shutdown; returns the exit code."""
    if is_launched_worker_rank(args):
        from flashserve.entrypoints.stack import load_engine
        from flashserve.executor.launch import exit_now

        load_engine(args)  # runs the rank's steps until rank 0 ends them
        exit_now(0)
    from flashserve.tracing import check_tracing

    try:
        check_tracing(args.api.otlp_traces_endpoint, os.environ)
    except ValueError as exc:
        raise SystemExit(f"flashserve: {exc}") from None
    remove_stale_metrics_dirs(tempfile.gettempdir())
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the children inherit it
    # Stored responses in a file every front end opens (prometheus reads only the *.db files here),
    # made before they start.
    store_path = os.path.join(metrics_dir, "responses.sqlite3")
    SharedResponseStore.create(store_path)
    args = dataclasses.replace(args, api=dataclasses.replace(args.api, responses_store_path=store_path))
    try:
        return Supervisor(args, load).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def main(args: ServeArgs) -> int:
    """`flashserve serve`: logging as `--log-level` says, then `run`."""
    logging.basicConfig(level=args.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)
