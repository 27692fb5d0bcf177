"""Speculative decoding's metrics, ours and under vLLM's names, and the acceptance log line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from flashserve.engine import speculative
from flashserve.engine.loop import StepRecorder
from flashserve.engine.outputs import SampledTokens, ScheduledRequest
from flashserve.engine.request import Request
from flashserve.message.sampling_params import SamplingParams
from flashserve.metrics import Metrics
from flashserve.spec_decode.config import SpeculativeConfig
from flashserve.spec_decode.stats import SpecDecodeStats


def recorder_with(stats: SpecDecodeStats) -> tuple[StepRecorder, Metrics]:
    kv = SimpleNamespace(num_used_pages=0, num_free_pages=8, num_cached_pages=0)
    scheduler = SimpleNamespace(running=[], waiting=[], kv_cache=kv, num_preemptions=0, num_running=0,
                                num_waiting=0, prefix_cache=SimpleNamespace(num_queries=0, num_hits=0),
                                spec_stats=stats)
    engine = SimpleNamespace(scheduler=scheduler, loras=SimpleNamespace(enabled=False))
    metrics = Metrics(model_name="m")
    return StepRecorder(engine, metrics), metrics  # type: ignore[arg-type]


def test_acceptance_counts_show_under_vllms_names_with_a_position_label():
    stats = SpecDecodeStats()
    recorder, metrics = recorder_with(stats)
    stats.record(4, 2)
    stats.record(3, 3)
    recorder.record([], 0.0)
    text = metrics.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 7.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0' in text
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0'
            in text)
    assert 'flashserve_spec_decode_num_accepted_tokens_total{engine="0"} 5.0' in text


def test_each_step_adds_only_what_it_verified():
    stats = SpecDecodeStats()
    recorder, metrics = recorder_with(stats)
    stats.record(4, 4)
    recorder.record([], 0.0)
    recorder.record([], 0.0)  # nothing new
    stats.record(4, 1)
    recorder.record([], 0.0)
    text = metrics.render().decode()
    assert 'flashserve_spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 2.0' in text
    assert 'flashserve_spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 1.0' in text
    assert 'flashserve_spec_decode_num_drafts_total{engine="0"} 2.0' in text


def test_the_log_reports_the_mean_accepted_length_periodically(caplog, monkeypatch):
    monkeypatch.setattr(speculative, "LOG_INTERVAL_S", 0.0)
    speculator = speculative.Speculator(SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=2))
    request = Request("r", [1, 2, 3], SamplingParams())
    request.num_computed_tokens = 8
    row = ScheduledRequest("r", [3, 4, 5, 6, 7], 3, (), True, num_draft_tokens=4)
    with caplog.at_level(logging.INFO, logger="flashserve.engine.speculative"):
        speculator.verified(request, row, SampledTokens([4, 5, 9]))
    assert "mean accepted length 3.00" in caplog.text
    assert "per position 1.00, 1.00, 0.00, 0.00" in caplog.text
