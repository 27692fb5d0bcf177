"""Prometheus metrics of one server, in a registry of its own (no global default registry).

Two writers: the engine loop sets the engine's gauges and counters once per step (`record_step`),
and the API records what clients see: time to first token, inter-token latency, end-to-end
latency, finish reasons and errors (`RequestRecord`, `record_error`). prometheus-client's metrics
are thread-safe, so both may write while `/metrics` renders.

Under `flashserve serve` the writers are processes (the engine core, each front end):
prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the supervisor before it
starts them) keeps every process's figures in files of that directory, and `render` adds them up,
so any front end's /metrics shows the engine's and all front ends' figures. The engine's gauges
are written by the engine core only: the most recent value is the one shown. The engine's figures
carry an `engine` label, one value per engine core of `--data-parallel-size` ("0" with one).
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from flashserve.metrics_vllm import vllm_families

# Seconds. Wide on purpose: a CPU server takes seconds per token, a GPU one milliseconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

request_logger = logging.getLogger("flashserve.requests")


@dataclass(frozen=True)
class StepStats:
    """What the engine loop reads off the scheduler after a step; all cheap attribute reads."""

    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_free: int
    kv_pages_cached: int = 0  # free pages still holding a prefix others can reuse
    num_preemptions: int = 0  # since the last step
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache, since the last step
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_prompt_tokens: int = 0  # of requests that got their first token in this step
    num_generation_tokens: int = 0
    queue_times: Sequence[float] = ()  # seconds from arrival to first schedule, per newly scheduled request
    # Speculative decoding, since the last step: verified draft rows, their draft tokens, the
    # accepted ones, and those accepted at each draft position (0-based).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: Sequence[int] = ()


class Metrics:
    def __init__(self, engine: str = "0", model_name: str | None = None) -> None:
        """`engine`: the label of the engine-side figures this process writes (its index among
        the engine cores of `--data-parallel-size`; "0" with one). With `model_name`, `render`
        shows every figure under vLLM's names too (`metrics_vllm`), labelled with it."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Gauges only an engine sets; under several processes the most recent value per engine
        # label is shown. The engine's figures carry `engine="i"`, as vLLM's do.
        labels = ["engine"]
        gauge = functools.partial(Gauge, labelnames=labels, registry=r, multiprocess_mode="mostrecent")
        counter = functools.partial(Counter, labelnames=labels, registry=r)
        self.requests_running = gauge("flashserve_num_requests_running",
                                      "Requests in the running batch").labels(engine)
        self.requests_waiting = gauge("flashserve_num_requests_waiting",
                                      "Requests queued for the engine (new or preempted)").labels(engine)
        self.kv_pages_used = gauge("flashserve_kv_pages_used", "KV cache pages held by requests").labels(engine)
        self.kv_pages_free = gauge("flashserve_kv_pages_free",
                                   "KV cache pages free (cached ones included)").labels(engine)
        self.kv_pages_cached = gauge("flashserve_kv_pages_cached",
                                     "Free KV cache pages that still hold a reusable prefix").labels(engine)
        self.prefix_queries = counter("flashserve_prefix_cache_queries",
                                      "Tokens looked up in the prefix cache").labels(engine)
        self.prefix_hits = counter("flashserve_prefix_cache_hits", "Tokens found in the prefix cache").labels(engine)
        self.preemptions = counter("flashserve_num_preemptions", "Preemptions by recompute").labels(engine)
        self.prompt_tokens = counter("flashserve_prompt_tokens", "Prompt tokens of requests that began generating "
                                     "(prefix-cached ones included)").labels(engine)
        self.generation_tokens = counter("flashserve_generation_tokens", "Tokens generated").labels(engine)
        self.ttft = Histogram("flashserve_time_to_first_token_seconds", "Time to first token, as the API saw it",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("flashserve_inter_token_latency_seconds", "Time between output tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("flashserve_e2e_request_latency_seconds", "Request latency, arrival to last output",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("flashserve_request_queue_time_seconds", "Time waiting before first scheduled",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.finished = Counter("flashserve_requests_finished", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("flashserve_request_errors", "Error responses and error events by OpenAI error type",
                              ["type", "code"], registry=r)
        self._step_gauge_values: tuple[int | None, ...] = (None,) * 5  # as last written by record_step
        # Speculative decoding, as vLLM counts it (`vllm:spec_decode_*`).
        self.spec_drafts = counter("flashserve_spec_decode_num_drafts", "Verified rows that carried draft "
                                   "tokens (speculative decoding)").labels(engine)
        self.spec_draft_tokens = counter("flashserve_spec_decode_num_draft_tokens",
                                         "Draft tokens verified").labels(engine)
        self.spec_accepted_tokens = counter("flashserve_spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted").labels(engine)
        self._spec_per_pos = Counter("flashserve_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                                     "at each draft position (0-based)", ["engine", "position"], registry=r)
        # vLLM's LoRA gauge (`vllm:lora_requests_info`), which the Gateway API Inference Extension's
        # endpoint picker reads to route by adapter: the adapters running and waiting as labels,
        # the time they became so as its value. The picker takes the series of the latest time.
        self._engine = engine
        self.lora_info = Gauge("flashserve_lora_requests_info", "LoRA adapters of the running and waiting "
                               "requests (labels) since the time that is the value", registry=r,
                               labelnames=["engine", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                               multiprocess_mode="mostrecent")
        self._lora_labels: tuple[str, str, str] | None = None

    def record_step(self, stats: StepStats) -> None:
        # A gauge is written only when its value changed: under `flashserve serve` each write is a
        # locked write to a shared-memory file, and most steps change few of them.
        values = (stats.num_running, stats.num_waiting, stats.kv_pages_used, stats.kv_pages_free,
                  stats.kv_pages_cached)
        if values != self._step_gauge_values:
            gauges = (self.requests_running, self.requests_waiting, self.kv_pages_used, self.kv_pages_free,
                      self.kv_pages_cached)
            for gauge, value, before in zip(gauges, values, self._step_gauge_values):
                if value != before:
                    gauge.set(value)
            self._step_gauge_values = values
        if stats.prefix_cache_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            self.prefix_hits.inc(stats.prefix_cache_hits)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for seconds in stats.queue_times:
            self.queue_time.observe(seconds)
        if stats.spec_drafts:
            self.spec_drafts.inc(stats.spec_drafts)
            self.spec_draft_tokens.inc(stats.spec_draft_tokens)
            self.spec_accepted_tokens.inc(stats.spec_accepted_tokens)
            for position, accepted in enumerate(stats.spec_accepted_per_pos):
                if accepted:
                    self._spec_per_pos.labels(self._engine, str(position)).inc(accepted)

    def record_loras(self, running: Sequence[str], waiting: Sequence[str], max_lora: int) -> None:
        """The LoRA adapters (names) of the running and of the waiting requests; written when they
        change, stamped with the time (seconds since the epoch)."""
        labels = (",".join(sorted(running)), ",".join(sorted(waiting)), str(max_lora))
        if labels != self._lora_labels:
            self.lora_info.labels(self._engine, *labels).set(time.time())
            self._lora_labels = labels

    def record_error(self, type: str, code: str | None) -> None:
        self.errors.labels(type, code or "").inc()

    def render(self) -> bytes:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        registry = self.registry
        if directory:  # every process's figures, this one's included
            registry = CollectorRegistry()
            MultiProcessCollector(registry, directory)
        if self.model_name is None:
            return generate_latest(registry)
        families = list(registry.collect())
        return generate_latest(_Families(families + vllm_families(families, self.model_name)))


class _Families:
    """Families already collected, in the shape `generate_latest` reads."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


# Tokens a request's inter-token gaps are held for before they go into the histogram.
ITL_FLUSH_TOKENS = 64


class HistogramBuffer:
    """Observations held per bucket and added to `histogram` in one go (`flush`), as that many
    `observe` calls would add them. Under `flashserve serve` every observe writes two values of a
    shared-memory file under a lock (4.2 us a call on the 2-core VM, against 0.2 us to count one
    here): per streamed token that was about a tenth of a front end's CPU. Reads the histogram's
    bucket bounds and values; where those internals are missing, observes at once. With
    `flush_every`, flushes itself once that many observations wait."""

    __slots__ = ("histogram", "flush_every", "bounds", "counts", "total", "pending")

    def __init__(self, histogram: Histogram, flush_every: int | None = None) -> None:
        self.histogram = histogram
        self.flush_every = flush_every
        internals = all(hasattr(histogram, name) for name in ("_sum", "_buckets", "_upper_bounds"))
        self.bounds: list[float] | None = histogram._upper_bounds if internals else None
        self.counts = [0] * len(self.bounds or ())
        self.total = 0.0
        self.pending = 0

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        if self.bounds is None:
            for _ in range(count):
                self.histogram.observe(value)
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += count  # the first bound >= value
        self.total += value * count
        self.pending += count
        if self.flush_every is not None and self.pending >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.histogram._sum.inc(self.total)
        for bucket, count in zip(self.histogram._buckets, self.counts):
            if count:
                bucket.inc(count)
        self.counts = [0] * len(self.counts)
        self.total, self.pending = 0.0, 0


class RequestRecord:
    """One API request (all its choices) as clients see it: feeds the histograms and writes the
    request's log line once, when it is `close`d. Event-loop only."""

    def __init__(self, metrics: Metrics, request_id: str, num_prompt_tokens: int, num_choices: int,
                 arrival: float | None = None, x_request_id: str | None = None) -> None:
        self.metrics = metrics
        self.request_id = request_id
        # Besides our id: the one the client got in the `x-request-id` header, to find this line by.
        self.x_request_id = x_request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_token: float | None = None
        self._last_token: list[float | None] = [None] * num_choices
        self.output_tokens = [0] * num_choices
        self.finish_reasons: list[str | None] = [None] * num_choices
        # Inter-token gaps, added to the histogram every ITL_FLUSH_TOKENS tokens and at the end.
        self._itl = HistogramBuffer(metrics.itl, flush_every=ITL_FLUSH_TOKENS)
        self._closed = False
        # Seconds the first scheduled choice waited in the engine's queue, once known.
        self.queue_time: float | None = None
        # The request's trace span (`tracing.RequestSpan`), ended at `close`; None: tracing is off.
        self.span: Any = None

    def tokens(self, index: int, num_new_tokens: int, num_output_tokens: int) -> None:
        """Choice `index` received `num_new_tokens` tokens now (one engine step's worth, or the
        steps a request that is not streamed gets merged)."""
        if num_new_tokens <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
        last = self._last_token[index]
        if last is not None:  # one observation per token, at the tokens' mean gap
            self._itl.observe((now - last) / num_new_tokens, num_new_tokens)
        self._last_token[index] = now
        self.output_tokens[index] = max(self.output_tokens[index], num_output_tokens)

    def scheduled(self, arrival_time: float, scheduled_time: float) -> None:
        """An output of one of its choices: `scheduled_time` is when the engine first scheduled it
        (0.0 until then), `arrival_time` when the engine received it (one monotonic clock)."""
        if self.queue_time is None and scheduled_time:
            self.queue_time = max(0.0, scheduled_time - arrival_time)

    def finish(self, index: int, reason: str) -> None:
        if self.finish_reasons[index] is None:
            self.finish_reasons[index] = reason
            self.metrics.finished.labels(reason).inc()

    def close(self) -> None:
        """The request is over; choices without a finish reason were abandoned (client gone)."""
        if self._closed:
            return
        self._closed = True
        self._itl.flush()
        for i, reason in enumerate(self.finish_reasons):
            if reason is None:
                self.finish(i, "abort")
        end = time.monotonic()
        latency = end - self.arrival
        self.metrics.e2e.observe(latency)
        if self.span is not None:
            self.span.end(self, latency)
        if request_logger.isEnabledFor(logging.INFO):
            request_logger.info("%s", self.log_line(latency))

    def log_line(self, latency: float) -> str:
        completion = sum(self.output_tokens)
        ttft = None if self.first_token is None else self.first_token - self.arrival
        prompt_tps = self.num_prompt_tokens / ttft if ttft else 0.0
        decode_time = latency - ttft if ttft is not None else 0.0
        # Tokens after the first, over the time after the first: the decode rate a client saw.
        gen_tps = (completion - len(self.output_tokens)) / decode_time if decode_time > 0 else 0.0
        reasons = ",".join(r or "abort" for r in self.finish_reasons)
        ttft_text = "-" if ttft is None else f"{ttft:.3f}s"
        return (f"request {self.request_id} finished: prompt_tokens={self.num_prompt_tokens} "
                f"completion_tokens={completion} ttft={ttft_text} latency={latency:.3f}s "
                f"prompt_tokens_per_s={prompt_tps:.1f} generation_tokens_per_s={max(gen_tps, 0.0):.1f} "
                f"finish_reason={reasons} x_request_id={self.x_request_id or '-'}")
