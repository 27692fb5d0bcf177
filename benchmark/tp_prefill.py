"""A lone prompt's prefill under tensor parallelism against its compute floor, and where its time goes.

    python -m benchmark.tp_prefill [--model llama-3.1-70b] [--tp 4] [--lens 512,2048,8192] [--profile-len 2048]

Dummy weights in a real shape. For each prompt length:
- `step ms`: rank 0's `runner.forward` of the whole prompt as one step (what the ranks compute for
  it, no chunking), median of 5 (more for prompts under 1,024 tokens, `step_repeats`) after 5
  unrecorded, the device synchronised after each; eager, or
  with `--graphs` from the piecewise CUDA graphs where they cover the prompt, as the server runs it;
- `TTFT ms`: `LLM.generate(max_tokens=1)` of a fresh random prompt (the engine's scheduling, its
  chunked-prefill budget and sampling included), median of 3;
- `floor ms`: its FLOPs per GPU (`benchmark.floor.prefill_floor_s` over the ranks) at the bf16 matmul
  rate measured in this run, or the per-GPU weight read where that is longer.

Then torch.profiler on rank 0 over 3 steps of `--profile-len` tokens: kernel time by category
(GEMM, all-reduce, attention, norm, RoPE, activation, other), the host gap (step wall time less the
sum of its kernels, unprofiled), the GPU's idle time within the profiled steps and its longest gaps
with the operations on either side, and the GEMMs by per-rank shape with their achieved TFLOP/s. Writes
`tp_prefill.json`, `tp_prefill.md` (the tables) and the profiled steps' Chrome trace under `--out`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS
from benchmark.floor import ModelShape, first_token_floor_s, measure_rates
from benchmark.tp_decode import time_steps

PAGE = 16
# Kernel name -> category, first match wins (cuBLAS/cuBLASLt Hopper GEMMs: nvjet, sm90_xmma, cutlass).
CATEGORIES = [
    ("all-reduce", re.compile(r"nccl|allreduce|all_reduce|lamport", re.I)),
    ("attention", re.compile(r"prefill|decode|attention|mergestate|merge_state|paged|AppendPagedKV", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|sm90_|splitk", re.I)),
    ("norm", re.compile(r"rmsnorm|norm", re.I)),
    ("rope", re.compile(r"rope|rotary", re.I)),
    ("activation", re.compile(r"act_and_mul|silu", re.I)),
]


def category(name: str) -> str:
    return next((c for c, pattern in CATEGORIES if pattern.search(name)), "other")


def prefill_step(n: int, seed: int) -> Any:
    from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
    from flashserve.message.sampling_params import SamplingParams

    rng = random.Random(seed)
    ids = [rng.randrange(1000, 100000) for _ in range(n)]
    pages = list(range(1, 2 + n // PAGE))
    return SchedulerOutput([ScheduledRequest("p", ids, 0, pages, True, SamplingParams(temperature=0.0), ids, [])])


def step_repeats(n: int) -> int:
    """Timed steps of an `n`-token prompt: 5 from 1,024 tokens, more below (at most 40)."""
    return 5 if n >= 1024 else min(40, 5 * 1024 // max(n, 1))


def ttft_ms(llm: Any, n: int, reps: int = 3) -> float:
    from flashserve.message.sampling_params import SamplingParams

    rng = random.Random(n)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(reps + 1):  # the first one unrecorded
        prompt = [rng.randrange(1000, 100000) for _ in range(n)]
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def gemm_flops(shapes: list[list[int]], name: str) -> float:
    """2*M*N*K of an aten::mm ([M,K],[K,N]) or aten::addmm (bias, [M,K],[K,N]) call; 0 if unknown."""
    dims = [s for s in shapes if len(s) == 2]
    if len(dims) < 2:
        return 0.0
    (m, k), (_, n) = dims[0], dims[1]
    return 2.0 * m * n * k


def device_idle(ops: list[tuple[float, float, str]], steps: int, top: int = 5) -> dict[str, Any]:
    """Where rank 0's GPU did nothing within the profiled steps: `ops` are its device operations
    (start us, end us, name), kernels, copies and memsets on every stream. Their union's gaps, from
    the first start to the last end, per step; and the `top` longest gaps with the operations on
    either side (a gap at a step's start follows the previous step's last operation)."""
    ops = sorted(ops)
    gaps: list[tuple[float, str, str]] = []
    end, last = ops[0][1], ops[0][2]
    for start, stop, name in ops[1:]:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    idle_us = sum(g[0] for g in gaps)
    return {"idle_ms": idle_us / 1e3 / steps, "span_ms": (end - ops[0][0]) / 1e3 / steps,
            "longest_gaps": [{"ms": g / 1e3, "after": a[:80], "before": b[:80]}
                             for g, a, b in sorted(gaps, key=lambda g: -g[0])[:top]]}  # fmt: skip


def device_ops(prof: Any) -> list[tuple[float, float, str]]:
    """The profiler's device operations (kernels, copies, memsets): (start us, end us, name)."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type.name == "CUDA" and not e.name.startswith("nccl:")]  # fmt: skip


def profile_step(runner: Any, step: Any, out: Path, steps: int = 3) -> dict[str, Any]:
    """Rank 0's kernels of `steps` forward steps by category and by GEMM shape, and the host gap."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    wall_ms = time_steps(runner, step, 5)  # unprofiled: the profiler's own host work would count as gaps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            runner.forward(step)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / "tp_prefill_trace.json"))
    by_cat: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        # "nccl:all_reduce" and the like: c10d's annotations of a collective, whose device time is
        # its kernel's (counted once, under the kernel's name)
        if e.device_type.name != "CUDA" or e.key.startswith(("Memcpy", "Memset", "nccl:")):
            continue
        by_cat[category(e.key)] += e.device_time_total / 1e3 / steps
        kernels[e.key][0] += e.device_time_total / 1e3 / steps
        kernels[e.key][1] += e.count // steps
    gemms = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in ("aten::mm", "aten::addmm", "aten::_scaled_mm") and e.device_time_total > 0:
            ms = e.device_time_total / 1e3 / steps
            flops = gemm_flops(e.input_shapes, e.key) * e.count / steps
            gemms.append({"op": e.key, "shapes": e.input_shapes, "calls": e.count // steps, "ms": ms,
                          "TFLOP_per_s": flops / (ms / 1e3) / 1e12 if ms else 0.0})  # fmt: skip
    kernel_ms = sum(by_cat.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    try:  # not yet run on a GPU: a failure here names itself rather than costing the profile
        ops = device_ops(prof)
        idle: dict[str, Any] | None = device_idle(ops, steps) if ops else None
    except Exception as exc:  # noqa: BLE001 - reported in the results
        idle = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return {"tokens": len(step.requests[0].new_token_ids) if hasattr(step, "requests") else None,
            "wall_ms": wall_ms, "kernel_ms": kernel_ms, "host_gap_ms": wall_ms - kernel_ms,
            "device_idle": idle,
            "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "gemms": sorted(gemms, key=lambda g: -g["ms"]),
            "top_kernels": [{"name": k[:120], "ms": v[0], "calls": v[1]} for k, v in top]}  # fmt: skip


def tables(doc: dict[str, Any]) -> str:
    fmt = f", {doc['quantization']} weights, {doc['kv_cache_dtype']} KV" if doc.get("quantization") else ""
    if doc.get("prefill_backend"):
        fmt += f", {doc['prefill_backend']} prefill"
    if doc.get("graphs"):
        fmt += f", CUDA graphs (piecewise up to {doc.get('piecewise_max_tokens') or 'the default'} tokens)"
    if doc.get("overlap_min_tokens"):
        fmt += f", all-reduces overlapped in two chunks from {doc['overlap_min_tokens']} tokens"
        fmt += " by copy engines" if doc.get("overlap_comm") == "copy-engine" else " (NCCL)"
    lines = [f"{doc['gpu']} x {doc['tp']}: {doc['model']}{fmt} (dummy weights), a lone prompt at TP={doc['tp']}; "
             f"bf16 matmul {doc['rates']['matmul_TFLOP_per_s']:.0f} TFLOP/s, copy {doc['rates']['copy_GB_per_s']:.0f} GB/s",
             "", "| prompt | step ms | TTFT ms (engine) | floor ms | step / floor | TTFT / floor |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in doc["rows"]:
        lines.append(f"| {r['tokens']} | {r['step_ms']:.1f} | {r['ttft_ms']:.1f} | {r['floor_ms']:.1f} | "
                     f"{r['step_ms'] / r['floor_ms']:.2f} | {r['ttft_ms'] / r['floor_ms']:.2f} |")  # fmt: skip
    p = doc.get("profile")
    if p:
        lines += ["", f"Rank 0, one {doc['profile_len']}-token step: wall {p['wall_ms']:.1f} ms, kernels {p['kernel_ms']:.1f} ms, "
                  f"host gap {p['host_gap_ms']:.1f} ms", "", "| category | ms | share of kernels |", "|---|---|---|"]  # fmt: skip
        for c, ms in p["by_category_ms"].items():
            lines.append(f"| {c} | {ms:.2f} | {ms / p['kernel_ms']:.1%} |")
        idle = p.get("device_idle")
        if idle and "error" in idle:
            lines += ["", f"GPU idle within the profiled steps: not measured ({idle['error']})"]
        elif idle:
            lines += ["", f"GPU idle within the profiled steps (every stream; copies and memsets count as busy): "
                      f"{idle['idle_ms']:.2f} ms a step of {idle['span_ms']:.1f}; the longest gaps:", "",
                      "| gap ms | after | before |", "|---|---|---|"]  # fmt: skip
            for g in idle["longest_gaps"]:
                lines.append(f"| {g['ms']:.3f} | {g['after']} | {g['before']} |")
        lines += ["", "| GEMM (per-rank shapes) | calls | ms | TFLOP/s |", "|---|---|---|---|"]
        for g in p["gemms"][:12]:
            lines.append(f"| {g['op']} {g['shapes']} | {g['calls']} | {g['ms']:.2f} | {g['TFLOP_per_s']:.0f} |")
        lines += ["", "| kernel | calls | ms |", "|---|---|---|"]
        for k in p["top_kernels"]:
            lines.append(f"| {k['name']} | {k['calls']} | {k['ms']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-70b")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--lens", default="512,2048,8192")
    p.add_argument("--profile-len", type=int, default=2048, help="0: no profile")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--fused", choices=("auto", "on", "off"), default="auto", help="the fused all-reduce")
    p.add_argument("--quantization", default=None, help="fp8: FP8 weights (dynamic activations)")
    p.add_argument("--prefill-backend", choices=("fa2", "fa3"), default=None,
                   help="FlashInfer's prefill kernels at TP 1 (default: the server's, attention/flashinfer.py PREFILL_BACKEND)")
    p.add_argument("--overlap-min-tokens", type=int, default=None,
                   help="--tp-overlap-min-tokens: steps this large run in two chunks, all-reduces overlapped")
    p.add_argument("--overlap-comm", choices=("nccl", "copy-engine"), default="nccl",
                   help="--tp-overlap-comm: what carries the overlapped all-reduces")
    p.add_argument("--kv-cache-dtype", default="auto", help="fp8: an FP8 KV cache")
    p.add_argument("--graphs", action="store_true", help="capture the server's CUDA graphs (decode, and the "
                   "piecewise graphs that serve steps of up to --piecewise-max-tokens); default: every step eager")
    p.add_argument("--piecewise-max-tokens", type=int, default=None,
                   help="--piecewise-cuda-graph-max-tokens with --graphs (default: the server's)")
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)
    import torch

    from benchmark.suite import model_config
    from flashserve.entrypoints.llm import LLM

    if args.prefill_backend is not None:  # before any backend is built (this process: at TP 1 only)
        from flashserve.attention import flashinfer as flashinfer_backend

        flashinfer_backend.PREFILL_BACKEND = args.prefill_backend
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = measure_rates("cuda")
    shape = ModelShape.from_config(model_config(args.model))
    lens = [int(n) for n in args.lens.split(",")]
    fused = {"auto": None, "on": True, "off": False}[args.fused]
    # By default no graphs: the prompts here are prefills (and sample one token), and capturing takes
    # time. --graphs: as the server runs them, steps of few tokens from the piecewise graphs.
    llm = LLM(args.model, load_format="dummy", tensor_parallel_size=args.tp, max_num_seqs=16,
              max_model_len=max(lens) + 64, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_flashinfer_allreduce_fusion=fused, cuda_graph=args.graphs, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, tp_overlap_min_tokens=args.overlap_min_tokens,
              tp_overlap_comm=args.overlap_comm,
              piecewise_cuda_graph_max_tokens=args.piecewise_max_tokens)  # fmt: skip
    runner: Any = llm.engine.executor
    doc: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "tp": args.tp, "model": args.model,
                           "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                           "overlap_min_tokens": args.overlap_min_tokens, "overlap_comm": args.overlap_comm,
                           "prefill_backend": args.prefill_backend,
                           "graphs": args.graphs, "piecewise_max_tokens": args.piecewise_max_tokens,
                           "rates": rates.to_json(), "profile_len": args.profile_len, "rows": []}  # fmt: skip
    for n in lens:
        floor = first_token_floor_s(shape, rates, [n]) * 1e3 / args.tp
        # Short steps vary by a few tenths of a millisecond: more of them, so that the median holds.
        row = {"tokens": n, "step_ms": time_steps(runner, prefill_step(n, n), step_repeats(n)),
               "ttft_ms": ttft_ms(llm, n), "floor_ms": floor}  # fmt: skip
        doc["rows"].append(row)
        print(f"{n:6d} tokens: step {row['step_ms']:.1f} ms, TTFT {row['ttft_ms']:.1f} ms, floor {floor:.1f} ms "
              f"({row['step_ms'] / floor:.2f}x, {row['ttft_ms'] / floor:.2f}x)", flush=True)  # fmt: skip
    if args.profile_len:
        doc["profile"] = profile_step(runner, prefill_step(args.profile_len, 7), out)
    llm.close()
    (out / "tp_prefill.json").write_text(json.dumps(doc, indent=1))
    text = tables(doc)
    (out / "tp_prefill.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
