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
