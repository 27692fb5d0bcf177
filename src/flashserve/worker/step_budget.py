"""The default size of a step: the tokens it may compute (`--max-num-batched-tokens`) and the
requests it may hold (`--max-num-seqs`).

A step's prefill chunk delays every running stream's next token by the step's time. On a GPU
2048 tokens take milliseconds; on a CPU they take seconds (SmolLM2-135M: about 7 s on 2 cores),
so there the budget comes from the rate the runner actually reaches at start-up: as many
tokens as fit in `CPU_STEP_SECONDS`. A loaded machine measures a lower rate and gets a smaller,
still safe, budget.

A GPU of 70 GiB or more (H100, H200; not the A100, where a larger budget measured slower in vLLM)
takes 8,192 tokens and 1,024 requests a step, vLLM's defaults for its server there. On one H100
with the 8B these raised the SGLang-drawn max-throughput workload from 5,574 to 5,913 output tok/s
and cut P99 TTFT at 12 req/s from 345 to 307 ms, at the price of longer worst gaps in running
streams (ITL P99 63 -> 106 ms): `benchmark/results/NVIDIA_H100_80GB_HBM3/serve_8b/one_gpu/`.
"""

from __future__ import annotations

import logging
import time

from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.message.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GPU_STEP_TOKENS = 2048
# `SchedulerConfig.max_prefill_tokens` on a GPU: about one prompt of the seed protocol's longest.
# Modelled (`benchmark.ttft_model --max-prefill-tokens`) at the H200's measured step costs, it cut
# P99 TTFT at 4 req/s of the 70B from 417 to 345 ms and at 16 req/s of the 8B from 249 to 194 ms;
# measured on one H200 at 16 req/s of the 8B, P99 TTFT stayed (226 -> 225 ms: the P99 requests came
# in bursts no admission order serves faster) and P99 ITL fell from 84 to 56 ms.
GPU_MAX_PREFILL_TOKENS = 2048
GPU_MAX_NUM_SEQS = 256
LARGE_GPU_BYTES = 70 * 2**30
LARGE_GPU_STEP_TOKENS = 8192
LARGE_GPU_MAX_NUM_SEQS = 1024
# Target time of one CPU step at short context. Attention grows with the context, so a chunk late
# in a 2,000-token prompt takes about 1.5x this; the largest gap of a running stream stays well
# under a second.
CPU_STEP_SECONDS = 0.4
# The least a CPU step may hold: below it a step's fixed costs (every weight read once, the
# host's work) outweigh its tokens, as on a machine that is busy while it measures.
CPU_MIN_STEP_TOKENS = 64
# A CPU step in which no stream waits (prefills only) may hold this many tokens: chunking a lone
# prompt there only adds time (4,000 tokens: 17.0 s in chunks of 160 against 10.9 s in one step).
CPU_PREFILL_ONLY_TOKENS = 8192
# Tokens of the timed prefill: enough for the matmuls to reach their rate, little start-up time.
_PROBE_TOKENS = 128
_PROBE_ID = "step-budget-probe"


def budget_from_rate(seconds_per_token: float, page_size: int, step_seconds: float = CPU_STEP_SECONDS) -> int:
    """Tokens that fit in `step_seconds`, rounded down to whole pages, within [64, 2048]."""
    tokens = int(step_seconds / seconds_per_token) // page_size * page_size
    return max(CPU_MIN_STEP_TOKENS, min(GPU_STEP_TOKENS, tokens))


def measure_prefill_seconds_per_token(runner: object, num_pages: int, page_size: int) -> float:
    """Times prefill steps of `_PROBE_TOKENS` tokens on free KV pages (the best of two, after a
    short step that warms the allocator), in seconds per token. Run before the engine starts:
    it writes into pages the KV cache manager has not handed out yet."""
    pages = list(range(1, 1 + min(num_pages - 1, -(-_PROBE_TOKENS // page_size))))
    tokens = [1] * min(_PROBE_TOKENS, len(pages) * page_size)
    params = SamplingParams(temperature=0.0)

    def step(n: int) -> float:
        request = ScheduledRequest(_PROBE_ID, tokens[:n], 0, pages, True, params, tokens[:n], [])
        t0 = time.perf_counter()
        runner.execute(SchedulerOutput([request]))  # type: ignore[attr-defined]
        return time.perf_counter() - t0

    step(page_size)
    seconds = min(step(len(tokens)) for _ in range(2)) / len(tokens)
    # No scheduler releases the probe's row: the step that drops it, as one would.
    runner.execute(SchedulerOutput([], finished_ids=[_PROBE_ID]))  # type: ignore[attr-defined]
    return seconds


def large_gpu(device: object) -> bool:
    """Whether `device` (a torch.device or a --device name: "auto", "cuda:1", "cpu") is a CUDA
    device of `LARGE_GPU_BYTES` or more that is not an A100. A name that no available GPU answers
    is not one; the code that picks the device reports that."""
    import torch

    name = "cuda" if str(device) == "auto" else str(device)
    if not name.startswith("cuda") or not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(torch.device(name))
    return props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower()


def default_max_num_seqs(large: bool) -> int:
    """Requests a step may hold: `LARGE_GPU_MAX_NUM_SEQS` on a `large_gpu`, else `GPU_MAX_NUM_SEQS`
    (CPUs included)."""
    return LARGE_GPU_MAX_NUM_SEQS if large else GPU_MAX_NUM_SEQS


def default_step_budget(runner: object, device_type: str, num_pages: int, page_size: int,
                        large: bool = False) -> int:
    """On CUDA `LARGE_GPU_STEP_TOKENS` for a `large` GPU, else `GPU_STEP_TOKENS`; on a CPU the
    tokens that take about `CPU_STEP_SECONDS`."""
    if device_type == "cuda":
        return LARGE_GPU_STEP_TOKENS if large else GPU_STEP_TOKENS
    t0 = time.perf_counter()
    per_token = measure_prefill_seconds_per_token(runner, num_pages, page_size)
    budget = budget_from_rate(per_token, page_size)
    logger.info(
        "step budget %d tokens (--max-num-batched-tokens): prefill runs at %.0f tokens/s here, so a step "
        "takes about %.2f s (measured in %.1f s)", budget, 1 / per_token, budget * per_token, time.perf_counter() - t0,
    )  # fmt: skip
    return budget


def default_prefill_only_budget(device_type: str, budget: int) -> int | None:
    """The budget of steps without a waiting stream: on a CPU a whole prompt of up to 8,192 tokens
    (never less than `budget`); on a GPU the step budget (None), where chunks cost little."""
    return max(budget, CPU_PREFILL_ONLY_TOKENS) if device_type == "cpu" else None


def default_max_prefill_tokens(device_type: str) -> int:
    """`GPU_MAX_PREFILL_TOKENS` on a GPU; 0 (no bound) on a CPU, whose step budget is smaller."""
    return GPU_MAX_PREFILL_TOKENS if device_type == "cuda" else 0
