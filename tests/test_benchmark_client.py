"""The serving benchmark client, measured against a fake OpenAI server with known timing."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmark/` lives at the repo root

from benchmark import serve_bench  # noqa: E402
from benchmark.client import EndpointConfig, LoadResult, RequestResult, arrival_offsets, run_load  # noqa: E402
from benchmark.goodput import search_goodput  # noqa: E402
from benchmark.metrics import build_summary, summarize  # noqa: E402
from benchmark.plots import plot_concurrency, plot_request_rate  # noqa: E402
from benchmark.workloads import PromptSpec, build_phases, fixed_requests, random_requests  # noqa: E402
from fake_openai_server import MODEL_ID, FakeConfig, FakeServer  # noqa: E402

TOKEN_IDS = PromptSpec("token_ids")


@pytest.fixture(scope="module")
def _server():
    server = FakeServer(FakeConfig(ttft_s=0.0, itl_s=0.0))
    server.start()
    # Warm-up, as serve_bench does: the first use of each endpoint's HTTP path is slow.
    load(server, 2, 2)
    load(server, 2, 2, endpoint="chat")
    yield server
    server.stop()


@pytest.fixture
def server(_server: FakeServer) -> FakeServer:
    _server.reset()
    return _server


def load(server: FakeServer, n: int, out: int, endpoint: str = "completions", **kw) -> LoadResult:
    spec = PromptSpec("text" if endpoint == "chat" else "token_ids")
    cfg = EndpointConfig(server.base_url, MODEL_ID, endpoint)  # type: ignore[arg-type]
    return asyncio.run(run_load(cfg, fixed_requests(n, 8, out, spec, seed=0), **kw))


# --- timing ---------------------------------------------------------------------------------------


def test_ttft_itl_and_tpot_match_the_servers_delays(server):
    server.config = FakeConfig(ttft_s=0.05, itl_s=0.01)
    m = summarize(load(server, 3, 12, concurrency=1))
    assert (m["completed"], m["failed"]) == (3, 0)
    assert m["ttft_ms"]["median"] == pytest.approx(50, abs=15)
    assert m["itl_ms"]["mean"] == pytest.approx(10, abs=5)
    assert m["itl_ms"]["median"] == pytest.approx(10, abs=5)
    assert m["tpot_ms"]["median"] == pytest.approx(10, abs=5)
    assert m["e2e_ms"]["median"] == pytest.approx(50 + 11 * 10, abs=25)
    assert m["total_output_tokens"] == 36 and m["output_len_mismatch"] == 0


def test_chat_endpoint_ignores_the_role_chunk_when_timing_ttft(server):
    server.config = FakeConfig(ttft_s=0.05, itl_s=0.01)
    m = summarize(load(server, 2, 6, endpoint="chat", concurrency=1))
    assert m["completed"] == 2
    assert m["ttft_ms"]["median"] == pytest.approx(50, abs=15)
    assert m["total_output_tokens"] == 12


def test_usage_chunk_gives_prompt_tokens_and_counted_chunks_stand_in_without_it(server):
    server.config = FakeConfig(ttft_s=0.0, itl_s=0.001, num_tokens=7)
    with_usage = load(server, 1, 5).results[0]
    assert (with_usage.prompt_len, with_usage.output_tokens, with_usage.output_len) == (8, 7, 5)
    server.config = FakeConfig(ttft_s=0.0, itl_s=0.001, mode="no_usage")
    no_usage = load(server, 1, 5).results[0]
    assert no_usage.success and no_usage.output_tokens == 5


# --- load -----------------------------------------------------------------------------------------


def test_throughput_at_concurrency_4_matches_the_expected_rate(server):
    server.config = FakeConfig(ttft_s=0.05, itl_s=0.01)
    m = summarize(load(server, 16, 20, concurrency=4))
    per_request_s = 0.05 + 19 * 0.01
    assert server.max_in_flight == 4
    assert m["request_throughput"] == pytest.approx(4 / per_request_s, rel=0.15)
    assert m["output_token_throughput"] == pytest.approx(20 * 4 / per_request_s, rel=0.15)


def test_poisson_arrival_gaps_have_the_requested_mean_rate():
    offsets = arrival_offsets(4000, 20.0, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert 1 / gaps.mean() == pytest.approx(20.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: cv = 1
    assert arrival_offsets(10, 20.0, seed=0) == offsets[:10]  # seeded: the same schedule every run


def test_requests_are_sent_on_the_poisson_schedule(server):
    server.config = FakeConfig(ttft_s=0.0, itl_s=0.001, num_tokens=2)
    result = load(server, 40, 2, request_rate=40.0, seed=3)
    starts = sorted(r.start_s for r in result.results)
    expected = arrival_offsets(40, 40.0, seed=3)
    assert max(abs(a - b) for a, b in zip(starts, expected)) < 0.03
    assert 39 / starts[-1] == pytest.approx(40.0, rel=0.5)


def test_worker_processes_keep_the_arrival_schedule(server):
    server.config = FakeConfig(ttft_s=0.0, itl_s=0.001, num_tokens=2)
    result = load(server, 24, 2, request_rate=40.0, seed=3, workers=2)
    assert summarize(result)["completed"] == 24
    starts = [r.start_s for r in result.results]
    assert max(abs(a - b) for a, b in zip(starts, arrival_offsets(24, 40.0, seed=3))) < 0.03


def test_worker_processes_share_the_concurrency_cap(server):
    server.config = FakeConfig(ttft_s=0.02, itl_s=0.005)
    result = load(server, 12, 10, concurrency=3, workers=2)
    assert summarize(result)["completed"] == 12 and server.max_in_flight == 3


# --- goodput --------------------------------------------------------------------------------------


def test_goodput_search_lands_within_one_step_below_the_boundary():
    async def measure(rate: float) -> dict:
        return {"completed": 10, "failed": 0, "ttft_ms": {"p99": 100.0 if rate <= 37.3 else 500.0}}

    result = asyncio.run(search_goodput(measure, 200.0, start_rate=1.0, step=0.5))
    assert 37.3 - 0.5 <= result.rate <= 37.3
    assert all(p.passed == (p.rate <= 37.3) for p in result.probes)


def test_goodput_search_finds_the_rate_a_serialised_prefill_can_sustain(server):
    prefill_s, n, slo_ms, step = 0.04, 16, 80.0, 2.0
    server.config = FakeConfig(ttft_s=0.0, itl_s=0.002, num_tokens=2, prefill_s=prefill_s)
    cfg = EndpointConfig(server.base_url, MODEL_ID)
    reqs = fixed_requests(n, 8, 2, TOKEN_IDS, seed=0)

    async def measure(rate: float) -> dict:
        return summarize(await run_load(cfg, reqs, request_rate=rate, arrivals="constant"))

    result = asyncio.run(search_goodput(measure, slo_ms, start_rate=12.0, step=step))
    # Above 1/prefill the queue grows by (prefill - 1/rate) per request; the last of n requests
    # waits (n - 1) of those: P99 TTFT = prefill + (n - 1)(prefill - 1/rate) <= SLO.
    boundary = 1 / (prefill_s - (slo_ms / 1000 - prefill_s) / (n - 1))
    assert boundary - step - 1.5 <= result.rate <= boundary + 0.5
    assert result.metrics is not None and result.metrics["ttft_ms"]["p99"] <= slo_ms


# --- failures -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, kind",
    [("malformed", "malformed"), ("error_event", "error_event"), ("http_500", "http_500"),
     ("no_done", "no_done"), ("drop", "truncated")],
)
def test_broken_streams_count_as_failures_with_their_kind(server, mode, kind):
    server.config = FakeConfig(ttft_s=0.0, itl_s=0.002, mode=mode)
    result = load(server, 3, 6, concurrency=3)
    assert [r.error_kind for r in result.results] == [kind] * 3
    m = summarize(result)
    assert (m["completed"], m["failed"], m["error_kinds"]) == (0, 3, {kind: 3})
    assert m["output_token_throughput"] == 0 and m["ttft_ms"]["median"] is None


def test_unreachable_server_counts_as_connection_failure():
    cfg = EndpointConfig("http://127.0.0.1:9", MODEL_ID)
    result = asyncio.run(run_load(cfg, fixed_requests(2, 4, 4, TOKEN_IDS, seed=0)))
    assert [r.error_kind for r in result.results] == ["connection", "connection"]


def test_failed_requests_are_excluded_from_throughput_and_latency():
    ok = RequestResult(10, 3, success=True, output_tokens=3, ttft_s=0.1, itl_s=[0.02, 0.02], e2e_s=0.14)
    bad = RequestResult(10, 3, error_kind="http_503", error="busy")
    m = summarize(LoadResult([ok, bad], duration_s=2.0))
    assert (m["completed"], m["failed"], m["error_kinds"]) == (1, 1, {"http_503": 1})
    assert m["output_token_throughput"] == 1.5 and m["input_token_throughput"] == 5.0
    assert m["ttft_ms"]["median"] == pytest.approx(100) and m["tpot_ms"]["median"] == pytest.approx(20)


# --- workloads ------------------------------------------------------------------------------------


def test_token_id_prompts_have_exact_lengths_and_fixed_seeds():
    a = random_requests(50, 2048, 256, 0.25, TOKEN_IDS, seed=1)
    assert a == random_requests(50, 2048, 256, 0.25, TOKEN_IDS, seed=1)
    assert all(len(r.prompt) == r.prompt_len for r in a)
    assert all(1536 <= r.prompt_len <= 2560 and 192 <= r.output_len <= 320 for r in a)


def test_sglang_lengths_are_drawn_up_to_the_named_length_as_its_bench_serving_does():
    rnd = build_phases("random", TOKEN_IDS, request_rates=(12.0,), num_requests=400, lengths="sglang")[0]
    ins, outs = [r.prompt_len for r in rnd.requests], [r.output_len for r in rnd.requests]
    assert 1536 <= min(ins) and max(ins) <= 2048 and 192 <= min(outs) and max(outs) <= 256
    assert abs(sum(ins) / len(ins) - 1792) < 30  # mean 1,792: SGLang's "2048/256 x0.75"
    top = build_phases("max_throughput", TOKEN_IDS, num_requests=400, lengths="sglang")[0]
    assert all(512 <= r.prompt_len <= 1024 and 128 <= r.output_len <= 256 for r in top.requests)


def test_range_ratio_draws_the_seed_protocols_lengths_as_sglang_bench_serving_does():
    # SGLang's --random-range-ratio 0.25 on 2048/256: inputs uniform in [512, 2048], outputs in [64, 256].
    rnd = build_phases("random", TOKEN_IDS, request_rates=(4.0,), num_requests=1000, range_ratio=0.25)[0]
    ins, outs = [r.prompt_len for r in rnd.requests], [r.output_len for r in rnd.requests]
    assert 512 <= min(ins) < 560 and 2000 < max(ins) <= 2048 and 64 <= min(outs) < 70 and 250 < max(outs) <= 256
    assert abs(sum(ins) / len(ins) - 1280) < 40 and abs(sum(outs) / len(outs) - 160) < 6


def test_workloads_have_the_shapes_of_performance_md():
    lat = build_phases("latency", TOKEN_IDS, repeats=3)
    assert [(p.name, p.concurrency, p.rounds, len(p.requests)) for p in lat] == [("bs1", 1, 3, 3), ("bs8", 8, 3, 24)]
    assert {(r.prompt_len, r.output_len) for r in lat[1].requests} == {(32, 128)}
    conc = build_phases("concurrency", PromptSpec("text"))
    assert [p.concurrency for p in conc] == [5, 10, 25, 50, 100]
    assert {r.output_len for p in conc for r in p.requests} == {384}
    off = build_phases("offline", TOKEN_IDS)
    assert {(r.prompt_len, r.output_len) for r in off[0].requests} == {(512, 128)}
    assert len(off[1].requests) == 256 and all(100 <= r.output_len <= 1024 for r in off[1].requests)
    rnd = build_phases("random", TOKEN_IDS, request_rates=(2.0, 4.0), num_requests=8)
    assert [(p.request_rate, len(p.requests)) for p in rnd] == [(2.0, 8), (4.0, 8)]


# --- results --------------------------------------------------------------------------------------


def test_cli_writes_a_result_json_and_merges_the_summary(server, tmp_path, capsys):
    server.config = FakeConfig(ttft_s=0.005, itl_s=0.0005)
    results = tmp_path / "results"
    argv = ["--base-url", server.base_url, "--workload", "latency", "--repeats", "1", "--gpu-name", "Test GPU",
            "--out-dir", str(results / "test-gpu"), "--summary-path", str(results / "summary.json"),
            "--no-progress", "--warmup", "1"]
    assert serve_bench.main(argv) == 0
    (path,) = (results / "test-gpu").glob("latency-flashserve-*.json")
    doc = json.loads(path.read_text())
    assert (doc["workload"], doc["label"], doc["gpu"], doc["model"]) == ("latency", "flashserve", "Test GPU", MODEL_ID)
    assert [p["name"] for p in doc["phases"]] == ["bs1", "bs8"]
    assert doc["phases"][1]["metrics"]["completed"] == 8 and len(doc["git_commit"]) >= 7
    assert doc["settings"]["prompt_kind"] == "token_ids"
    assert "bs8_e2e_mean_ms" in doc["headline"] and doc["phases"][0]["metrics"]["client_busy"] > 0
    summary = json.loads((results / "summary.json").read_text())
    assert summary["workloads"]["latency"]["Test GPU"]["systems"]["flashserve"]["headline"] == doc["headline"]
    assert "bs1" in capsys.readouterr().out


def test_summary_reports_ratio_to_floor_and_speedup_vs_peers(tmp_path):
    def write(label: str, headline: dict, ts: str = "2025-01-01T00:00:00+00:00") -> Path:
        path = tmp_path / f"{label}-{ts[:10]}.json"
        path.write_text(json.dumps({"workload": "goodput", "label": label, "gpu": "H200", "timestamp": ts,
                                    "headline": headline}))
        return path

    paths = [write("flashserve", {"goodput_req_per_s": 5.0, "itl_median_ms": 9.0}),
             write("flashserve", {"goodput_req_per_s": 10.0, "itl_median_ms": 4.0}, "2025-02-01T00:00:00+00:00"),
             write("vllm", {"goodput_req_per_s": 8.0, "itl_median_ms": 5.0}),
             write("floor", {"itl_median_ms": 3.5})]
    block = build_summary(paths)["workloads"]["goodput"]["H200"]
    assert block["systems"]["flashserve"]["headline"]["goodput_req_per_s"] == 10.0  # latest wins
    assert block["ratio_to_floor"] == {"itl_median_ms": pytest.approx(4.0 / 3.5)}
    assert block["speedup_vs_vllm"] == {"goodput_req_per_s": pytest.approx(1.25), "itl_median_ms": pytest.approx(1.25)}


def test_plots_draw_several_systems_on_the_same_axes(tmp_path):
    def metrics(x: float) -> dict:
        d = {"mean": x, "median": x, "p90": x, "p99": x}
        return {"ttft_ms": d, "tpot_ms": d, "itl_ms": d, "output_token_throughput": 100 * x}

    docs = [{"workload": "concurrency", "label": label, "gpu": "g", "timestamp": "t",
             "phases": [{"concurrency": c, "request_rate": None, "metrics": metrics(c * k)} for c in (5, 10)]}
            for label, k in (("flashserve", 1), ("vllm", 2))]
    docs.append({"workload": "goodput", "label": "flashserve", "gpu": "g", "timestamp": "t", "phases": [],
                 "goodput": {"slo_ms": 200, "probes": [{"rate": r, "metrics": metrics(r)} for r in (2, 4)]}})
    for path in (plot_concurrency(docs, tmp_path / "c.png"), plot_request_rate(docs, tmp_path / "r.png")):
        assert path is not None and path.read_bytes()[:4] == b"\x89PNG"
