"""The server's metrics again under vLLM's names, beside its own on every `/metrics`.

Routers and autoscalers written for vLLM read these names: the Kubernetes Gateway API Inference
Extension's endpoint picker (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`), vLLM's
production-stack router and its Grafana dashboards. Served always, not behind a flag: they cost a
few lines of text per scrape, and a flag would be one more thing to get wrong when deploying.

Nothing is counted twice: the collector reads the server's own metric objects when scraped and
renames their samples (`flashserve_prompt_tokens_total` -> `vllm:prompt_tokens_total`), adding the
`model_name` label that vLLM's metrics carry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from flashserve.metrics import Metrics

# vLLM's name -> the attribute of `Metrics` that holds the same figure.
RENAMED = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:request_success": "finished",
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:e2e_request_latency_seconds": "e2e",
    "vllm:request_queue_time_seconds": "queue_time",
}
# vLLM's labels where ours are named otherwise.
LABELS = {"finish_reason": "finished_reason"}
# The KV cache's fill, 0 to 1: `kv_cache_usage_perc` in vLLM v1, `gpu_cache_usage_perc` before it
# (still what older endpoint pickers read).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class VllmNames(Collector):
    """Collects `metrics`' figures under vLLM's names, labelled with the served model's name."""

    def __init__(self, metrics: Metrics, model_name: str) -> None:
        self.metrics = metrics
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for name, attribute in RENAMED.items():
            for family in getattr(self.metrics, attribute).collect():
                yield self._renamed(family, name)
        used = _value(self.metrics.kv_pages_used)
        total = used + _value(self.metrics.kv_pages_free)
        for name in KV_USAGE:
            gauge = GaugeMetricFamily(name, "KV cache usage, 1 means full", labels=["model_name"])
            gauge.add_metric([self.model_name], used / total if total else 0.0)
            yield gauge

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are only known when collected; don't let the registry collect early

    def _renamed(self, family: Metric, name: str) -> Metric:
        renamed = Metric(name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            labels = {LABELS.get(k, k): v for k, v in sample.labels.items()}
            labels["model_name"] = self.model_name
            renamed.add_sample(name + sample.name[len(family.name):], labels, sample.value, sample.timestamp,
                               sample.exemplar)
        return renamed


def _value(gauge: object) -> float:
    samples = [sample for family in gauge.collect() for sample in family.samples]  # type: ignore[attr-defined]
    return samples[0].value if samples else 0.0
