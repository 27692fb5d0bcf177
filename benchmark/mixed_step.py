"""What a prompt chunk costs the streams it shares a step with: engine steps timed by what they carry.

    python -m benchmark.mixed_step --model llama-3.1-8b --batch 48 [--quantization fp8 --kv-cache-dtype fp8] [--tp 2]

Keeps `--batch` streams decoding (dummy weights, prompts of `--context` tokens, no prefix cache, the
server's CUDA graphs and overlap scheduling), then adds one fresh prompt of C tokens at a time, for
each C of `--chunks`, and times every step as a running stream sees it: from the collection of the
step before to its own, the stream's inter-token gap. Per C: the decode steps' gap, the gap of the
step that carries the chunk ("mixed"), and a lone prompt of C tokens in the engine (no streams,
`tp_prefill.ttft_ms`). Beside each gap, the step's time on the device (rank 0's with `--tp`): the
runner's CUDA events from the step's launch to its sampled ids (`ModelRunner.device_seconds`). A
launch that holds the host (an eager step's kernels, a TP step handed to the other ranks) moves time
between two steps' gaps; the device time stays with its step. Were the chunk and the streams free
to share the step's weight reads, the mixed step would take about the longer of the two; run one
after the other, their sum.

With `--profile-chunk C`, one decode step and one mixed step of C tokens run again without overlap
scheduling under the PyTorch profiler: each step's kernels by category and its wall time, whose
difference is host time the device waited for. Prints tables; writes mixed_step.json under `--out`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS


class StepClock:
    """Wraps the engine's schedule and collect: for each step that ran, the time its results came
    back, its time on the device where the executor measures it (`device_seconds`), and its prompt
    tokens (rows of more than one token, or rows that sample nothing)."""

    def __init__(self, engine: Any) -> None:
        # (collected at, device ms or None, prompt tokens, decode rows, prompt tokens that continue a
        # prompt begun before)
        self.records: list[tuple[float, float | None, int, int, int]] = []
        self._pending: list[tuple[int, int, int]] = []
        schedule, collect = engine.scheduler.schedule, engine.executor.collect
        start_timing = getattr(engine.executor, "start_timing", None)
        timed = start_timing is not None and start_timing()

        def timed_schedule() -> Any:
            out = schedule()
            if not out.is_empty:
                chunks = [r for r in out.requests if r.num_new_tokens > 1 or not r.sample]
                self._pending.append((sum(r.num_new_tokens for r in chunks), len(out.requests) - len(chunks),
                                      sum(r.num_new_tokens for r in chunks if r.num_computed_tokens)))
            return out

        def timed_collect(handle: Any) -> Any:
            result = collect(handle)
            device_s = engine.executor.device_seconds(handle) if timed else None
            device_ms = None if device_s is None else device_s * 1e3
            self.records.append((time.perf_counter(), device_ms, *self._pending.pop(0)))
            return result

        engine.scheduler.schedule = timed_schedule
        engine.executor.collect = timed_collect

    def gaps(self) -> list[tuple[float, int, int, int, int, float | None]]:
        """(gap ms, prompt tokens, decode rows, prompt tokens of the step before, continued prompt
        tokens, device ms or None) of each step after the first."""
        r = self.records
        return [((r[i][0] - r[i - 1][0]) * 1e3, r[i][2], r[i][3], r[i - 1][2], r[i][4], r[i][1])
                for i in range(1, len(r))]  # fmt: skip


def median_or_none(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def ms_or_dash(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def kernel_profile(engine: Any, run_step: Any) -> dict[str, Any]:
    """One `run_step()` (a whole engine step, overlap off) under the profiler: wall and kernel ms by category."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmark.tp_prefill import category

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    by_cat: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and not e.key.startswith(("Memcpy", "Memset")):
            by_cat[category(e.key)] += e.device_time_total / 1e3
    kernels = sum(by_cat.values())
    return {"wall_ms": wall, "kernel_ms": kernels, "host_gap_ms": wall - kernels,
            "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1]))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (device times and profile: rank 0's)")
    p.add_argument("--batch", type=int, default=48, help="running streams (the seed protocol's 8B at 24 req/s: about 48)")
    p.add_argument("--context", type=int, default=1280, help="the streams' prompt tokens")
    p.add_argument("--chunks", default="256,512,768,1024,1536,2048")
    p.add_argument("--reps", type=int, default=5, help="mixed steps timed per chunk size")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--piecewise-max-tokens", type=int, default=None, help="default: the server's")
    p.add_argument("--chunked-prefill-size", type=int, default=0,
                   help="the scheduler's: a chunk larger than it runs in steps of its size, the later ones "
                        "continuing a prompt begun before (0: no bound, each chunk in one step)")
    p.add_argument("--profile-chunk", type=int, default=1024, help="0: no profile")
    p.add_argument("--out", default=str(LOCAL_RESULTS))
    args = p.parse_args(argv)
    import torch

    from benchmark.tp_prefill import ttft_ms
    from flashserve.engine.heap import existing_objects_frozen
    from flashserve.entrypoints.llm import LLM
    from flashserve.message.sampling_params import SamplingParams

    chunks = [int(c) for c in args.chunks.split(",")]
    llm = LLM(args.model, load_format="dummy", tensor_parallel_size=args.tp, max_num_seqs=max(64, args.batch + 8), max_model_len=8192,
              gpu_memory_utilization=0.85, cuda_graph=True, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False,
              piecewise_cuda_graph_max_tokens=args.piecewise_max_tokens,
              chunked_prefill_size=args.chunked_prefill_size)  # fmt: skip
    engine = llm.engine
    # Before the clock, with no stream: a prompt of each size the mixed steps start with, in one step.
    lone = {n: ttft_ms(llm, n, reps=5) for n in sorted({min(c, args.chunked_prefill_size or c) for c in chunks})}
    clock = StepClock(engine)
    rng = random.Random(7)
    stream = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(n)]

    def steps(n: int) -> None:
        for _ in range(n):
            engine.step()

    def mixed(c: int, tag: str) -> None:
        engine.add_request(tag, prompt(c), one)
        while not any(o.request_id == tag and o.finished for o in engine.step()):
            pass

    with existing_objects_frozen():
        for i in range(args.batch):
            engine.add_request(f"s{i}", prompt(args.context), stream)
        steps(40)  # every stream's prompt computed, then decoding
        for c in chunks:
            mixed(c, f"warm{c}")
        steps(8)
        start = len(clock.records)
        for rep in range(args.reps):
            for c in chunks:
                steps(6)
                mixed(c, f"m{c}-{rep}")
        steps(4)
    gaps = clock.gaps()[start:]
    decode = [g for g, pt, _, before, _, _ in gaps if pt == 0 and before == 0]
    decode_device_ms = median_or_none([d for _, pt, _, before, _, d in gaps if pt == 0 and before == 0])
    rows = []
    for first in lone:  # each size of a prompt's first chunk
        mix = [g for g, pt, _, _, cont, _ in gaps if pt == first and not cont]
        after = [g for g, pt, _, before, _, _ in gaps if pt == 0 and before == first]
        if mix:
            rows.append({"chunk": first, "mixed_ms": statistics.median(mix), "after_ms": statistics.median(after) if after else None,
                         "lone_ms": lone[first], "samples": len(mix),
                         "mixed_device_ms": median_or_none([d for _, pt, _, _, cont, d in gaps if pt == first and not cont])})  # fmt: skip
    continued: dict[int, list[float]] = defaultdict(list)  # steps that continue a prompt, by their prompt tokens
    for g, pt, _, _, cont, _ in gaps:
        if cont:
            continued[pt].append(g)
    decode_ms = statistics.median(decode)
    profiles: dict[str, Any] = {}
    if args.profile_chunk:
        engine.overlap, overlap = False, engine.overlap
        steps(3)
        profiles["decode step"] = kernel_profile(engine, engine.step)
        first = min(args.profile_chunk, args.chunked_prefill_size or args.profile_chunk)
        profiles[f"mixed step of {first} fresh prompt tokens"] = kernel_profile(
            engine, lambda: (engine.add_request("prof", prompt(args.profile_chunk), one), engine.step()))
        if first < args.profile_chunk:  # the prompt's next chunk, over the pages of its first
            rest = min(args.profile_chunk - first, args.chunked_prefill_size)
            profiles[f"mixed step of {rest} prompt tokens after {first}"] = kernel_profile(engine, engine.step)
        steps(2)
        engine.overlap = overlap
    for i in range(args.batch):
        engine.abort(f"s{i}")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    fmt = f", {args.quantization} weights, {args.kv_cache_dtype} KV" if args.quantization else ""
    lines = [f"{gpu}: {args.model}{fmt} (dummy weights), TP {args.tp}, {args.batch} streams of {args.context}+ tokens "
             f"decoding; decode step gap median {decode_ms:.2f} ms ({len(decode)} steps), on the device "
             f"{ms_or_dash(decode_device_ms)} ms", "",
             "| chunk tokens | mixed step gap ms | mixed step on the device ms | decode + lone prompt ms "
             "| mixed / (decode + lone) | next step gap ms |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        both = decode_ms + r["lone_ms"]
        lines.append(f"| {r['chunk']} | {r['mixed_ms']:.2f} | {ms_or_dash(r['mixed_device_ms'])} | {decode_ms:.2f} + "
                     f"{r['lone_ms']:.2f} | {r['mixed_ms'] / both:.2f} | {ms_or_dash(r['after_ms'])} |")
    if continued:
        lines += ["", "| prompt tokens of a step continuing a prompt | steps | gap ms |", "|---|---|---|"]
        lines += [f"| {pt} | {len(g)} | {statistics.median(g):.2f} |" for pt, g in sorted(continued.items())]
    for name, prof in profiles.items():
        lines += ["", f"{name}, without overlap: wall {prof['wall_ms']:.2f} ms, kernels {prof['kernel_ms']:.2f} ms, host gap {prof['host_gap_ms']:.2f} ms",
                  "", "| category | ms |", "|---|---|"]  # fmt: skip
        lines += [f"| {c} | {ms:.2f} |" for c, ms in prof["by_category_ms"].items()]
    report = "\n".join(lines)
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixed_step.json").write_text(json.dumps({"gpu": gpu, "args": vars(args), "decode_ms": decode_ms,
                                                     "decode_device_ms": decode_device_ms, "rows": rows,
                                                     "continued_ms": {pt: statistics.median(g) for pt, g in continued.items()},
                                                     "profiles": profiles, "report": report}, indent=1))  # fmt: skip
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
