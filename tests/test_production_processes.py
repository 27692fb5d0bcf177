"""`flashserve serve`'s processes: a supervisor, one engine core, `--api-server-count` front ends on
one port, on a small dummy model. Whatever ends the server, nothing is left behind: no process,
no listening socket, no metrics directory.

One server with two front ends for the first tests (the last of them kills its engine core), and
one more for SIGTERM with streams open.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from live_server import live_server
from production_helpers import metric
from test_production_one_request import dummy_args, model_config  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


@dataclass
class Server:
    url: str
    proc: object
    children: dict[str, int]  # process name (/proc/PID/comm) -> pid
    metrics_dir: str
    port: int = field(init=False)

    def __post_init__(self) -> None:
        self.port = int(self.url.rsplit(":", 1)[1])


def children_of(pid: int) -> dict[str, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[comm] = int(entry.name)
    return found


def serving(proc: object, url: str) -> Server:
    pid = proc.pid  # type: ignore[attr-defined]
    kids = children_of(pid)
    core = kids["flashserve-core"]
    environ = Path(f"/proc/{core}/environ").read_bytes().split(b"\0")
    metrics_dir = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    return Server(url, proc, kids, metrics_dir)


def assert_nothing_left(server: Server) -> None:
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in server.children.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [name for name, pid in server.children.items() if Path(f"/proc/{pid}").exists()
             and "zombie" not in Path(f"/proc/{pid}/status").read_text()]
    assert not alive, f"left running: {alive}"
    assert not os.path.exists(server.metrics_dir)
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", server.port))


@pytest.fixture(scope="module")
def two_front_ends(model_config: str) -> Iterator[Server]:
    # At info, what each process did is in the report of a test that fails (conftest.py).
    with live_server(dummy_args(model_config, "--api-server-count", "2", "--log-level", "info")) as (url, proc):
        yield serving(proc, url)


def complete(url: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def finished_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("flashserve_requests_finished_total"))


def test_the_engine_core_and_each_front_end_run_in_processes_of_their_own(two_front_ends: Server) -> None:
    assert set(two_front_ends.children) >= {"flashserve-core", "flashserve-api0", "flashserve-api1"}


IDLE_GAUGES = ("flashserve_num_requests_running", "flashserve_num_requests_waiting", "flashserve_kv_pages_used",
               "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:gpu_cache_usage_perc")


def idle_gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {name: metric(text, name) for name in (*IDLE_GAUGES, "flashserve_kv_pages_free")}


def test_every_engine_gauge_is_on_a_fresh_servers_metrics_page_at_its_true_value(two_front_ends: Server) -> None:
    gauges = idle_gauges(two_front_ends.url)  # no request yet (routers and autoscalers poll from the start)
    assert {name: gauges[name] for name in IDLE_GAUGES} == dict.fromkeys(IDLE_GAUGES, 0)
    assert gauges["flashserve_kv_pages_free"] > 0


def test_the_engine_gauges_return_to_zero_once_the_server_is_idle_again(two_front_ends: Server) -> None:
    threads = [threading.Thread(target=complete, args=(two_front_ends.url,), kwargs={"max_tokens": 20})
               for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert finished_requests(two_front_ends.url) >= 6
    gauges = idle_gauges(two_front_ends.url)
    assert {name: gauges[name] for name in IDLE_GAUGES} == dict.fromkeys(IDLE_GAUGES, 0)


def test_one_metrics_page_adds_up_every_front_end_and_the_engine(two_front_ends: Server) -> None:
    before = finished_requests(two_front_ends.url)
    for _ in range(8):  # each on a new connection, so both front ends take some
        assert complete(two_front_ends.url).status_code == 200
    text = httpx.get(f"{two_front_ends.url}/metrics", timeout=10).text
    assert finished_requests(two_front_ends.url) == before + 8
    generated = [line for line in text.splitlines() if line.startswith("flashserve_generation_tokens_total")]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) >= 24  # the engine core's counter


def sockets_on_port(pid: int, port: int, state: str) -> set[str]:
    """The inodes of the TCP sockets on local `port` that process `pid` holds, in `state`
    ("0A": listening, "01": established), from /proc."""
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            held.add(target[len("socket:["):-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state and fields[9] in held:
                found.add(fields[9])
    return found


def front_end_pids(server: Server) -> list[int]:
    return [server.children[f"flashserve-api{i}"] for i in range(2)]


def test_each_front_end_listens_on_a_socket_of_its_own_on_the_one_port(two_front_ends: Server) -> None:
    listening = [sockets_on_port(pid, two_front_ends.port, "0A") for pid in front_end_pids(two_front_ends)]
    assert all(len(inodes) == 1 for inodes in listening) and listening[0] != listening[1], listening


def test_sixty_four_concurrent_clients_are_spread_over_every_front_end(two_front_ends: Server) -> None:
    clients: list[socket.socket] = []
    barrier = threading.Barrier(64)

    def connect() -> None:
        barrier.wait()
        clients.append(socket.create_connection(("127.0.0.1", two_front_ends.port), timeout=10))

    try:
        threads = [threading.Thread(target=connect) for _ in range(64)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        deadline = time.monotonic() + 10
        while sum(held := [len(sockets_on_port(pid, two_front_ends.port, "01"))
                           for pid in front_end_pids(two_front_ends)]) < 64:
            assert time.monotonic() < deadline, f"accepted {held} of 64"
            time.sleep(0.05)
    finally:
        for client in clients:
            client.close()
    # The kernel spreads connections by a hash: each front end gets half, give or take (fewer
    # than 16 of 64 on either happens about once in 40,000 runs).
    assert min(held) >= 16, f"connections per front end: {held}"


def test_killing_one_front_end_leaves_the_other_serving(two_front_ends: Server) -> None:
    os.kill(two_front_ends.children["flashserve-api1"], signal.SIGKILL)
    time.sleep(0.5)
    for _ in range(4):
        r = complete(two_front_ends.url)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert two_front_ends.proc.poll() is None  # type: ignore[attr-defined]


def test_killing_the_engine_core_fails_open_requests_and_exits_non_zero_leaving_nothing(two_front_ends: Server) -> None:
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{two_front_ends.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    os.kill(two_front_ends.children["flashserve-core"], signal.SIGKILL)
    reader.join(30)
    code = two_front_ends.proc.wait(60)  # type: ignore[attr-defined]
    assert code != 0
    assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][len("data: "):])
    assert_nothing_left(two_front_ends)


def test_sigterm_with_streams_open_drains_both_front_ends_and_leaves_nothing(model_config: str) -> None:
    env = {"FLASHSERVE_SHUTDOWN_TIMEOUT": "120"}
    with live_server(dummy_args(model_config, "--api-server-count", "2"), env=env) as (url, proc):
        server = serving(proc, url)
        results: list[list[str]] = []
        opened = threading.Semaphore(0)

        def stream() -> None:
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 30, "ignore_eos": True, "stream": True}
            events: list[str] = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not events:
                            opened.release()
                        events.append(line)
            results.append(events)

        readers = [threading.Thread(target=stream) for _ in range(4)]
        for reader in readers:
            reader.start()
        for _ in readers:
            assert opened.acquire(timeout=60)
        proc.send_signal(signal.SIGTERM)
        for reader in readers:
            reader.join(120)
        assert proc.wait(60) == 0
    assert len(results) == 4
    for events in results:  # every stream ran to its end
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert_nothing_left(server)


def test_a_start_removes_the_metrics_directories_of_supervisors_no_longer_running(tmp_path: Path) -> None:
    import subprocess
    import sys

    from flashserve.entrypoints.serve import remove_stale_metrics_dirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"flashserve-metrics-{int(gone.stdout)}-abc"  # a supervisor killed with -9
    running = tmp_path / f"flashserve-metrics-{os.getpid()}-def"
    other = tmp_path / "flashserve-metrics-notapid-x"
    for folder in (stale, running, other):
        folder.mkdir()
        (folder / "counter_1.db").write_bytes(b"")
    assert remove_stale_metrics_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and running.exists() and other.exists()


def test_the_front_ends_sockets_refuse_a_port_that_another_server_listens_on() -> None:
    from flashserve.entrypoints.serve import listening_sockets

    first = listening_sockets("127.0.0.1", 0, 2)  # a server with two front ends
    try:
        with pytest.raises(OSError):
            listening_sockets("127.0.0.1", first[0].getsockname()[1], 2)
    finally:
        for sock in first:
            sock.close()


def test_a_server_stopped_by_sigterm_logs_no_error(model_config: str) -> None:
    from live_server import RUNNING_LOGS

    with live_server(dummy_args(model_config, "--log-level", "info")) as (_, proc):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        lines = Path(RUNNING_LOGS[-1]).read_text().splitlines()
    assert any("received SIGTERM" in line for line in lines), lines[-20:]
    assert not [line for line in lines if "ERROR" in line], lines[-20:]
