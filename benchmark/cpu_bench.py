"""flashserve against plain transformers on a CPU, same weights (the embedded SmolLM2-135M GGUF).

Rows: prefill of one prompt (flashserve's model in one step, flashserve's engine at its default
step budget, transformers' forward with SDPA), decode steps at batch 1 and 8 (flashserve's engine,
transformers' forward over its own cache, one step of each in turn), each against the CPU's floor measured in the same run (prefill FLOPs
at the fp32 matmul rate, weights + KV read per decode step at the copy bandwidth). Then the
largest gap between two tokens of a running stream while a long prompt arrives, and the time
`flashserve serve` takes from process start to /health 200.

    python -m benchmark.cpu_bench [--prompts 2000 4000] [--batches 1 8] [--no-serve-startup]

Prints a table and writes benchmark/results/local/cpu/cpu_bench.json. Run it on a quiet machine: the
JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from benchmark import LOCAL_RESULTS
from benchmark.floor import ModelShape, decode_step_floor_s, first_token_floor_s, measure_rates
from benchmark.server_process import free_port, stop

OUT_DIR = LOCAL_RESULTS / "cpu"
DECODE_PROMPT = 128
DECODE_TOKENS = 32


def random_prompt(n: int, gen: torch.Generator) -> list[int]:
    """Fresh random ids, so that no prompt hits the prefix cache of an earlier one."""
    return torch.randint(100, 49000, (n,), generator=gen).tolist()


def serve_startup_s(timeout_s: float = 120.0, env: dict[str, str] | None = None, poll_s: float = 0.1) -> float | None:
    """Seconds from starting `flashserve serve` (in `env`, default this process's) to its first
    /health 200, polled every `poll_s` (None: it never came)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "flashserve", "serve", "--port", str(port), "--log-level", "warning"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while time.perf_counter() - t0 < timeout_s and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        return None
    finally:
        stop(proc)


def one_step_prefill_s(stack: Any, n: int, gen: torch.Generator) -> float:
    """The model alone: one step holding the whole prompt, on the cache's last (free) pages."""
    from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
    from flashserve.message.sampling_params import SamplingParams

    pages = list(range(stack.num_pages - (n + stack.page_size - 1) // stack.page_size, stack.num_pages))
    ids = random_prompt(n, gen)
    request = ScheduledRequest("one-step", ids, 0, pages, True, SamplingParams(temperature=0.0), ids, [])
    runner = stack.engine.executor
    t0 = time.perf_counter()
    runner.execute(SchedulerOutput([request]))
    return time.perf_counter() - t0


def engine_ttft_s(engine: Any, n: int, gen: torch.Generator) -> float:
    """Prompt of n tokens through the engine at its step budget, to its first token."""
    from flashserve.message.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(uuid.uuid4().hex, random_prompt(n, gen), SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - t0


def decode_ms(engine: Any, model: torch.nn.Module, batch: int, gen: torch.Generator) -> tuple[float, float]:
    """Median decode step (ms) of flashserve's engine and of transformers (its forward over its own
    cache, the loop `generate` runs, with SDPA), `batch` requests each, one step of each in turn:
    a 2-core VM's speed drifts within seconds, and alternating steps puts both under the same drift."""
    from flashserve.message.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=DECODE_TOKENS + 8, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(uuid.uuid4().hex, random_prompt(DECODE_PROMPT, gen), params)
    while any(not out.new_token_ids for out in engine.step()):  # prefills, then a first decode step
        pass
    ids = torch.tensor([random_prompt(DECODE_PROMPT, gen) for _ in range(batch)])
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    ours, theirs = [], []
    for _ in range(DECODE_TOKENS):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        with torch.inference_mode():
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        ours.append(t1 - t0)
        theirs.append(time.perf_counter() - t1)
    while engine.has_unfinished:
        engine.step()
    return 1e3 * statistics.median(ours), 1e3 * statistics.median(theirs)


def largest_gap(engine: Any, prompt_len: int, gen: torch.Generator) -> dict[str, float]:
    """One stream decodes; a prompt of `prompt_len` tokens arrives. Gaps between the stream's tokens."""
    from flashserve.message.sampling_params import SamplingParams

    stream = uuid.uuid4().hex
    engine.add_request(stream, random_prompt(32, gen), SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    arrivals: list[float] = []
    long_id, long_done_after = None, None
    while long_done_after is None or len(arrivals) < long_done_after + 3:
        for out in engine.step():
            if out.request_id == stream and out.new_token_ids:
                arrivals.append(time.perf_counter())
            if out.request_id == long_id and out.finished:
                long_done_after = len(arrivals)
        if long_id is None and len(arrivals) >= 8:
            long_id = uuid.uuid4().hex
            engine.add_request(long_id, random_prompt(prompt_len, gen), SamplingParams(max_tokens=1, temperature=0.0))
            arrived = len(arrivals)
    engine.abort(stream)
    while engine.has_unfinished:
        engine.step()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"normal_gap_s": statistics.median(gaps[: arrived - 1]), "largest_gap_s": max(gaps[arrived - 1 :])}


def hf_prefill_s(model: torch.nn.Module, n: int, gen: torch.Generator) -> float:
    ids = torch.tensor([random_prompt(n, gen)])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=ids, logits_to_keep=1)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.cpu_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[2000, 4000])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--gap-prompt", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3, help="runs per cell, interleaved (the best is kept)")
    p.add_argument("--no-serve-startup", dest="serve_startup", action="store_false")
    p.add_argument("--out", type=Path, default=OUT_DIR / "cpu_bench.json")
    args = p.parse_args(argv)

    from flashserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from flashserve.entrypoints.llm import build_engine
    from flashserve.model_loader.loader import load_model

    gen = torch.Generator().manual_seed(0)
    doc: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                           "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "load_avg_before": os.getloadavg()}
    if args.serve_startup:
        doc["serve_startup_s"] = serve_startup_s()
    rates = measure_rates("cpu", cpu_copy_bytes=512 << 20, cpu_matmul_n=2048)
    doc["rates"] = rates.to_json()
    t0 = time.perf_counter()
    stack = build_engine(ModelConfig(device="cpu"), CacheConfig(), SchedulerConfig())
    doc["engine_build_s"] = time.perf_counter() - t0
    doc["step_budget"] = stack.max_num_batched_tokens
    hf = load_model(ModelConfig(device="cpu"), "cpu").model
    doc["hf_attention"] = hf.config._attn_implementation
    shape = ModelShape.from_config(hf.config, dtype_bytes=4)

    rows: list[dict[str, Any]] = []
    for n in args.prompts:
        # The best of `--repeat` runs each, interleaved, so that a slow moment hits every column alike.
        runs: dict[str, list[float]] = {"flashserve_one_step": [], "flashserve_engine": [], "transformers": []}
        for _ in range(args.repeat):
            runs["flashserve_one_step"].append(one_step_prefill_s(stack, n, gen))
            runs["flashserve_engine"].append(engine_ttft_s(stack.engine, n, gen))
            runs["transformers"].append(hf_prefill_s(hf, n, gen))
        rows.append({"work": f"prefill, {n:,} tokens", "unit": "s", **{k: min(v) for k, v in runs.items()},
                     "floor": first_token_floor_s(shape, rates, [n])})  # fmt: skip
    for b in args.batches:
        ctx = [DECODE_PROMPT + DECODE_TOKENS] * b
        ours, theirs = [], []
        for _ in range(args.repeat):
            mine, hf_ms = decode_ms(stack.engine, hf, b, gen)
            ours.append(mine)
            theirs.append(hf_ms)
        rows.append({"work": f"decode, batch {b}", "unit": "ms/step", "flashserve_engine": min(ours),
                     "transformers": min(theirs), "floor": 1e3 * decode_step_floor_s(shape, rates, ctx)})  # fmt: skip
    doc["rows"] = rows
    doc["gap"] = {"prompt_tokens": args.gap_prompt, **largest_gap(stack.engine, args.gap_prompt, gen)}
    doc["load_avg_after"] = os.getloadavg()

    print(f"CPU: {doc['machine']}, {doc['cpus']} cores, torch {doc['torch']} ({doc['threads']} threads); "
          f"copy {rates.copy_bytes_per_s / 1e9:.1f} GB/s, fp32 matmul {rates.matmul_flop_per_s / 1e9:.0f} GFLOP/s; "
          f"step budget {doc['step_budget']} tokens")
    print("| work | flashserve (one step) | flashserve (engine) | transformers | floor |")
    print("|---|---|---|---|---|")
    for r in rows:
        one = f"{r['flashserve_one_step']:.2f}" if "flashserve_one_step" in r else "-"
        print(f"| {r['work']} ({r['unit']}) | {one} | {r['flashserve_engine']:.2f} | {r['transformers']:.2f} | {r['floor']:.2f} |")
    g = doc["gap"]
    print(f"largest gap of a running stream while a {g['prompt_tokens']:,}-token prompt arrives: "
          f"{g['largest_gap_s']:.2f} s (normal gap {1e3 * g['normal_gap_s']:.0f} ms)")
    if args.serve_startup:
        print(f"flashserve serve: healthy {doc['serve_startup_s']} s after process start")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
