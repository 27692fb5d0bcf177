"""Three replicas of the embedded model behind vLLM's router (the `vllm-router` package), as
deploy/kubernetes runs them: prefix-aware routing keeps a shared prompt prefix on one replica, a
replica that dies loses only its own requests, and everything shuts down on SIGTERM.

The tests share one set of replicas and run in the order written: the last two kill one replica,
then stop the rest."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from live_server import free_port
from production_helpers import metric

pytestmark = pytest.mark.slow

ROUTER = Path(sys.executable).parent / "vllm-router"
MODEL = "SmolLM2-135M-Instruct"
# A fixed step budget skips its measurement at start-up; a small cache: three replicas share 2 cores.
REPLICA_ARGS = ("--max-num-batched-tokens", "256", "--cpu-kv-cache-gb", "0.25")
NUM_GROUPS, PER_GROUP = 8, 8
WORDS = ("river stone lantern orbit meadow copper violet harbor signal thunder quiet amber falcon marble "
         "ember willow canyon glacier lotus prism").split()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited:\n{proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer 200")


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(30)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[tuple[str, subprocess.Popen]]]:
    """Three `flashserve serve` processes, started together (each loads the model on its own)."""
    started = []
    for _ in range(3):
        port = free_port()
        env = dict(os.environ, FLASHSERVE_PORT=str(port), FLASHSERVE_LOG_LEVEL="warning")
        proc = subprocess.Popen([sys.executable, "-m", "flashserve", "serve", *REPLICA_ARGS], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        started.append((f"http://127.0.0.1:{port}", proc))
    try:
        for url, proc in started:
            wait_healthy(f"{url}/health", proc)
        yield started
    finally:
        for _, proc in started:
            stop(proc)


@contextmanager
def router(urls: list[str], policy: str) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    proc = subprocess.Popen(
        [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *urls,
         "--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
         "--health-failure-threshold", "1", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/v1/models", proc, timeout_s=60)
        yield url, proc
    finally:
        stop(proc)


def shared_prefix_prompts(seed: int) -> list[str]:
    """NUM_GROUPS x PER_GROUP prompts, each a group's system text (about 130 tokens) and a short
    question, shuffled; `seed` makes the prefixes new, so no earlier run's cache serves them."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(NUM_GROUPS)]
    prompts = [f"{prefix}\nQuestion {q}: which word came first?" for prefix in prefixes for q in range(PER_GROUP)]
    rng.shuffle(prompts)
    return prompts


def cache_counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hits, queries) in tokens, summed over the replicas' own /metrics."""
    texts = [httpx.get(f"{url}/metrics").text for url in urls]
    return (sum(metric(t, "flashserve_prefix_cache_hits_total") for t in texts),
            sum(metric(t, "flashserve_prefix_cache_queries_total") for t in texts))


def hit_rate(target: str, replica_urls: list[str], seed: int) -> float:
    """The share of prompt tokens found cached, over the replicas, for one shared-prefix run sent
    to `target` one request at a time."""
    hits0, queries0 = cache_counters(replica_urls)
    with httpx.Client(timeout=60) as client:
        for prompt in shared_prefix_prompts(seed):
            r = client.post(f"{target}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
    hits1, queries1 = cache_counters(replica_urls)
    return (hits1 - hits0) / (queries1 - queries0)


@pytest.fixture(scope="module")
def one_server_hit_rate(replicas: list[tuple[str, subprocess.Popen]]) -> float:
    url = replicas[0][0]
    return hit_rate(url, [url], seed=1)


def test_prefix_aware_routing_finds_the_cache_as_often_as_one_server(replicas, one_server_hit_rate) -> None:
    urls = [url for url, _ in replicas]
    with router(urls, "cache_aware") as (url, _):
        routed = hit_rate(url, urls, seed=2)
    assert routed >= one_server_hit_rate - 0.05, (routed, one_server_hit_rate)


def test_round_robin_finds_the_cache_clearly_less_often_than_one_server(replicas, one_server_hit_rate) -> None:
    urls = [url for url, _ in replicas]
    with router(urls, "round_robin") as (url, _):
        routed = hit_rate(url, urls, seed=3)
    assert routed <= one_server_hit_rate - 0.15, (routed, one_server_hit_rate)


def stream_to_end(url: str, max_tokens: int) -> str:
    """'done' for a stream that ended with a finish reason, else what went wrong."""
    body = {"model": MODEL, "prompt": "Tell me a long story about the sea.", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            finished = False
            for line in r.iter_lines():
                finished = finished or '"finish_reason":"length"' in line.replace(" ", "")
            return "done" if finished else "cut"
    except httpx.HTTPError as e:
        return type(e).__name__


def test_a_killed_replica_loses_only_its_own_requests_and_the_router_moves_on(replicas) -> None:
    urls = [url for url, _ in replicas]
    victim = replicas[2][1]
    with router(urls, "round_robin") as (url, _), ThreadPoolExecutor(9) as pool:
        streams = [pool.submit(stream_to_end, url, 96) for _ in range(9)]
        deadline = time.monotonic() + 60
        while metric(httpx.get(f"{urls[2]}/metrics").text, "flashserve_num_requests_running") < 1:
            assert time.monotonic() < deadline, "no request reached the third replica"
            time.sleep(0.1)
        victim.kill()
        outcomes = [s.result(timeout=180) for s in streams]
        time.sleep(2)  # the router's health check (every second) marks the replica down
        after = [httpx.post(f"{url}/v1/completions", timeout=60,
                            json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code for _ in range(6)]
    assert outcomes.count("done") >= 6, outcomes  # the two live replicas' requests all complete
    assert after == [200] * 6


def test_sigterm_stops_router_and_replicas_leaving_no_process(replicas) -> None:
    urls = [url for url, proc in replicas if proc.poll() is None]
    with router(urls, "cache_aware") as (_, router_proc):
        assert stop(router_proc) in (0, -signal.SIGTERM)
    codes = [stop(proc) for _, proc in replicas if proc.returncode is None]
    assert codes == [0, 0]
    for url in urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
