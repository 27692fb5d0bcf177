"""Where a run-batch run spends its time, beside `LLM.generate` on the same engine (BatchLLM's shape).

    python -m benchmark.run_batch_timeline               # 1B dummy, 100 groups x 16, 2000 + 200 in, 100 out
    MODEL=embedded SHAPE=49152,4,4,64,16,8 python -m benchmark.run_batch_timeline   # a quick CPU check

Two `LLM.generate` rounds (groups) and then the same shape through run-batch, with every engine step
timed. The app process is timed too: this module wraps a few of `flashserve.entrypoints.run_batch.app`'s functions
when it is imported, and a spawned process imports the parent's main module first, so the wrappers
are in place in both processes. Prints when the app process started, imported, got its setup and
ran; when its requests reached the engine and its results were written; how long the engine waited
for requests with nothing to do; and writes `engine_timeline.json` and `app_timeline.json` under
`$OUT` (default /tmp). SHAPE is vocabulary, groups, prompts per group, shared, own tokens, tokens out.
"""

from __future__ import annotations

import json
import os
import sys
import time

T_IMPORT = time.time()
OUT = os.environ.get("OUT", "/tmp")

import flashserve.entrypoints.run_batch.app as ba  # noqa: E402

APP: dict = {"t_import": T_IMPORT, "t_batch_app_imported": time.time(), "admits": [], "results": []}
_main, _run_lines, _admit, _result_line = ba.main, ba.run_lines, ba.BatchEngineClient._admit, ba.result_line


def _timed_main(reader, writer, done):  # type: ignore[no-untyped-def]
    APP["t_main"], APP["torch_at_main"] = time.time(), "torch" in sys.modules
    try:
        _main(reader, writer, done)
    finally:
        APP["t_end"] = time.time()
        with open(os.path.join(OUT, "app_timeline.json"), "w") as f:
            json.dump(APP, f)


async def _timed_run_lines(*args, **kwargs):  # type: ignore[no-untyped-def]
    APP["t_run0"] = time.time()
    try:
        return await _run_lines(*args, **kwargs)
    finally:
        APP["t_run1"] = time.time()


def _timed_admit(self, add):  # type: ignore[no-untyped-def]
    APP["admits"].append(time.time())
    return _admit(self, add)


def _timed_result_line(*args, **kwargs):  # type: ignore[no-untyped-def]
    APP["results"].append(time.time())
    return _result_line(*args, **kwargs)


ba.main, ba.run_lines, ba.BatchEngineClient._admit, ba.result_line = (
    _timed_main, _timed_run_lines, _timed_admit, _timed_result_line)


def main() -> None:
    import bisect
    import random
    import tempfile
    from pathlib import Path

    from flashserve.engine.engine_core import EngineCore
    from flashserve.entrypoints.llm import LLM

    from benchmark.batchllm_bench import group_prompts, offline, run_batch

    receives: list[tuple[float, float, bool, int]] = []  # (start, end, idle wait, outputs it made)
    receive = EngineCore._receive

    def timed_receive(self, wait_for):  # type: ignore[no-untyped-def]
        t0 = time.time()
        outputs = receive(self, wait_for)
        if outputs or wait_for is None:
            receives.append((t0, time.time(), wait_for is None, len(outputs)))
        return outputs

    EngineCore._receive = timed_receive
    model = os.environ.get("MODEL", "llama-3.2-1b")
    if model == "embedded":
        llm = LLM()
        model = llm.stack.loaded.name
    else:
        llm = LLM(model, cascade_attention="off", load_format="dummy", max_num_seqs=1024, gpu_memory_utilization=0.4)
    steps: list[tuple[float, float, int]] = []
    step = llm.engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        t0 = time.time()
        outs = step()
        steps.append((t0, time.time(), len(outs)))
        return outs

    llm.engine.step = timed_step
    *shape, out_tokens = (int(x) for x in os.environ.get("SHAPE", "128256,100,16,2000,200,100").split(","))
    rng = random.Random(0)
    doc: dict = {}
    for r in range(2):
        steps.clear()
        res = offline(llm, group_prompts(rng, *shape), out_tokens, True)
        doc[f"generate{r}"] = {**res, "steps": len(steps), "stepping_s": sum(b - a for a, b, _ in steps)}
        print(f"LLM.generate round {r}: {res['requests_per_s']:.1f} requests/s, {len(steps)} steps, "
              f"{doc[f'generate{r}']['stepping_s']:.2f} s stepping, {res['wall_s']:.2f} s in all", flush=True)
    steps.clear()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        rb = run_batch(llm, group_prompts(rng, *shape), out_tokens, model, Path(tmp))
    doc["run_batch"] = {**rb, "t0": t0, "steps": steps, "receives": receives}
    with open(os.path.join(OUT, "engine_timeline.json"), "w") as f:
        json.dump(doc, f)
    with open(os.path.join(OUT, "app_timeline.json")) as f:
        app = json.load(f)

    def rel(t: float) -> str:
        return f"{t - t0:.2f} s"

    admits, results = app["admits"], app["results"]
    print(f"run-batch: the whole call {rb['wall_s']:.2f} s ({rb['requests_per_s']:.1f} requests/s), the run "
          f"{rb['run_s']:.2f} s ({rb['run_requests_per_s']:.1f} requests/s)")
    print(f"app process: main module imported at {rel(app['t_batch_app_imported'])} (torch imported: "
          f"{app['torch_at_main']}), setup awaited from {rel(app['t_main'])}, run {rel(app['t_run0'])} to {rel(app['t_run1'])}")
    print(f"requests reached the engine: first {rel(admits[0])}, half {rel(admits[len(admits) // 2])}, last {rel(admits[-1])}")
    print(f"engine: {len(steps)} steps from {rel(steps[0][0])} to {rel(steps[-1][1])}, "
          f"{sum(b - a for a, b, _ in steps):.2f} s stepping")
    idle = [(a, b) for a, b, wait, _ in receives if wait and a >= steps[0][0]]
    print(f"engine idle, waiting for requests, once running: {sum(b - a for a, b in idle):.2f} s in {len(idle)} waits")
    for q in (0.1, 0.25, 0.5, 0.75, 1.0):
        i = min(int(q * len(results)), len(results) - 1)
        print(f"{q:.0%} of results written at {rel(results[i])}; requests in the engine by then: "
              f"{bisect.bisect(admits, results[i])}")


if __name__ == "__main__":
    main()
