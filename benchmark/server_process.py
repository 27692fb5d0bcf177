"""A flashserve server as a subprocess for the suite: start, wait for /health, warm up, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, deadline: float) -> str | None:
    """Wait for /health to answer 200: None then, else why not. `deadline`: time.monotonic()."""
    import httpx

    while True:
        if proc.poll() is not None:
            return f"server exited with {proc.returncode} (see its log)"
        if time.monotonic() > deadline:
            return "not healthy before the cap"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def wait_ready(proc: subprocess.Popen, base: str, deadline: float, vocab_size: int) -> str | None:
    """Wait for /health, then send warm-up requests (short, one long prefill, 8 at once) so that the
    FlashInfer kernels a workload needs are built here, not in its timed run. None once ready, else
    why not. `deadline` is a time.monotonic() value."""
    import httpx

    failure = wait_healthy(proc, base, deadline)
    if failure is not None:
        return failure
    try:
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        high = min(vocab_size, 10_000)

        def complete(n_in: int, n_out: int) -> None:
            body = {"model": model, "prompt": [100 + i % (high - 100) for i in range(n_in)], "max_tokens": n_out,
                    "temperature": 0, "ignore_eos": True}
            timeout = max(deadline - time.monotonic(), 1.0)
            httpx.post(f"{base}/v1/completions", json=body, timeout=timeout).raise_for_status()

        complete(16, 4)
        complete(2048, 4)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: complete(32, 16), range(8)))
    except Exception as exc:  # noqa: BLE001 - reported as the start step's failure
        return f"warm-up failed: {type(exc).__name__}: {exc}"[:300]
    return None


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGINT (uvicorn's graceful shutdown), then SIGKILL to the server's own session after `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session: only the server's processes
            proc.wait()
