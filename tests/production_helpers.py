"""In-process servers for the production tests: the real AsyncEngine, scheduler and KV cache manager
over a fast fake model, behind the real app, served by uvicorn on a free port in a thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from flashserve.api.options import APIOptions
from flashserve.api.server import build_app
from flashserve.client.async_engine import AsyncEngine
from flashserve.config import SchedulerConfig
from flashserve.engine.llm_engine import LLMEngine
from flashserve.engine.outputs import SchedulerOutput
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.metrics import Metrics
from flashserve.sample.sampler import Sampler
from flashserve.worker.input_batch import InputBatch
from flashserve.worker.runner import ModelRunner

MODEL = "fake"
VOCAB = 64
PAGE_SIZE = 16
POISON_SEED = 666  # requests with this seed make the sampler raise


class FakeModelRunner(ModelRunner):
    """The real ModelRunner.execute (a request whose sampling fails gets an error result) over a
    fake forward: `delay` seconds per step, logits that make greedy sampling pick token 7."""

    def __init__(self, sampler: Any, delay: float = 0.0, fail_forward: BaseException | None = None) -> None:
        self.sampler = sampler  # no model, no backend: forward() is replaced
        self.batch = InputBatch()
        self.drafter = self.lora = None  # no draft model, no LoRA adapters
        self.delay = delay
        self.fail_forward = fail_forward

    def forward(self, out: SchedulerOutput, prompt_rows=(), previous=None, rows=None) -> torch.Tensor:  # noqa: ANN001
        if self.delay:
            time.sleep(self.delay)
        if self.fail_forward is not None:
            raise self.fail_forward
        rows = sum(r.sample for r in out.requests) + len(prompt_rows)
        logits = torch.zeros(rows, VOCAB)
        logits[:, 7] = 10.0
        return logits


class PoisonSampler(Sampler):
    """Raises for a batch holding a request seeded POISON_SEED once it has `fail_after` tokens."""

    def __init__(self, fail_after: int = 0) -> None:
        super().__init__(0)
        self.fail_after = fail_after

    def sample_ids(self, logits: torch.Tensor, requests: Any, bitmask: Any = None) -> torch.Tensor:
        for r in requests:
            if r.params.seed == POISON_SEED and len(r.output_token_ids) >= self.fail_after:
                raise RuntimeError("injected sampling fault")
        return super().sample_ids(logits, requests, bitmask)


@dataclass
class Stack:
    url: str
    engine: AsyncEngine
    metrics: Metrics

    @property
    def llm(self) -> LLMEngine:
        return self.engine.engine

    def metric(self, name: str, **labels: str) -> float:
        return metric(httpx.get(f"{self.url}/metrics").text, name, **labels)


def make_engine(
    *, delay: float = 0.005, num_pages: int = 256, max_num_seqs: int = 64, max_waiting: int | None = None,
    queue_timeout: float | None = None, sampler: Sampler | None = None, fail_forward: BaseException | None = None,
    metrics: Metrics | None = None,
) -> AsyncEngine:
    runner = FakeModelRunner(sampler or Sampler(0), delay, fail_forward)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
                          KVCacheManager(num_pages, PAGE_SIZE), max_model_len=num_pages * PAGE_SIZE)
    return AsyncEngine(LLMEngine(scheduler, runner, None, vocab_size=VOCAB), num_pages * PAGE_SIZE, metrics=metrics,
                       max_waiting=max_waiting, queue_timeout=queue_timeout)


@contextmanager
def serve_engine(options: APIOptions = APIOptions(), **engine_kw: Any) -> Iterator[Stack]:
    """The app over `make_engine(**engine_kw)` (tokenizer-free: token-id prompts), served by
    uvicorn in a thread with its own event loop, which also runs the engine's outputs."""
    metrics = Metrics(model_name=MODEL)
    engine = make_engine(metrics=metrics, **engine_kw)
    app = build_app(engine, None, [MODEL], engine.max_model_len, eos_token_ids=(), options=options,
                    metrics=metrics)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))

    async def main() -> None:
        engine.start()
        try:
            await server.serve(sockets=[sock])
        finally:
            engine.shutdown()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "uvicorn did not start")
    try:
        yield Stack(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, metrics)
    finally:
        server.should_exit = True
        thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], bool], timeout: float = 5.0, message: str = "condition") -> float:
    """Poll until `condition()`; returns the seconds it took, fails the test after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for: {message}")
        time.sleep(0.01)
    return time.monotonic() - start


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of Prometheus text, e.g. metric(t, "flashserve_kv_pages_free")."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(f"{name}{labels or ''} not in the metrics")


def completion(max_tokens: int, *, stream: bool = False, prompt: list[int] | None = None, **extra: Any) -> dict:
    return {"model": MODEL, "prompt": prompt or [1, 2, 3, 4, 5], "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True, **extra}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error
