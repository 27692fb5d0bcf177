"""The server's metrics again under vLLM's names, beside its own on every `/metrics`.

Routers and autoscalers written for vLLM read these names: the Kubernetes Gateway API Inference
Extension's endpoint picker (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:lora_requests_info`), vLLM's
production-stack router and its Grafana dashboards. Served always, not behind a flag: they cost a
few lines of text per scrape, and a flag would be one more thing to get wrong when deploying.

Nothing is counted twice: at each scrape the families `/metrics` is about to show (this process's,
or every process's under `flashserve serve`) are renamed (`flashserve_prompt_tokens_total` ->
`vllm:prompt_tokens_total`), with the `model_name` label that vLLM's metrics carry added.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

# Our family's name -> vLLM's.
RENAMED = {
    "flashserve_num_requests_running": "vllm:num_requests_running",
    "flashserve_num_requests_waiting": "vllm:num_requests_waiting",
    "flashserve_num_preemptions": "vllm:num_preemptions",
    "flashserve_prefix_cache_queries": "vllm:prefix_cache_queries",
    "flashserve_prefix_cache_hits": "vllm:prefix_cache_hits",
    "flashserve_prompt_tokens": "vllm:prompt_tokens",
    "flashserve_generation_tokens": "vllm:generation_tokens",
    "flashserve_requests_finished": "vllm:request_success",
    "flashserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "flashserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "flashserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "flashserve_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "flashserve_lora_requests_info": "vllm:lora_requests_info",
    "flashserve_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "flashserve_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "flashserve_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "flashserve_spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
# vLLM's labels where ours are named otherwise.
LABELS = {"finish_reason": "finished_reason"}
# The KV cache's fill, 0 to 1: `kv_cache_usage_perc` in vLLM v1, `gpu_cache_usage_perc` before it
# (still what older endpoint pickers read).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def vllm_families(families: Iterable[Metric], model_name: str) -> list[Metric]:
    """`families` (as a registry collects them) under vLLM's names, labelled `model_name`."""
    out: list[Metric] = []
    pages: dict[str, dict[tuple, float]] = {"used": defaultdict(float), "free": defaultdict(float)}
    for family in families:
        if family.name in RENAMED:
            out.append(_renamed(family, RENAMED[family.name], model_name))
        for kind in pages:
            if family.name == f"flashserve_kv_pages_{kind}":
                for sample in family.samples:  # per engine, where there are several
                    pages[kind][tuple(sorted(sample.labels.items()))] += sample.value
    for name in KV_USAGE:
        gauge = GaugeMetricFamily(name, "KV cache usage, 1 means full")
        for labels in pages["used"].keys() | pages["free"].keys():
            used, total = pages["used"][labels], pages["used"][labels] + pages["free"][labels]
            gauge.add_sample(name, {**dict(labels), "model_name": model_name}, used / total if total else 0.0)
        out.append(gauge)
    return out


def _renamed(family: Metric, name: str, model_name: str) -> Metric:
    renamed = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = {LABELS.get(k, k): v for k, v in sample.labels.items()}
        labels["model_name"] = model_name
        renamed.add_sample(name + sample.name[len(family.name):], labels, sample.value, sample.timestamp,
                           sample.exemplar)
    return renamed
