"""The real server process on the embedded SmolLM2: a locust run, then SIGTERM during streams.

One server for the module. The SIGTERM test ends it, so it comes last.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from live_server import live_server
from production_helpers import metric

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SHUTDOWN_TIMEOUT = 6.0


@dataclass
class Server:
    url: str
    proc: subprocess.Popen

    def metric(self, name: str) -> float:
        return metric(httpx.get(f"{self.url}/metrics", timeout=10).text, name)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with live_server(env={"FLASHSERVE_SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT)}) as (url, proc):
        yield Server(url, proc)


def test_a_one_minute_locust_run_of_twenty_users_has_no_failures_and_frees_every_page(server: Server) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "stress_test.py"), "--host", server.url, "-u", "20", "-r", "10", "-t", "60s"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    assert "failures: 0\n" in report and "KV pages at the end: 0.0 used" in report, report
    served = int(report.split("requests served: ")[1].split()[0])
    assert served > 50, report
    assert server.metric("flashserve_kv_pages_used") == 0
    assert server.metric("flashserve_num_requests_running") == server.metric("flashserve_num_requests_waiting") == 0


@dataclass
class StreamLog:
    events: list = field(default_factory=list)
    first_chunk: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0
    error: BaseException | None = None


def stream_into(url: str, max_tokens: int, log: StreamLog) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    log.events.append(payload if payload == "[DONE]" else json.loads(payload))
                    log.first_chunk.set()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        log.error = exc
    finally:
        log.ended_at = time.monotonic()
        log.first_chunk.set()


def test_sigterm_lets_short_streams_finish_ends_long_ones_refuses_new_requests_and_exits_zero(
    server: Server,
) -> None:
    short, long = [StreamLog() for _ in range(2)], [StreamLog() for _ in range(3)]
    threads = [threading.Thread(target=stream_into, args=(server.url, 8, log)) for log in short]
    threads += [threading.Thread(target=stream_into, args=(server.url, 4000, log)) for log in long]
    for t in threads:
        t.start()
    for log in short + long:
        assert log.first_chunk.wait(60) and log.error is None and log.events, log.error

    server.proc.send_signal(signal.SIGTERM)
    sigterm_at = time.monotonic()
    time.sleep(0.5)
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    health = httpx.get(f"{server.url}/health", timeout=10)
    exit_code = server.proc.wait(SHUTDOWN_TIMEOUT + 30)
    for t in threads:
        t.join(10)

    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503
    assert exit_code == 0
    for log in short:  # finished normally, well before the deadline
        assert log.error is None and log.events[-1] == "[DONE]"
        assert log.events[-2]["choices"][0]["finish_reason"] == "length"
        assert log.ended_at - sigterm_at < SHUTDOWN_TIMEOUT
    for log in long:  # cut at the deadline with an error event, then [DONE]
        assert log.error is None and log.events[-1] == "[DONE]"
        assert log.events[-2]["error"]["message"] == "the server is shutting down"
        assert log.ended_at - sigterm_at >= SHUTDOWN_TIMEOUT - 0.5
