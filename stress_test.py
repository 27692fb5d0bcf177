"""Stress test of a flashserve server on this machine, with locust (`pip install -e .[dev]`).

    python stress_test.py                                  # 20 users, 60 s, http://127.0.0.1:8000
    python stress_test.py --host http://127.0.0.1:9000 -u 300 -r 50 -t 3m --token-ids
    locust -f stress_test.py --headless -u 20 -r 10 -t 60s --host http://127.0.0.1:8000

Three kinds of users: streamers (chat completions with random prompt and output lengths, or with
--token-ids completions of random token ids, for a server without a tokenizer, such as one
running --load-format dummy, or with --text-completions completions of random text, for a
tokenizer without a chat template), users who disconnect mid-stream, and users who send invalid
requests (malformed JSON, out-of-range values, token ids past the model's embedding, fan-out past
the per-request limit) and expect a 4xx in OpenAI's shape. Failures are reported by kind. When the run ends the
script reads /metrics until every KV page is free again, and fails the run (exit code 1) if they
are not. It only runs headless, for a bounded time, against a loopback address.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import sys
import time
from collections import Counter
from typing import Any
from urllib.parse import urlparse

from locust import HttpUser, between, events, task
from locust.env import Environment
from locust.runners import WorkerRunner

WORDS = ("the river carries light across old stone bridges while market voices rise and fall "
         "between bakeries tram lines gardens and quiet libraries full of maps").split()
PAGES_FREE_TIMEOUT = 60.0  # seconds for the server to free the pages of streams cut at the end


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("flashserve")
    group.add_argument("--token-ids", action="store_true", env_var="STRESS_TOKEN_IDS",
                       help="completions with token-id prompts (a server without a tokenizer)")
    group.add_argument("--text-completions", action="store_true", env_var="STRESS_TEXT_COMPLETIONS",
                       help="completions with text prompts (a tokenizer without a chat template)")
    group.add_argument("--min-prompt", type=int, default=4, env_var="STRESS_MIN_PROMPT", help="words or tokens")
    group.add_argument("--max-prompt", type=int, default=64, env_var="STRESS_MAX_PROMPT", help="words or tokens")
    group.add_argument("--min-output", type=int, default=4, env_var="STRESS_MIN_OUTPUT", help="max_tokens, lowest")
    group.add_argument("--max-output", type=int, default=32, env_var="STRESS_MAX_OUTPUT", help="max_tokens, highest")
    group.add_argument("--api-key", default="", env_var="STRESS_API_KEY", help="sent as Authorization: Bearer")


@events.init.add_listener
def _refuse_unbounded_or_remote(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    # Workers take their host and duration from the master, which checks them.
    if options is None or isinstance(environment.runner, WorkerRunner):
        return
    host = urlparse(environment.host or "").hostname or ""
    if not _is_loopback(host):
        sys.exit(f"stress_test.py only targets this machine (127.0.0.1, localhost, ::1), not {host!r}")
    if not options.headless or not options.run_time:
        sys.exit("stress_test.py runs headless and bounded: pass --headless and --run-time (-t)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _User(HttpUser):
    abstract = True
    wait_time = between(0.2, 1.5)

    def on_start(self) -> None:
        self.options = self.environment.parsed_options
        if self.options.api_key:
            self.client.headers["Authorization"] = f"Bearer {self.options.api_key}"

    def _request(self) -> tuple[str, dict[str, Any]]:
        """A streaming request of random prompt and output length."""
        o = self.options
        max_tokens = random.randint(o.min_output, o.max_output)
        size = random.randint(o.min_prompt, o.max_prompt)
        if o.token_ids:
            prompt = [random.randrange(100, 1000) for _ in range(size)]
            return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                       "ignore_eos": True, "stream_options": {"include_usage": True}}
        text = " ".join(random.choice(WORDS) for _ in range(size))
        if o.text_completions:
            return "/v1/completions", {"prompt": f"Continue this story: {text}", "max_tokens": max_tokens,
                                       "temperature": 0.8, "stream": True, "ignore_eos": True,
                                       "stream_options": {"include_usage": True}}
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Continue this story: {text}"}],
            "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}


class Streamer(_User):
    weight = 6

    @task
    def stream(self) -> None:
        path, body = self._request()
        start = time.perf_counter()
        with self.client.post(path, json=body, stream=True, catch_response=True, name="stream",
                              timeout=(10, 600)) as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}: {_error_code(r)}")
                return
            try:
                problem = self._read(r, body["max_tokens"], start)
            except Exception as exc:  # requests' connection and chunked-encoding errors
                problem = f"connection: {type(exc).__name__}"
            if problem:
                r.failure(problem)

    def _read(self, r: Any, max_tokens: int, start: float) -> str | None:
        first = done = False
        completion_tokens = None
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if not first:
                first = True
                _fire(self.environment, "TTFT", (time.perf_counter() - start) * 1000)
            if line == b"data: [DONE]":
                done = True
                break
            if line.startswith(b'data: {"error"'):
                error = json.loads(line[6:])["error"]
                return f"error event: {error.get('type')}/{error.get('code')}"
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
        if not done:
            return "stream ended without [DONE]"
        if completion_tokens is None or not 0 < completion_tokens <= max_tokens:
            return f"bad usage: {completion_tokens} tokens for max_tokens {max_tokens}"
        if self.options.token_ids and completion_tokens != max_tokens:
            return f"short stream: {completion_tokens} of {max_tokens} tokens with ignore_eos"
        _fire(self.environment, "E2E", (time.perf_counter() - start) * 1000)
        return None


class Leaver(_User):
    """Opens a long stream and goes away after a few chunks; the server must free its pages."""

    weight = 2

    @task
    def leave(self) -> None:
        path, body = self._request()
        body["max_tokens"] = self.options.max_output * 4
        with self.client.post(path, json=body, stream=True, catch_response=True, name="disconnect",
                              timeout=(10, 600)) as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}: {_error_code(r)}")
                return
            wanted = random.randint(1, 3)
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    wanted -= 1
                    if wanted == 0:
                        break
            r.success()
            r.close()  # mid-stream: the connection goes, the server aborts the request


INVALID: list[tuple[str, Any]] = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"'),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": [1, 2, -3]}),
    ("/v1/completions", {"prompt": [1, 2], "model": "no-such-model"}),
    ("/v1/completions", b"\xff\xfe\xfd"),
    # Token ids past the model's embedding (128,256 is the first id past Llama 3's and SmolLM2's).
    ("/v1/completions", {"prompt": [1, 2, 128256], "max_tokens": 1}),
    ("/v1/completions", {"prompt": [[1, 2], [2**31 - 1]], "max_tokens": 1}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "stop_token_ids": [10**9]}),
    ("/v1/completions", {"prompt": [1, 2, 128256], "max_tokens": 1, "stream": True}),
    # Fan-out past the per-request limit of sequences.
    ("/v1/completions", {"prompt": [[1, 2]] * 200, "n": 128, "max_tokens": 1}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": NaN}'),
]


class Invalid(_User):
    weight = 1

    @task
    def invalid(self) -> None:
        path, body = random.choice(INVALID)
        kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        with self.client.post(path, catch_response=True, name="invalid", **kw) as r:
            try:
                error = r.json()["error"]
                shaped = {"message", "type", "param", "code"} <= set(error)
            except Exception:
                shaped = False
            if not 400 <= r.status_code < 500:
                r.failure(f"invalid request got status {r.status_code}")
            elif not shaped:
                r.failure("invalid request: error not in OpenAI's shape")
            else:
                r.success()


def _error_code(r: Any) -> str:
    try:
        return str(r.json()["error"].get("code") or r.json()["error"].get("type"))
    except Exception:
        return "no OpenAI error body"


def _fire(environment: Environment, kind: str, ms: float) -> None:
    environment.events.request.fire(request_type=kind, name="stream", response_time=ms, response_length=0,
                                    exception=None, context={})


# ---- after the run -------------------------------------------------------------------------------


def _metrics(host: str) -> dict[str, float]:
    import requests

    text = requests.get(f"{host}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("flashserve_"):  # engine figures carry engine="i": summed over the engines
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


@events.quitting.add_listener
def _check_pages_and_report(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or environment.runner is None:
        return
    deadline = time.monotonic() + PAGES_FREE_TIMEOUT
    metrics: dict[str, float] = {}
    while time.monotonic() < deadline:
        try:
            metrics = _metrics(environment.host)
        except Exception as exc:
            logging.error("reading /metrics failed: %s", exc)
            break
        if metrics.get("flashserve_kv_pages_used") == 0 and metrics.get("flashserve_num_requests_running") == 0:
            break
        time.sleep(0.5)
    used, free = metrics.get("flashserve_kv_pages_used"), metrics.get("flashserve_kv_pages_free")
    completed = environment.runner.stats.get("stream", "E2E").num_requests
    if used != 0 or completed == 0:  # pages still held, or a run that tested nothing
        environment.process_exit_code = 1
    _report(environment, used, free)


def _report(environment: Environment, used: float | None, free: float | None) -> None:
    stats = environment.runner.stats
    served = sum(e.num_requests - e.num_failures for (_, method), e in stats.entries.items() if method == "POST")
    kinds: Counter[str] = Counter()
    for err in stats.errors.values():
        kinds[str(err.error).split(":")[0]] += err.occurrences
    ttft = stats.get("stream", "TTFT")
    p99 = f"{ttft.get_response_time_percentile(0.99):.0f} ms" if ttft.num_requests else "-"
    print("\n==== flashserve stress test ====")
    print(f"requests served: {served} (streams completed: {stats.get('stream', 'E2E').num_requests})")
    print(f"failures: {sum(kinds.values())}" + "".join(f"\n  {n:6d}  {k}" for k, n in kinds.most_common()))
    print(f"P99 TTFT: {p99} over {ttft.num_requests} streams")
    print(f"KV pages at the end: {used} used, {free} free" + ("" if used == 0 else "  <-- NOT ALL FREE"))
    print("================================", flush=True)


if __name__ == "__main__":
    import os

    defaults = {("-u", "--users"): "20", ("-r", "--spawn-rate"): "10", ("-t", "--run-time"): "60s",
                ("-H", "--host"): "http://127.0.0.1:8000"}
    argv = [sys.executable, "-m", "locust", "-f", os.path.abspath(__file__), "--headless", "--only-summary"]
    for flags, value in defaults.items():
        if not any(a in flags or a.startswith(f"{flags[1]}=") for a in sys.argv[1:]):
            argv += [flags[0], value]
    # A fresh process: importing this file here already registered its listeners once.
    os.execv(sys.executable, argv + sys.argv[1:])
