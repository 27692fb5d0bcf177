"""Starts tensor-parallel ranks as child processes on one node, and fails fast when one dies.

A rank that dies (an exception, a CUDA error, the OOM killer) leaves its peers blocked in a
collective until its timeout; the process that started the ranks must not wait that long.
`RankProcesses.join` and `check` watch every child's sentinel, and at the first abnormal exit
kill the others and raise `RankFailed`. Children are started with `spawn` (CUDA cannot be
used in a forked child) and with the env:// variables of their rank, so that
`comm.init_tp_group` in the child joins the group exactly as under torchrun. A child whose
parent dies (killed, so that nothing ran to stop its ranks) exits within about a second.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterable, Mapping, NoReturn

from flashserve.distributed.comm import disable_multicast

# Seconds to wait for a killed child to be reaped.
_REAP_TIMEOUT = 10.0
# Seconds between a child's checks that its parent is alive.
_PARENT_POLL = 0.5


class RankFailed(RuntimeError):
    """A rank process exited abnormally; the other ranks were killed."""

    def __init__(self, exits: Mapping[int, int]) -> None:
        self.exits = dict(exits)
        super().__init__("; ".join(f"rank {rank} {_describe(code)}" for rank, code in sorted(exits.items())))


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the rendezvous binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """torchrun's variables for one rank on a single node, with NVLink multicast off."""
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }
    disable_multicast(env)
    return env


def _exit_with_parent(parent_pid: int) -> None:
    # Reparenting (to init or a subreaper) changes the parent pid: the parent is gone.
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL)
    os._exit(1)


def exit_now(code: int) -> NoReturn:
    """Ends a process of flashserve's (an engine core, a rank) once it has closed what it holds:
    logs and standard streams flushed, then `os._exit`, without the interpreter's finalization.
    There the last references to C++ objects go in no set order, and threads of theirs (gloo's,
    under tensor parallelism on a CPU) that still want the GIL are stopped in a way C++ cannot
    unwind: the process aborts with "terminate called without an active exception" (exit -6).
    A server of two ranks over gloo, stopped by SIGTERM, exited 1 for it in about one stop in five."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write there
            pass
    os._exit(code)


def _rank_entry(env: dict[str, str], target: Callable[..., Any], args: tuple[Any, ...], parent_pid: int) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    os.environ.update(env)
    target(*args)
    exit_now(0)  # an exception instead ends the process as any spawned child's does (a traceback, exit 1)


class RankProcesses:
    """Child processes running `target(*args)`, one per rank, each with its rank's environment.

    Use as a context manager: leaving the block kills whatever still runs.
    """

    def __init__(self, processes: Mapping[int, BaseProcess]) -> None:
        self.processes = dict(processes)

    @classmethod
    def start(
        cls,
        target: Callable[..., Any],
        args: tuple[Any, ...] = (),
        *,
        world_size: int,
        ranks: Iterable[int] | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
    ) -> RankProcesses:
        """Starts `ranks` (default: all of 0..world_size-1) of a group; the caller may be rank 0.

        target and args must be picklable (a module-level function): children are spawned.
        """
        port = master_port if master_port is not None else free_port(master_addr)
        # Also in this process: the children's interpreters start with these set, and the caller
        # is usually a rank as well.
        disable_multicast(os.environ)
        ctx = mp.get_context("spawn")
        processes: dict[int, BaseProcess] = {}
        try:
            for rank in ranks if ranks is not None else range(world_size):
                env = rank_env(rank, world_size, master_addr, port)
                entry_args = (env, target, args, os.getpid())
                p = ctx.Process(target=_rank_entry, args=entry_args, name=f"flashserve-rank-{rank}", daemon=True)
                p.start()
                processes[rank] = p
        except BaseException:
            cls(processes).kill()
            raise
        return cls(processes)

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def join(self, timeout: float) -> None:
        """Waits until every rank has exited with status 0.

        Raises RankFailed at the first abnormal exit and TimeoutError after `timeout` seconds,
        in both cases after killing the ranks still running.
        """
        deadline = time.monotonic() + timeout
        pending = dict(self.processes)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise TimeoutError(f"ranks {sorted(pending)} still running after {timeout:.0f} s")
            ready = set(wait([p.sentinel for p in pending.values()], timeout=remaining))
            for rank, p in list(pending.items()):
                if p.sentinel in ready:
                    p.join()
                    del pending[rank]
            self.check()

    def check(self) -> None:
        """Raises RankFailed (after killing the others) if any rank has exited abnormally."""
        failed = {r: p.exitcode for r, p in self.processes.items() if p.exitcode not in (None, 0)}
        if failed:
            self.kill()
            raise RankFailed(failed)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILLs every rank still running and reaps them all."""
        for p in self.processes.values():
            if p.exitcode is None:
                p.kill()
        for p in self.processes.values():
            p.join(_REAP_TIMEOUT)
