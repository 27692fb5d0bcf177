"""/metrics also under vLLM's names, for routers, endpoint pickers and dashboards built for vLLM."""

from __future__ import annotations

import httpx

from flashserve.metrics import Metrics, StepStats
from production_helpers import MODEL, completion, metric, serve_engine


def test_vllm_names_report_the_same_counts_as_ours_with_the_model_name() -> None:
    with serve_engine() as stack:
        for prompt_len in (3, 20):
            assert httpx.post(f"{stack.url}/v1/completions", json=completion(4, prompt=[1] * prompt_len)).is_success
        text = httpx.get(f"{stack.url}/metrics").text
    for ours, theirs in (("flashserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("flashserve_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("flashserve_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
                         ("flashserve_e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
                         ("flashserve_num_requests_running", "vllm:num_requests_running"),
                         ("flashserve_num_requests_waiting", "vllm:num_requests_waiting")):
        assert metric(text, theirs, model_name=MODEL) == metric(text, ours), theirs
    assert metric(text, "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 2


def test_kv_cache_usage_is_the_fraction_of_pages_held_by_requests() -> None:
    metrics = Metrics(model_name="m")
    metrics.record_step(StepStats(num_running=3, num_waiting=5, kv_pages_used=30, kv_pages_free=90))
    text = metrics.render().decode()
    assert metric(text, "vllm:kv_cache_usage_perc", model_name="m") == 0.25
    assert metric(text, "vllm:gpu_cache_usage_perc", model_name="m") == 0.25
    assert metric(text, "vllm:num_requests_waiting", model_name="m") == 5


def test_kv_cache_usage_is_zero_before_the_first_step() -> None:
    text = Metrics(model_name="m").render().decode()
    assert metric(text, "vllm:kv_cache_usage_perc", model_name="m") == 0.0
