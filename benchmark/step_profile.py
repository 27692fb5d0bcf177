"""Where an engine step's time goes on the host, for a batch of decode-heavy requests.

    python -m benchmark.step_profile --model llama-3.2-1b --batch 256 --prompt 512 --output 128

Runs B requests of P prompt tokens and O output tokens (dummy weights, token-id prompts) through
`LLM`, timing each host phase of every step (schedule, launch, collect, update, outputs), then
profiles the decode steps with cProfile and prints the functions that take the most host time.
`collect` is mostly waiting for the device; the rest is host work the device may wait for.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from collections import defaultdict
from typing import Any, Callable


def timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--overlap", choices=["on", "off", "both"], default="both",
                   help="overlap scheduling in the timed runs; both: one run with it, then one without")
    args = p.parse_args()

    from flashserve.engine.heap import existing_objects_frozen
    from flashserve.message.sampling_params import SamplingParams
    from flashserve.entrypoints.llm import LLM

    llm = LLM(args.model, load_format="dummy", max_num_seqs=args.batch, max_num_batched_tokens=8192)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)

    def run(prefix: str) -> tuple[int, float]:
        for i in range(args.batch):
            engine.add_request(f"{prefix}{i}", [(7 * i + j) % 1000 + 1 for j in range(args.prompt)], params)
        steps, t0 = 0, time.perf_counter()
        # As `LLM.generate` and the engine core step: with the objects alive before frozen, so that
        # the collector's full passes do not walk the model's and libraries' objects every time.
        with existing_objects_frozen():
            while engine.has_unfinished:
                engine.step()
                steps += 1
        return steps, time.perf_counter() - t0

    run("warm")  # kernels, graphs and caches warm
    totals: dict[str, float] = defaultdict(float)
    gc_start: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            totals[f"garbage collection, generation {info['generation']}"] += time.perf_counter() - gc_start.pop()

    gc.callbacks.append(on_gc)
    sched, runner = engine.scheduler, engine.executor
    sched.schedule = timed(totals, "schedule", sched.schedule)
    sched.update = timed(totals, "update", sched.update)
    runner.launch = timed(totals, "launch", runner.launch)
    runner.collect = timed(totals, "collect (waits for the device)", runner.collect)
    runner.forward = timed(totals, "  forward", runner.forward)
    runner.sampler.sample_ids = timed(totals, "  sample_ids", runner.sampler.sample_ids)
    runner.backend.plan = timed(totals, "    backend.plan", runner.backend.plan)
    if runner.graphs is not None:
        runner.graphs = timed(totals, "    graph replay (with its plan)", runner.graphs)
        runner.backend.plan_cuda_graph = timed(totals, "      plan_cuda_graph", runner.backend.plan_cuda_graph)
    engine._process = timed(totals, "outputs (detokenize, stop strings)", engine._process)
    for overlap in {"on": [True], "off": [False], "both": [True, False]}[args.overlap]:
        engine.overlap = overlap
        totals.clear()
        steps, wall = run(f"timed-{overlap}")
        print(f"{args.batch} x {args.prompt} in / {args.output} out, overlap scheduling {'on' if overlap else 'off'}: "
              f"{steps} steps in {wall:.3f} s, {args.batch * args.output / wall:.0f} output tok/s, "
              f"{wall / steps * 1e3:.3f} ms per step")
        for name, total in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {name:40s} {total / steps * 1e3:7.3f} ms per step")
    gc.callbacks.remove(on_gc)
    print("  (launch includes forward, which includes the graph replay or plan + eager forward, then sample_ids)")
    profiler = cProfile.Profile()
    profiler.enable()
    run("prof")
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
