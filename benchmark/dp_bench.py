"""Data parallelism on one node: one engine against `--data-parallel-size 2`, then prefix routing
on and off, each server started once and run under its workloads in turn.

    python -m benchmark.dp_bench --model llama-3.1-8b --out DIR [--tokenizer .whl/llama3-tokenizer] [--workers 4]

- one:      max_throughput (512 x 1024/256 +-50%, all at once); random 2048/256 at RATE req/s
- dp2:      the same, random at 2 x RATE (target: >= 1.8x the throughput, P99 TTFT as at RATE);
            shared_prefix with 32 groups x 16 (2048-token group prefix + 128-token question)
- dp2-load: shared_prefix 32 x 16 with --data-parallel-routing load (least load only)

Each server's /metrics (per-engine labels) and, on GPUs, `nvidia-smi`'s processes are saved beside
the serve_bench results, and every 5 s of each run its engines' running and waiting requests and
token counters (`progress-<server>-<run>.txt`); `dp.json` holds the table and the ratios. Stops before a server whose runs
would pass `--budget-s`, keeping what it has.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmark.server_configs import bench, start_server
from benchmark.server_process import stop

# (label, serve flags, [(run name, serve_bench args)]); RATE is replaced by --rate.
PLAN: list[tuple[str, list[str], list[tuple[str, list[str]]]]] = [
    ("one", [], [("max_throughput", ["--workload", "max_throughput"]),
                 ("random", ["--workload", "random", "--request-rate", "RATE"])]),
    ("dp2", ["--data-parallel-size", "2"], [
        ("max_throughput", ["--workload", "max_throughput"]),
        ("random", ["--workload", "random", "--request-rate", "2RATE"]),
        ("shared_prefix", ["--workload", "shared_prefix", "--concurrency", "32"])]),
    ("dp2-load", ["--data-parallel-size", "2", "--data-parallel-routing", "load"], [
        ("shared_prefix", ["--workload", "shared_prefix", "--concurrency", "32"])]),
]
# Seconds a server takes to start and warm up once the kernels are built (the first pays for them).
START_S = 45.0
# Seconds each run takes on H100s (8B): 512 x 256 out at ~5k tok/s; 256 arrivals at 8 req/s; 512 x 2k.
RUN_S = {"max_throughput": 35.0, "random": 40.0, "shared_prefix": 40.0}


def figures(result: dict | None) -> dict:
    if not result or not result.get("phases"):
        return {}
    m = result["phases"][0]["metrics"]
    return {"output_tok_s": m["output_token_throughput"], "total_tok_s": m["total_token_throughput"],
            "p99_ttft_ms": m["ttft_ms"]["p99"], "median_ttft_ms": m["ttft_ms"]["median"],
            "median_itl_ms": m["itl_ms"]["median"], "completed": m["completed"], "failed": m["failed"]}


def save_state(base: str, label: str, out: Path) -> None:
    """The server's /metrics and, on GPUs, which process holds which GPU."""
    try:
        (out / f"metrics-{label}.txt").write_text(httpx.get(f"{base}/metrics", timeout=10).text)
    except httpx.HTTPError as exc:
        print(f"{label}: /metrics failed: {exc}", flush=True)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,gpu_bus_id,used_memory",
                              "--format=csv"], capture_output=True, text=True, timeout=30)
        (out / f"gpus-{label}.csv").write_text(smi.stdout)
    except (OSError, subprocess.TimeoutExpired):
        pass


def watch(base: str, path: Path, stop: threading.Event, every_s: float = 5.0) -> None:
    """Appends the engines' running/waiting requests and token counters from /metrics every
    `every_s` until `stop` is set: how a run progressed, also one that never finished."""
    keep = ("num_requests_running", "num_requests_waiting", "generation_tokens_total", "prompt_tokens_total")
    t0 = time.monotonic()
    with open(path, "a") as f:
        while not stop.wait(every_s):
            try:
                text = httpx.get(f"{base}/metrics", timeout=5).text
            except httpx.HTTPError as exc:
                f.write(f"{time.monotonic() - t0:6.1f} s /metrics failed: {exc}\n")
                continue
            lines = [ln for ln in text.splitlines() if ln.startswith("flashserve_") and any(k in ln for k in keep)]
            f.write(f"{time.monotonic() - t0:6.1f} s " + "; ".join(ln.removeprefix("flashserve_") for ln in lines) + "\n")
            f.flush()


def ratios(table: dict[str, dict[str, dict]]) -> dict[str, float]:
    def get(label: str, run: str, key: str) -> float | None:
        return table.get(label, {}).get(run, {}).get(key)

    out = {}
    pairs = [("max_throughput_output_x", "one", "dp2", "max_throughput", "output_tok_s"),
             ("random_output_x", "one", "dp2", "random", "output_tok_s"),
             ("shared_prefix_total_prefix_over_load_x", "dp2-load", "dp2", "shared_prefix", "total_tok_s")]
    for name, base, new, run, key in pairs:
        a, b = get(base, run, key), get(new, run, key)
        if a and b:
            out[name] = round(b / a, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokenizer", help="a tokenizer folder for text prompts (default: token-id prompts)")
    p.add_argument("--rate", type=float, default=8.0, help="one engine's random-workload rate (req/s)")
    p.add_argument("--server-arg", action="append", default=[], help="a flag for every server (repeat)")
    p.add_argument("--workers", type=int, default=4,
                   help="benchmark client processes for each run (one process cannot keep up with two engines)")
    p.add_argument("--only", help="server labels to run, comma-separated (default: all of one, dp2, dp2-load)")
    p.add_argument("--runs", help="workloads to run on each server, comma-separated (default: each server's all)")
    p.add_argument("--run-timeout-s", type=float, default=240.0, help="a serve_bench run past it is stopped")
    p.add_argument("--budget-s", type=float, default=500.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    table: dict[str, dict[str, dict]] = {}
    plan = [(label, flags, [r for r in runs if not args.runs or r[0] in args.runs.split(",")])
            for label, flags, runs in PLAN if not args.only or label in args.only.split(",")]
    plan = [row for row in plan if row[2]]
    for i, (label, flags, runs) in enumerate(plan):
        need = START_S + sum(RUN_S[name] for name, _ in runs)
        if i and time.monotonic() - t0 + need > args.budget_s:
            print(f"{label}: skipped, {need:.0f} s would pass the budget", flush=True)
            continue
        with open(args.out / f"server-{label}.log", "w") as log:
            proc, base, error = start_server(args.model, args.tokenizer, [*flags, *args.server_arg], log)
            try:
                print(f"{label}: {'ready' if error is None else error} at {time.monotonic() - t0:.0f} s", flush=True)
                if error is not None:
                    continue
                for name, bench_args in runs:
                    bench_args = [a.replace("2RATE", f"{2 * args.rate:g}").replace("RATE", f"{args.rate:g}")
                                  for a in bench_args] + ["--workers", str(args.workers)]
                    stop_watch = threading.Event()
                    watcher = threading.Thread(target=watch, args=(base, args.out / f"progress-{label}-{name}.txt",
                                                                   stop_watch), daemon=True)
                    watcher.start()
                    try:
                        result = bench(base, args.tokenizer, bench_args, f"{label}-{name}", args.out,
                                       timeout_s=args.run_timeout_s)
                    finally:
                        stop_watch.set()
                        watcher.join()
                    table.setdefault(label, {})[name] = figures(result)
                    print(label, name, table[label][name], flush=True)
                save_state(base, label, args.out)
            finally:
                stop(proc)
        (args.out / "dp.json").write_text(json.dumps({"table": table, "ratios": ratios(table)}, indent=1))
    print(json.dumps(ratios(table), indent=1))
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
