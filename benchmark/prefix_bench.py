"""Prefix caching on and off, side by side in one run on one GPU: the shared-prefix workload (G groups
x 16 prompts of a 2,048-token group prefix + a 128-token question, 256 out, all at once) and the
random workload (2048 +-25% in, 256 +-25% out, Poisson), each against a fresh server with
`--no-enable-prefix-caching` and then with caching on.

    python -m benchmark.prefix_bench --model llama-3.1-8b --tokenizer .whl/llama3-tokenizer
    python -m benchmark.prefix_bench --groups 16,64 --random-requests 256 --random-rate 8

Prints a table (total tokens/s, median and P99 TTFT, the prefix cache hit rate read off the server's
own /metrics counters), and writes `prefix_bench-<time>.json` and `prefix_bench.png` under
`benchmark/results/local/<gpu>/prefix_cache/`; each serve_bench run's JSON goes there too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import httpx

from benchmark import serve_bench
from benchmark.server_process import free_port, stop, wait_ready

MODES = (("off", ["--no-enable-prefix-caching"]), ("on", []))


def prefix_counters(base: str) -> tuple[float, float]:
    """(tokens looked up, tokens found) from the server's Prometheus counters."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
              for s in f.samples}
    return values.get("flashserve_prefix_cache_queries_total", 0.0), values.get("flashserve_prefix_cache_hits_total", 0.0)


def bench_args(base: str, workload: str, extra: list[str], args: argparse.Namespace, out_dir: Path) -> list[str]:
    tok = ["--tokenizer", args.tokenizer, "--text"] if args.tokenizer else ["--token-ids", "--empty-text-chunks"]
    return ["--base-url", base, "--workload", workload, *tok, *extra, "--gpu-name", args.gpu_name,
            "--out-dir", str(out_dir), "--no-summary", "--no-progress", "--timeout", "900"]


def run_mode(mode: str, flags: list[str], args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flashserve", "serve", "--load-format", "dummy", "--model", args.model,
           "--port", str(port), "--log-level", "warning", *flags, *args.server_arg]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    log = open(out_dir / f"server-{mode}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        error = wait_ready(proc, base, time.monotonic() + 600, 128_256)
        if error:
            raise SystemExit(f"caching {mode}: {error}")
        runs = {}
        workloads = [("shared_prefix", ["--concurrency", args.groups, "--label", f"flashserve-caching-{mode}"])]
        if args.random_requests:
            workloads.append(("random", ["--num-requests", str(args.random_requests), "--request-rate",
                                         str(args.random_rate), "--label", f"flashserve-caching-{mode}"]))
        for workload, extra in workloads:
            before = prefix_counters(base)
            ns = serve_bench.parse_args(bench_args(base, workload, extra, args, out_dir))
            doc = asyncio.run(serve_bench.run(ns))
            serve_bench.write_result(doc, out_dir)
            print(serve_bench.format_table(doc), flush=True)
            after = prefix_counters(base)
            queries, hits = after[0] - before[0], after[1] - before[1]
            runs[workload] = {"phases": doc["phases"], "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                              "hit_rate": hits / queries if queries else 0.0}
        return runs
    finally:
        stop(proc)
        log.close()


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'workload':<22}{'caching':>8}{'total tok/s':>13}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'ITL p50':>9}{'hit rate':>10}{'failed':>8}  (ms)"]
    for mode, runs in results.items():
        for workload, run in runs.items():
            for ph in run["phases"]:
                m = ph["metrics"]
                lines.append(f"{workload + ':' + ph['name']:<22}{mode:>8}{m['total_token_throughput']:>13.0f}"
                             f"{m['ttft_ms']['median']:>10.0f}{m['ttft_ms']['p99']:>10.0f}"
                             f"{m['itl_ms']['median']:>9.2f}{run['hit_rate']:>10.1%}{m['failed']:>8}")
    for workload in results.get("on", {}):
        for off, on in zip(results["off"][workload]["phases"], results["on"][workload]["phases"]):
            a, b = off["metrics"], on["metrics"]
            lines.append(f"{workload}:{on['name']}: caching on / off: total tok/s x"
                         f"{b['total_token_throughput'] / max(a['total_token_throughput'], 1e-9):.2f}, "
                         f"median TTFT / {a['ttft_ms']['median'] / max(b['ttft_ms']['median'], 1e-9):.2f}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, gpu: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{w}:{ph['name']}" for w, run in results["off"].items() for ph in run["phases"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for k, (key, label) in enumerate((("total_token_throughput", "total tokens/s"), ("ttft", "median TTFT (ms)"))):
        for j, mode in enumerate(("off", "on")):
            vals = [ph["metrics"]["ttft_ms"]["median"] if key == "ttft" else ph["metrics"][key]
                    for run in results[mode].values() for ph in run["phases"]]
            axes[k].bar([i + 0.4 * j for i in range(len(vals))], vals, width=0.4, label=f"caching {mode}")
        axes[k].set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
        axes[k].set_title(label)
        axes[k].legend()
    fig.suptitle(f"prefix caching, {model} (dummy weights), {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.prefix_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="dummy shape name or config.json")
    p.add_argument("--tokenizer", help="serve and send text through this tokenizer (default: token ids)")
    p.add_argument("--groups", default="16", help="shared-prefix group counts, e.g. 16,64")
    p.add_argument("--random-requests", type=int, default=128, help="0: skip the random workload")
    p.add_argument("--random-rate", type=float, default=8.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `flashserve serve` flag (repeat)")
    p.add_argument("--gpu-name", default=serve_bench.detect_gpu_name())
    p.add_argument("--out", default=str(serve_bench.RESULTS_DIR), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)
    out_dir = Path(args.out) / serve_bench.slug(args.gpu_name) / "prefix_cache"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {mode: run_mode(mode, flags, args, out_dir) for mode, flags in MODES}
    text = table(results)
    print(text)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    doc = {"gpu": args.gpu_name, "model": args.model, "tokenizer": args.tokenizer, "git_commit": serve_bench.git_commit(),
           "timestamp": stamp, "settings": {k: v for k, v in vars(args).items() if k != "gpu_name"},
           "results": results, "table": text.splitlines()}
    (out_dir / f"prefix_bench-{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, out_dir / "prefix_bench.png", args.gpu_name, args.model)
    print(f"wrote {out_dir}")
    failed = any(ph["metrics"]["failed"] for runs in results.values() for run in runs.values() for ph in run["phases"])
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
