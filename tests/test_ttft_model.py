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
