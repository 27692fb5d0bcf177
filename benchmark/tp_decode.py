"""Decode steps at tensor-parallel sizes 1 and 2 (dummy weights in a real shape), from CUDA graphs,
beside the per-GPU weight + KV read floor, with the all-reduce's share of the step.

    python -m benchmark.tp_decode [--model llama-3.1-8b] [--tp 1,2,2+fused] [--batches 1,64] [--kv-len 512]
        [--gpu-memory-utilization 0.5] [--quantization fp8] [--kv-cache-dtype fp8]

A step is rank 0's `runner.forward` of `batch` one-token decode rows over `kv-len` cached tokens
each (the step sent to the workers, the graph replayed on every rank, the logits gathered), timed
on the host's clock with the device synchronised after each; median over `--steps`. The floor at
TP = N is the one-GPU floor (`benchmark.floor.decode_step_floor_s`; FP8 weights or KV read as 1
byte) over N: each rank reads its share of the weights and of the KV heads. `N+fused` runs N ranks with FlashInfer's fused
all-reduce + add + RMSNorm (`--enable-flashinfer-allreduce-fusion`); a plain N keeps NCCL's
all-reduce and the norm kernel (`--no-enable-flashinfer-allreduce-fusion`), although the server
takes the fused kernel by default on GPUs that NVLink connects. Rank 0's kernel time per step (the sum over its kernels: what the step costs
with no host or launch gaps) and the all-reduce kernels' share of it (NCCL's or the fused one's)
come from torch.profiler over 10 steps. The engine's step (`engine_step_ms`) is the same decode inside
`LLM.generate`, where overlap scheduling launches a step while the one before runs. Prints a table
and draws it (`tp_decode.png`; `--plot earlier.json` redraws a committed run); writes `tp_decode.json` under
`benchmark/results/local/<GPU>/` (`--out DIR`: DIR/<GPU>/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS
from benchmark.decode_attention import save_rows
from benchmark.floor import ModelShape, measure_rates

PAGE = 16


def decode_step(runner: Any, batch: int, kv_len: int) -> Any:
    """A decode step of `batch` requests at `kv_len`, repeatable: its new rows go to the runner's
    batch here, and the step returned continues them (diff rows), as the scheduler's would."""
    from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
    from flashserve.message.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0)
    per = kv_len // PAGE + 1
    runner.forward(SchedulerOutput([ScheduledRequest(f"r{i}", [1], kv_len, list(range(1 + i * per, 1 + (i + 1) * per)),
                                                     True, params, [1] * kv_len, [1]) for i in range(batch)]))
    return SchedulerOutput([ScheduledRequest(f"r{i}", [1], kv_len, (), True) for i in range(batch)])


def time_steps(runner: Any, step: Any, steps: int) -> float:
    import torch

    for _ in range(5):
        runner.forward(step)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.forward(step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def engine_step_ms(llm: Any, batch: int, kv_len: int, tokens: int) -> float:
    """A decode step inside the engine loop (`LLM.generate`: scheduling, the step sent to the
    workers, overlap scheduling, sampling, outputs): the time of `tokens` + 1 output tokens less
    that of 1, over `tokens`. Each call gets fresh random prompts, so no prefill hits the prefix cache."""
    import random

    from flashserve.message.sampling_params import SamplingParams

    rng = random.Random(batch * 7919 + kv_len)

    def run(n: int) -> float:
        prompts = [[rng.randrange(1000, 100000) for _ in range(kv_len)] for _ in range(batch)]
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    run(4)
    return (run(tokens + 1) - run(1)) / tokens * 1e3


def kernel_time(runner: Any, step: Any) -> tuple[float, float]:
    """Rank 0's kernel time per step (ms; the sum over its kernels, from torch.profiler over 10
    steps) and the all-reduce kernels' share of it (NCCL's, or the fused all-reduce's)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            runner.forward(step)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and not e.key.startswith(("Memcpy", "Memset"))]
    total = sum(e.device_time_total for e in events)
    reduce = sum(e.device_time_total for e in events if "nccl" in e.key.lower() or "allreduce" in e.key.lower())
    return total / 10 / 1e3, reduce / total if total else 0.0


def label(row: dict[str, Any]) -> str:
    return f"TP={row['tp']}{' fused' if row.get('fused') else ''}"


def plot(doc: dict[str, Any], path: Path, model: str) -> None:
    """Bars of each (TP, batch): the step in turn, its kernel time, the engine's step and the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    series = [("step_ms", "step in turn"), ("kernel_ms", "kernel time"), ("engine_step_ms", "engine step (overlap)"),
              ("floor_ms", "floor")]  # fmt: skip
    series = [(key, name) for key, name in series if any(r.get(key) for r in rows)]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(1.6 + 1.8 * len(rows), 3.8))
    for k, (key, name) in enumerate(series):
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))], [r.get(key) or 0 for r in rows],
               width, label=name)  # fmt: skip
    ax.set_xticks(range(len(rows)), [f"{label(r)}, batch {r['batch']}" for r in rows], fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8)
    ax.set_title(f"{doc['gpu']}: {model} (dummy weights), KV of {rows[0]['kv_len']} tokens a request", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes; N+fused: N ranks with the fused all-reduce")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--kv-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--engine-tokens", type=int, default=64, help="decode steps per engine measurement (0: skip it)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="raise for a model near a GPU's size")
    p.add_argument("--quantization", choices=["fp8"], help="FP8 weights (quantized at load); the floor reads them as 1 byte")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: the floor reads KV as 1 byte")
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    p.add_argument("--plot", type=Path, help="only draw the PNG of an earlier run's JSON (no GPU needed)")
    args = p.parse_args(argv)
    if args.plot is not None:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"), args.model)
        return 0
    import torch

    from benchmark.batchllm_bench import free_device
    from benchmark.suite import model_config
    from flashserve.entrypoints.llm import LLM

    gpu = torch.cuda.get_device_name()
    rates = measure_rates("cuda")
    shape = ModelShape.from_config(model_config(args.model))
    # FP8 weights: the projections are read as 1 byte each, the LM head and norms stay bfloat16.
    weight_bytes = shape.weight_bytes - (shape.matmul_params * (shape.dtype_bytes - 1) if args.quantization else 0)
    kv_token_bytes = shape.kv_bytes_per_token // (shape.dtype_bytes if args.kv_cache_dtype == "fp8" else 1)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    print(f"{gpu} x {torch.cuda.device_count()}: {args.model} (dummy weights) decode step, KV of {args.kv_len} tokens "
          f"a request; floor = weights + KV over the ranks / {rates.copy_bytes_per_s / 1e12:.2f} TB/s")
    print(f"{'tp':>9} {'batch':>6} {'step ms':>8} {'kernel ms':>10} {'engine ms':>10} {'floor ms':>9} {'x floor':>8} "
          f"{'all-reduce':>11}")
    for config in args.tp.split(","):
        tp, fused = int(config.removesuffix("+fused")), config.endswith("+fused")
        llm = LLM(args.model, load_format="dummy", tensor_parallel_size=tp, max_num_seqs=max(batches),
                  gpu_memory_utilization=args.gpu_memory_utilization, enable_flashinfer_allreduce_fusion=fused,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        runner: Any = llm.engine.executor
        for batch in batches:
            step = decode_step(runner, batch, args.kv_len)
            ms = time_steps(runner, step, args.steps)
            floor = (weight_bytes + batch * args.kv_len * kv_token_bytes) / rates.copy_bytes_per_s * 1e3 / tp
            kernels_ms, share = kernel_time(runner, step)
            engine_ms = engine_step_ms(llm, batch, args.kv_len, args.engine_tokens) if args.engine_tokens else None
            rows.append({"tp": tp, "fused": fused, "quantization": args.quantization,
                         "kv_cache_dtype": args.kv_cache_dtype, "batch": batch, "kv_len": args.kv_len, "step_ms": ms,
                         "kernel_ms": kernels_ms, "engine_step_ms": engine_ms, "floor_ms": floor,
                         "allreduce_kernel_share": share, "graphs": runner.graphs is not None,
                         "overlap": llm.engine.overlap})  # fmt: skip
            engine = f"{engine_ms:10.3f}" if engine_ms is not None else f"{'-':>10}"
            print(f"{config:>9} {batch:6d} {ms:8.3f} {kernels_ms:10.3f} {engine} {floor:9.3f} {ms / floor:8.2f} "
                  f"{share:11.1%}", flush=True)
        llm.close()
        del llm, runner
        free_device()
    one = {r["batch"]: r for r in rows if r["tp"] == 1}
    for two in (r for r in rows if r["tp"] > 1 and r["batch"] in one):
        base = one[two["batch"]]
        ratios = [f"{key.replace('_', ' ')} {two[key] / base[key]:.2f}x" for key in ("step_ms", "kernel_ms", "engine_step_ms")
                  if base[key] and two[key]]  # fmt: skip
        print(f"batch {two['batch']}, {label(two)} against TP=1: " + ", ".join(ratios))
    path = save_rows(args.out, gpu, "tp_decode.json", rates, rows)
    plot(json.loads(path.read_text()), path.with_suffix(".png"), args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
