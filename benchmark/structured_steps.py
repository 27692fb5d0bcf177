"""Where a structured-output engine step spends its time: 64 requests through the engine directly
(no HTTP), once unconstrained and once under a JSON schema, with the host time of each part of a
step (mask filling, the scheduler's update, launching and collecting the runner's work).

    python -m benchmark.structured_steps --model llama-3.1-8b --tokenizer .whl/llama3-tokenizer

Prints one line per run (each kind twice, the first warms up) and writes JSON under
`benchmark/results/local/<GPU>/structured/steps.json` (`--out DIR`: DIR/<GPU>/...).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS
from benchmark.structured_bench import SCHEMA, prompt


def timed(obj: Any, name: str, timers: dict[str, float], key: str) -> None:
    """Wraps obj.name so that its wall time adds up in timers[key]."""
    inner = getattr(obj, name)

    def wrapper(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args)
        finally:
            timers[key] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokenizer", default=".whl/llama3-tokenizer")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)

    import torch

    from flashserve.message.sampling_params import SamplingParams
    from flashserve.entrypoints.llm import LLM
    from flashserve.message.grammar_spec import GrammarSpec
    from flashserve.structured.compiler import GrammarCompiler

    llm = LLM(args.model, load_format="dummy", tokenizer=args.tokenizer, max_num_seqs=args.requests)
    loaded = llm.stack.loaded
    grammar = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids).compile_sync(
        GrammarSpec("json", json.dumps(SCHEMA), "structured_outputs"))
    timers = dict.fromkeys(("fill", "update", "launch", "collect"), 0.0)
    engine = llm.engine
    timed(grammar, "fill_bitmasks", timers, "fill")
    timed(engine.scheduler, "update", timers, "update")
    timed(engine.executor, "launch", timers, "launch")
    timed(engine.executor, "collect", timers, "collect")
    eos = tuple(loaded.eos_token_ids)
    runs = []
    for label, g in (("unconstrained", None), ("json_schema", grammar)) * 2:
        timers.update(dict.fromkeys(timers, 0.0))
        for i in range(args.requests):
            engine.add_request(f"{label}-{len(runs)}-{i}", loaded.tokenizer.encode(prompt(i)), SamplingParams(
                max_tokens=args.max_tokens, temperature=0.8, seed=i, ignore_eos=g is None, grammar=g,
                eos_token_ids=eos))
        steps = tokens = 0
        t0 = time.perf_counter()
        while engine.has_unfinished:
            outputs = engine.step()
            steps += 1
            tokens += sum(len(o.new_token_ids) for o in outputs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        run = {"kind": label, "steps": steps, "tokens": tokens, "wall_s": wall, "step_ms": 1e3 * wall / steps,
               **{f"{k}_ms_per_step": 1e3 * v / steps for k, v in timers.items()}}
        runs.append(run)
        print(json.dumps(run), flush=True)
    gpu = torch.cuda.get_device_name()
    out = Path(args.out) / gpu.replace(" ", "_") / "structured"
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps({"gpu": gpu, "model": args.model, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
