"""A real `flashserve serve` process for tests: started on a free port, healthy before use.

Its output goes to a file, never to an unread pipe (whose 64 KiB, once full, would stop every
process of the server at its next log line). A test that fails while a server runs, or after one it
started ended, gets the last lines of that file in its report (`conftest.py`), so that a failure in
CI says what the server did.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx

# The log files of the servers running now (newest last), and the last lines of those that ended
# during the current test (the hook in conftest.py reports and clears them).
RUNNING_LOGS: list[str] = []
ENDED_LOG_TAILS: list[tuple[str, str]] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = 200) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


@contextmanager
def live_server(args: Sequence[str] = (), env: dict[str, str] | None = None,
                timeout_s: float = 240, module: str = "flashserve",
                port: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (base URL, process) once /health answers 200; kills the process on exit if still running.
    `module` is what `python -m` runs: flashserve, or a test wrapper that takes the same arguments.
    `port`: the one to serve on (default: a free one)."""
    port = port or free_port()
    full_env = dict(os.environ, FLASHSERVE_PORT=str(port), FLASHSERVE_LOG_LEVEL="warning", **(env or {}))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, full_env.get("PYTHONPATH")) if p)
    log = tempfile.NamedTemporaryFile("w", prefix=f"flashserve-test-{port}-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", module, "serve", *args], env=full_env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    log.close()  # the server holds it now
    RUNNING_LOGS.append(log.name)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{log_tail(log.name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not become healthy:\n{log_tail(log.name)}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait(30)
        RUNNING_LOGS.remove(log.name)
        ENDED_LOG_TAILS.append((log.name, log_tail(log.name)))
        os.unlink(log.name)
