"""The seed protocol's scheduling model (`benchmark.ttft_model`): at a rate where prompts never
meet, TTFT is a prompt's own compute, and queueing grows the tail with the rate."""

from __future__ import annotations

from benchmark.ttft_model import simulate


def test_lone_prompts_take_their_own_compute_and_load_grows_the_tail() -> None:
    per_token = 0.05  # ms: a 2,048-token prompt in 102.4 ms
    idle = simulate(0.05, per_token, decode_ms=10.0, row_ms=0.0, budget=8192, num_requests=200, seed=0)
    assert 512 * per_token <= idle["median_ttft_ms"] <= 2048 * per_token
    assert idle["p99_ttft_ms"] <= 2048 * per_token + 1e-6
    assert idle["median_itl_ms"] == 10.0
    busy = simulate(6.0, per_token, decode_ms=10.0, row_ms=0.0, budget=8192, num_requests=200, seed=0)
    assert busy["p99_ttft_ms"] > idle["p99_ttft_ms"]


def test_a_chunked_prefill_size_bounds_the_gap_a_stream_waits() -> None:
    """With `chunk` (the scheduler's --chunked-prefill-size) no step that streams wait on holds more
    prompt tokens than it, so no gap exceeds the longer of a decode step and the chunk's compute."""
    per_token = 0.05
    whole = simulate(6.0, per_token, decode_ms=10.0, row_ms=0.0, budget=8192, num_requests=200, seed=0)
    chunked = simulate(6.0, per_token, decode_ms=10.0, row_ms=0.0, budget=8192, num_requests=200, seed=0, chunk=256)
    assert chunked["p99_itl_ms"] <= 256 * per_token + 1e-6 < whole["p99_itl_ms"]


def test_an_additive_step_costs_the_decode_step_plus_its_prompt_tokens() -> None:
    """`additive` (the mixed steps of benchmark.mixed_step): a lone prompt's first token comes after
    the decode step's fixed cost, the prefill step's own and its tokens' compute, all summed."""
    idle = simulate(0.01, 0.05, decode_ms=3.0, row_ms=0.0, budget=8192, num_requests=50, seed=0, additive=True,
                    prefill_step_ms=2.0)
    assert 3.0 + 2.0 + 512 * 0.05 <= idle["median_ttft_ms"] <= 3.0 + 2.0 + 2048 * 0.05


def test_a_late_first_token_lifts_the_chunk_bound() -> None:
    """`deadline_ms`: once a prompt has waited that long for its first token, steps take whole prompts
    again, so the slowest first tokens come sooner than with the bound alone."""
    common = dict(prefill_ms_per_token=0.0105, decode_ms=3.35, row_ms=0.0625, budget=8192, num_requests=1000,
                  seed=0, max_prefill=2048, chunk=1024, additive=True, prefill_step_ms=1.9)
    bound = simulate(24.0, **common)
    lifted = simulate(24.0, deadline_ms=80.0, **common)
    assert lifted["p99_ttft_ms"] < bound["p99_ttft_ms"]


LOG = [
    "2026-11-30 01:56:56,166 INFO flashserve.requests: request cmpl-a finished: prompt_tokens=1000 completion_tokens=1 "
    "ttft=0.101s latency=0.102s prompt_tokens_per_s=1.0 generation_tokens_per_s=0.0 finish_reason=length "
    "x_request_id=-",
    "2026-11-30 01:56:57,000 INFO uvicorn: something else",
    "2026-11-30 01:56:58,166 INFO flashserve.requests: request cmpl-b finished: prompt_tokens=2000 completion_tokens=3 "
    "ttft=0.150s latency=0.200s prompt_tokens_per_s=1.0 generation_tokens_per_s=0.0 finish_reason=length "
    "x_request_id=-",
    "2026-11-30 01:57:20,000 INFO flashserve.requests: request cmpl-c finished: prompt_tokens=512 completion_tokens=2 "
    "ttft=0.050s latency=0.060s prompt_tokens_per_s=1.0 generation_tokens_per_s=0.0 finish_reason=length "
    "x_request_id=-",
]


def test_a_server_log_s_requests_split_into_runs_where_arrivals_pause() -> None:
    from benchmark.ttft_model import logged_runs

    runs = logged_runs(LOG)
    assert [[r["prompt"] for r in run] for run in runs] == [[1000, 2000], [512]]
    assert abs(runs[0][1]["arrival"] - runs[0][0]["arrival"] - 1.902) < 1e-3  # ends minus latencies
    assert runs[0][1]["ttft_ms"] == 150.0 and runs[0][1]["output"] == 3


def test_replayed_arrivals_far_apart_take_their_own_compute() -> None:
    per_token = 0.05
    out = simulate(0.0, per_token, decode_ms=10.0, row_ms=0.0, budget=8192, num_requests=0, seed=0,
                   arrivals=[(0.0, 1000, 2), (5000.0, 2000, 2), (10000.0, 1000, 2)])
    assert out["median_ttft_ms"] == 1000 * per_token and out["p99_ttft_ms"] == 1000 * per_token
