"""Streaming requests to any OpenAI-compatible server, timed per request, and the load that drives them.

Times are in seconds here (`time.perf_counter`); reports convert them to milliseconds. A request
counts as a success only if its stream parses, carries content, and ends with `data: [DONE]`;
anything else is a failure with an `error_kind` (`http_<status>`, `malformed`, `error_event`,
`no_done`, `empty`, `truncated`, `timeout`, `connection`, `client_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing
import time
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any, Literal, Sequence

import httpx
import numpy as np
from tqdm import tqdm

from benchmark.workloads import BenchRequest

Endpoint = Literal["completions", "chat"]
Arrivals = Literal["poisson", "constant"]


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how requests go. `base_url` is the server root (a trailing `/v1` is accepted)."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0  # per network read, not per request
    # A server without a tokenizer (flashserve on dummy weights) streams one chunk per token with
    # empty text: count such completion chunks (finish_reason null) as content.
    empty_text_chunks: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def root(self) -> str:
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def url(self) -> str:
        return self.root + ("/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions")


@dataclass
class RequestResult:
    """One request's measurements, in seconds. `itl_s` holds the gaps between content chunks."""

    prompt_len: int  # usage.prompt_tokens when the server reports it, else the client's count
    output_len: int  # requested max_tokens
    success: bool = False
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    ttft_s: float | None = None  # send -> first content chunk
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None  # send -> [DONE]
    start_s: float = 0.0  # send time, relative to the start of the run
    error_kind: str = ""
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); None with fewer than two tokens."""
        if not self.success or self.output_tokens < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    """All requests of one run (failures included) and its wall time in seconds."""

    results: list[RequestResult]
    duration_s: float
    client_busy: float = 0.0  # CPU time / wall time of the busiest client process: near 1, it lags


class StreamError(Exception):
    """A response that cannot count as a success; `kind` names the failure."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def build_body(cfg: EndpointConfig, req: BenchRequest) -> dict[str, Any]:
    """The JSON body: always streaming with usage, `max_tokens` and `ignore_eos` per request."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:  # a vLLM/SGLang extension: servers without it may reject the key
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(cfg.extra_body)
    return body


class _StreamParser:
    """Server-sent events of one response: records content-chunk times, usage and [DONE]."""

    def __init__(self, chat: bool, empty_text_chunks: bool = False) -> None:
        self.chat = chat
        self.empty_text_chunks = empty_text_chunks
        self.chunk_times: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.done_at: float | None = None

    def feed(self, line: bytes, now: float) -> None:
        line = line.rstrip(b"\r")
        if not line or line.startswith(b":") or line.startswith((b"id:", b"retry:")):
            return
        if line.startswith(b"event:"):
            if line[6:].strip() == b"error":
                raise StreamError("error_event", "event: error")
            return
        if not line.startswith(b"data:"):
            raise StreamError("malformed", f"not an SSE field: {line[:200]!r}")
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done_at = now
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            raise StreamError("malformed", f"bad JSON: {payload[:200]!r}") from None
        if not isinstance(obj, dict):
            raise StreamError("malformed", f"not an object: {payload[:200]!r}")
        if obj.get("error"):
            raise StreamError("error_event", json.dumps(obj["error"])[:300])
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            if self.chat:
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content")
            else:
                text = choice.get("text")
                if self.empty_text_chunks and text == "" and choice.get("finish_reason") is None:
                    text = " "  # a token without text
            if text:
                self.chunk_times.append(now)
                break


async def send_request(
    client: httpx.AsyncClient, cfg: EndpointConfig, req: BenchRequest, t0: float | None = None
) -> RequestResult:
    """Send one streaming request and time it; never raises for server or network faults."""
    res = RequestResult(prompt_len=req.prompt_len, output_len=req.output_len)
    parser = _StreamParser(chat=cfg.endpoint == "chat", empty_text_chunks=cfg.empty_text_chunks)
    body = build_body(cfg, req)
    start = time.perf_counter()
    res.start_s = start - (start if t0 is None else t0)
    try:
        async with client.stream("POST", cfg.url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise StreamError(f"http_{resp.status_code}", text[:300])
            buf = b""
            async for data in resp.aiter_bytes():
                now = time.perf_counter()  # one network read: all its lines arrived together
                *lines, buf = (buf + data).split(b"\n")
                for line in lines:
                    parser.feed(line, now)
            if buf:
                parser.feed(buf, time.perf_counter())
    except StreamError as e:
        return _fail(res, e.kind, str(e))
    except httpx.TimeoutException as e:
        return _fail(res, "timeout", repr(e))
    except httpx.RemoteProtocolError as e:
        return _fail(res, "truncated", str(e))
    except httpx.TransportError as e:
        return _fail(res, "connection", repr(e))
    except Exception as e:  # noqa: BLE001 - a client bug must still count as a failed request
        return _fail(res, "client_error", repr(e))

    times = parser.chunk_times
    if parser.done_at is None:
        return _fail(res, "no_done", "stream ended without data: [DONE]")
    if not times:
        return _fail(res, "empty", "no content in the stream")
    res.success = True
    res.ttft_s = times[0] - start
    res.itl_s = [b - a for a, b in zip(times, times[1:])]
    res.e2e_s = parser.done_at - start
    usage = parser.usage or {}
    res.output_tokens = int(usage.get("completion_tokens") or len(times))
    res.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
    return res


def _fail(res: RequestResult, kind: str, message: str) -> RequestResult:
    res.success, res.error_kind, res.error = False, kind, message
    return res


def arrival_offsets(n: int, rate: float | None, seed: int = 0, arrivals: Arrivals = "poisson") -> list[float]:
    """Send times (s, from the start) of `n` requests at `rate` req/s; the first goes at 0.

    Poisson arrivals have exponential gaps of mean 1/rate drawn from `seed`; constant arrivals are
    evenly spaced. No rate (or an infinite one) sends everything at once.
    """
    if rate is None or rate == float("inf") or n == 0:
        return [0.0] * n
    if arrivals == "constant":
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def make_client(timeout_s: float = 600.0) -> httpx.AsyncClient:
    """An unpooled-limit client; proxies from the environment are ignored (servers are usually local)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


async def run_load(
    cfg: EndpointConfig,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None = None,
    request_rate: float | None = None,
    arrivals: Arrivals = "poisson",
    seed: int = 0,
    progress: bool = False,
    desc: str = "",
    workers: int = 1,
) -> LoadResult:
    """Offer `requests` at `request_rate` (req/s) with at most `concurrency` in flight; wait for all.

    With only `concurrency`, exactly that many streams run at once until the requests run out.
    `workers` > 1 deals the requests (round robin, on the same arrival schedule) and the concurrency
    cap out to that many client processes, for loads that one Python process cannot keep up with.
    """
    offsets = arrival_offsets(len(requests), request_rate, seed, arrivals)
    workers = max(1, min(workers, len(requests), concurrency or len(requests)))
    if workers == 1:
        cpu0 = time.process_time()
        with _bar(len(requests), desc, progress) as bar:
            results, duration = await _drive(cfg, list(requests), offsets, concurrency, None, bar)
        return LoadResult(results, duration, (time.process_time() - cpu0) / duration if duration else 0.0)
    caps = [concurrency // workers + (i < concurrency % workers) if concurrency else None for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")  # not fork: the caller may hold threads and a running loop
    ready = ctx.Barrier(workers + 1)
    with ctx.Pool(workers, initializer=_worker_ready, initargs=(ready, cfg.root)) as pool:
        await asyncio.to_thread(ready.wait, 120)  # every worker is up and has been to the server once
        start_wall = time.time() + 0.5  # time to hand out the shards; not part of the duration
        jobs = [(cfg, list(requests[i::workers]), offsets[i::workers], caps[i], start_wall, i, desc, progress)
                for i in range(workers)]
        shards = await asyncio.to_thread(pool.starmap, _shard_process, jobs)
        pool.close()
        await asyncio.to_thread(pool.join)
    results = sorted((r for shard, _, _ in shards for r in shard), key=lambda r: r.start_s)
    return LoadResult(results, max(d for _, d, _ in shards), max(c / d if d else 0.0 for _, d, c in shards))


def _bar(total: int, desc: str, progress: bool, position: int | None = None) -> tqdm:
    return tqdm(total=total, desc=desc or None, unit="req", disable=not progress, leave=False, position=position)


def _worker_ready(barrier: Any, root: str) -> None:
    """Worker-process initializer: warm the HTTP stack (lazy imports) with one GET, then wait."""
    try:
        asyncio.run(first_model_id(root))
    except Exception:  # noqa: BLE001 - the measured requests will report what is wrong
        pass
    barrier.wait(120)


def _shard_process(
    cfg: EndpointConfig, requests: list[BenchRequest], offsets: list[float], concurrency: int | None,
    start_wall: float, position: int, desc: str, progress: bool,
) -> tuple[list[RequestResult], float, float]:
    """Worker-process entry: (results, duration s, CPU s) of one shard."""
    cpu0 = time.process_time()
    with _bar(len(requests), f"{desc} [{position}]", progress, position) as bar:
        results, duration = asyncio.run(_drive(cfg, requests, offsets, concurrency, start_wall, bar))
    return results, duration, time.process_time() - cpu0


@contextlib.asynccontextmanager
async def _frozen_heap() -> AsyncIterator[None]:
    """The objects that exist before a load kept out of the garbage collector's reach while it
    runs: a full collection over a large heap (a process that has imported torch) stalled the
    sends by ~85 ms once per load, visible as late requests and longer TTFTs."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _drive(
    cfg: EndpointConfig, requests: list[BenchRequest], offsets: list[float], concurrency: int | None,
    start_wall: float | None, bar: tqdm,
) -> tuple[list[RequestResult], float]:
    """Send each request at its offset (s) from `start_wall` (a `time.time()`; None: now)."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    async with make_client(cfg.timeout_s) as client, _frozen_heap():

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                res = await send_request(client, cfg, req, t0)
            else:
                async with sem:
                    res = await send_request(client, cfg, req, t0)
            bar.update(1)
            return res

        # Worker processes share a wall-clock start: perf_counter has no common origin across them.
        t0 = time.perf_counter() + (0.0 if start_wall is None else start_wall - time.time())
        tasks = []
        for req, offset in zip(requests, offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


async def first_model_id(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id listed by GET /v1/models."""
    root = EndpointConfig(base_url, "").root
    async with make_client(timeout_s) as client:
        resp = await client.get(root + "/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
        if not data:
            raise RuntimeError(f"{root}/v1/models lists no models")
        return str(data[0]["id"])
