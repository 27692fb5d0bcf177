"""`--data-parallel-size 2` on the CPU: two engine cores behind one front end, on a small dummy
model. Requests spread over both; requests sharing a prefix go to one; each engine's pages come
back; one engine core killed takes the server down, leaving nothing behind. The router's rules are
tested on their own first, without processes."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest

from flashserve.client.router import BALANCE_SLACK, PrefixRouter
from flashserve.entrypoints.serve import core_devices
from kv_event_subscriber import Subscriber, documented_hash
from live_server import free_port, live_server
from production_helpers import metric
from test_production_one_request import dummy_args, model_config  # noqa: F401  (a fixture)
from test_production_processes import Server, assert_nothing_left, children_of

PAGE = 16
PREFIX = list(range(10, 10 + 4 * PAGE))  # four full pages


# ---- the router ----------------------------------------------------------------------------------
def test_requests_without_a_shared_prefix_alternate_between_idle_engines() -> None:
    router = PrefixRouter(2, PAGE)
    assert [router.choose([i, i + 1, i + 2], None, [0, 0]) for i in range(4)] == [0, 1, 0, 1]


def test_a_request_goes_to_the_engine_that_has_its_prefix() -> None:
    router = PrefixRouter(2, PAGE)
    first = router.choose(PREFIX + [1], None, [0, 0])
    assert all(router.choose(PREFIX + [i], None, [0, 0]) == first for i in range(2, 6))


def test_among_equal_prefixes_the_least_loaded_engine_wins() -> None:
    router = PrefixRouter(3, PAGE)
    assert router.choose([1, 2, 3], None, [4, 1, 2]) == 1


def test_a_prefix_does_not_pull_requests_past_the_balance_slack() -> None:
    router = PrefixRouter(2, PAGE)
    first = router.choose(PREFIX, None, [0, 0])
    loads = [0, 0]
    loads[first] = BALANCE_SLACK + 1
    assert router.choose(PREFIX + [1], None, loads) == 1 - first


def test_a_prefix_does_not_pull_a_request_onto_an_engine_with_no_free_slot() -> None:
    router = PrefixRouter(2, PAGE, slots=4)
    first = router.choose(PREFIX, None, [0, 0])
    loads = [0, 0]
    loads[first], loads[1 - first] = 4, 2  # within the slack, but the prefix's engine would queue it
    assert router.choose(PREFIX + [1], None, loads) == 1 - first


def test_when_every_engine_is_full_the_prefix_counts_again() -> None:
    router = PrefixRouter(2, PAGE, slots=4)
    first = router.choose(PREFIX, None, [0, 0])
    loads = [0, 0]
    loads[first], loads[1 - first] = 6, 5
    assert router.choose(PREFIX + [1], None, loads) == first


def test_a_burst_of_shared_prefix_groups_fills_both_engines_slots_evenly() -> None:
    # 32 groups x 16 prompts arriving at once in a random order onto two engines of 256 slots: without
    # the slot rule this order put 271 requests on one engine, so 15 waited for a whole round of decoding.
    router = PrefixRouter(2, PAGE, slots=256)
    arrivals = [(group, member) for group in range(32) for member in range(16)]
    random.Random(5).shuffle(arrivals)
    loads, engines_of_group = [0, 0], [set() for _ in range(32)]
    for group, member in arrivals:
        engine = router.choose([1000 + group] * (8 * PAGE) + [member], None, loads)
        loads[engine] += 1
        engines_of_group[group].add(engine)
    assert loads == [256, 256]
    assert sum(len(engines) == 1 for engines in engines_of_group) >= 16  # most groups stay whole


def test_a_different_cache_salt_is_a_different_prefix() -> None:
    router = PrefixRouter(2, PAGE)
    first = router.choose(PREFIX, "alice", [0, 0])
    assert router.choose(PREFIX, "bob", [0, 0]) == 1 - first


def test_load_routing_ignores_prefixes() -> None:
    router = PrefixRouter(2, PAGE, prefix_routing=False)
    assert [router.choose(PREFIX, None, [0, 0]) for _ in range(4)] == [0, 1, 0, 1]


def test_the_record_of_an_engine_forgets_its_oldest_pages() -> None:
    router = PrefixRouter(1, PAGE, record_pages=4)
    router.choose(PREFIX, None, [0])
    router.choose(list(range(500, 500 + 2 * PAGE)), None, [0])
    hashes: list[bytes] = []
    router._hasher.extend(hashes, PREFIX)
    assert router.matched_pages(0, hashes) == 0  # its first two pages went first


def test_each_front_end_counts_on_its_share_of_the_slots_the_engine_cores_resolved() -> None:
    # --max-num-seqs left to the device: an engine core on a large GPU reports 1,024 in its setup.
    from multiprocessing import Pipe
    from types import SimpleNamespace

    from flashserve.message.codec import PROTOCOL_VERSION, EngineSetup
    from flashserve.entrypoints.api_server import engine_client

    pipes = [Pipe() for _ in range(2)]
    setup = EngineSetup(PROTOCOL_VERSION, None, "m", 512, (), 512, max_num_seqs=1024)
    args = SimpleNamespace(max_waiting=None, api_server_count=2, cache=SimpleNamespace(page_size=PAGE),
                           data_parallel_routing="prefix", scheduler=SimpleNamespace(max_num_seqs=None))
    try:
        assert engine_client([a for a, _ in pipes], [setup, setup], args).router.slots == 512
    finally:
        for a, b in pipes:
            a.close()
            b.close()


# ---- GPUs per engine core ------------------------------------------------------------------------
def test_each_engine_core_gets_its_own_tensor_parallel_group_of_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert core_devices(2, 2, "auto") == ["4,5", "6,7"]
    assert core_devices(2, 1, "cuda") == ["4", "5"]
    assert core_devices(2, 1, "cpu") is None and core_devices(1, 4, "auto") is None


def test_too_few_gpus_for_the_engine_cores_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(SystemExit, match="needs 4 GPUs"):
        core_devices(2, 2, "cuda")


# ---- a server with two engine cores --------------------------------------------------------------
# Its engine cores publish KV cache events: engine core r on these ports plus r.
EVENT_PORT, REPLAY_PORT = free_port(), free_port()


@pytest.fixture(scope="module")
def two_engines(model_config: str) -> Iterator[Server]:
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{EVENT_PORT}",
                         "replay_endpoint": f"tcp://*:{REPLAY_PORT}"})
    args = dummy_args(model_config, "--data-parallel-size", "2", "--page-size", str(PAGE), "--kv-events-config", events)
    with live_server(args) as (url, proc):
        kids = children_of(proc.pid)
        environ = open(f"/proc/{kids['flashserve-dp0']}/environ", "rb").read().split(b"\0")
        metrics_dir = next(v.split(b"=", 1)[1].decode() for v in environ
                           if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
        yield Server(url, proc, kids, metrics_dir)


def complete(url: str, prompt: list[int], max_tokens: int = 3, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def per_engine(url: str, name: str) -> list[float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [metric(text, name, engine=str(e)) for e in range(2)]


def test_two_engine_cores_run_in_processes_of_their_own(two_engines: Server) -> None:
    assert {"flashserve-dp0", "flashserve-dp1", "flashserve-api0"} <= set(two_engines.children)


def test_requests_spread_over_both_engines(two_engines: Server) -> None:
    before = per_engine(two_engines.url, "flashserve_generation_tokens_total")
    for i in range(6):
        complete(two_engines.url, [100 + i, 3, 4])
    after = per_engine(two_engines.url, "flashserve_generation_tokens_total")
    assert [a - b for a, b in zip(after, before)] == [9, 9]


def test_requests_sharing_a_prefix_go_to_one_engine(two_engines: Server) -> None:
    before = per_engine(two_engines.url, "flashserve_generation_tokens_total")
    for i in range(6):
        complete(two_engines.url, [7, *PREFIX, 200 + i])
    grew = [a - b for a, b in zip(per_engine(two_engines.url, "flashserve_generation_tokens_total"), before)]
    assert sorted(grew) == [0, 18]
    hits = per_engine(two_engines.url, "flashserve_prefix_cache_hits_total")
    assert hits[grew.index(18)] >= 5 * len(PREFIX)  # the later five found the prefix cached there


def test_each_engine_core_publishes_its_cached_pages_on_its_own_port(two_engines: Server) -> None:
    prompts = [([50 + i] * (3 * PAGE), None) for i in range(4)] + [([50] * (3 * PAGE), "tenant")]
    for prompt, salt in prompts:
        complete(two_engines.url, prompt, max_tokens=1, **({"cache_salt": salt} if salt else {}))
    subscribers = [Subscriber(f"tcp://127.0.0.1:{EVENT_PORT + r}", f"tcp://127.0.0.1:{REPLAY_PORT + r}")
                   for r in range(2)]
    for sub in subscribers:
        sub.request_replay()  # every batch since the engine core started
    try:
        for rank, sub in enumerate(subscribers):
            assert sub.batches and {b.data_parallel_rank for b in sub.batches} == {rank}
        blocks = {**subscribers[0].blocks, **subscribers[1].blocks}
        for prompt, salt in prompts:  # max_tokens 1: a prompt's three pages, and no output page, are cached
            parent = None
            for i in range(3):
                parent = documented_hash(parent, prompt[i * PAGE : (i + 1) * PAGE], salt)
                assert blocks[parent][1] == salt
    finally:
        for sub in subscribers:
            sub.close()


def test_every_page_of_both_engines_comes_back(two_engines: Server) -> None:
    threads = [threading.Thread(target=complete, args=(two_engines.url, [1 + i] * 40, 8)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert per_engine(two_engines.url, "flashserve_kv_pages_used") == [0, 0]
    assert per_engine(two_engines.url, "flashserve_num_requests_running") == [0, 0]


def test_killing_one_engine_core_fails_open_requests_and_exits_non_zero_leaving_nothing(two_engines: Server) -> None:
    events: list[list[str]] = [[], []]
    started = threading.Semaphore(0)

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": [300 + i], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{two_engines.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events[i]:
                        started.release()
                    events[i].append(line)

    readers = [threading.Thread(target=stream, args=(i,)) for i in range(2)]  # one on each engine
    for reader in readers:
        reader.start()
    for _ in readers:
        assert started.acquire(timeout=60)
    os.kill(two_engines.children["flashserve-dp1"], signal.SIGKILL)
    for reader in readers:
        reader.join(30)
    assert two_engines.proc.wait(60) != 0  # type: ignore[attr-defined]
    for lines in events:
        assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][len("data: "):])
    assert_nothing_left(two_engines)


# ---- an engine core told to stop while it exits (the supervisor stopping it after a peer died) ---
EXITING_CORE = """
import os, signal, sys, threading, time
from test_engine import make_engine
from flashserve.entrypoints import core_process
from flashserve.message.codec import EngineSetup, PROTOCOL_VERSION

def sigterm_in(seconds):
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)

def load(_):
    def close():
        if sys.argv[1] == "while-closing":
            sigterm_in(0)
        else:  # a thread still running as the process ends (as a grammar compiler's pool may be)
            threading.Thread(target=sigterm_in, args=(0.3,)).start()
    return core_process.CoreParts(make_engine([3]), EngineSetup(PROTOCOL_VERSION, None, "m", 512, (), 50_000),
                                 None, close)

core_process.main(load, None, [], None, "info", 0, "flashserve-dp0")
"""


@pytest.mark.parametrize("when", ["while-closing", "at-interpreter-exit"])
def test_an_engine_core_stopped_while_it_exits_logs_one_line_and_no_traceback(when: str) -> None:
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", EXITING_CORE, when], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.stderr.count("engine core stopping") == 1, done.stderr


FAILING_CORE = """
from test_engine import make_engine
from flashserve.entrypoints import core_process
from flashserve.message.codec import EngineSetup, PROTOCOL_VERSION

def serve_front_ends(*args, **kwargs):
    raise RuntimeError("the step loop broke")

core_process.serve_front_ends = serve_front_ends
core_process.main(lambda _: core_process.CoreParts(make_engine([3]), EngineSetup(PROTOCOL_VERSION, None, "m", 512, (), 50_000),
                                                   None, lambda: None), None, [], None, "info", 0, "flashserve-dp0")
"""


def test_an_engine_core_whose_loop_raises_logs_it_and_exits_1() -> None:
    """The supervisor reads a failed engine core from its exit code (1), and the log says why."""
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", FAILING_CORE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "the engine core failed" in done.stderr and "RuntimeError: the step loop broke" in done.stderr, done.stderr
