"""A real `flashserve serve` process for tests: started on a free port, healthy before use."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(args: Sequence[str] = (), env: dict[str, str] | None = None,
                timeout_s: float = 240, module: str = "flashserve") -> Iterator[tuple[str, subprocess.Popen]]:
    """Yields (base URL, process) once /health answers 200; kills the process on exit if still running.
    `module` is what `python -m` runs: flashserve, or a test wrapper that takes the same arguments."""
    port = free_port()
    full_env = dict(os.environ, FLASHSERVE_PORT=str(port), FLASHSERVE_LOG_LEVEL="warning", **(env or {}))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, full_env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", module, "serve", *args], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{proc.stdout.read()}")  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy")
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
