"""Serving benchmark against any OpenAI-compatible server: runs a named workload, prints a table,
writes one result JSON per run, and refreshes `benchmark/results/local/summary.json`.

    python -m benchmark.serve_bench --base-url http://127.0.0.1:8000 --workload latency
    python -m benchmark.serve_bench --workload random --request-rate 2,4,8 --label vllm
    python -m benchmark.serve_bench --workload goodput --ttft-slo-ms 200
    python -m benchmark.serve_bench --workload concurrency --endpoint chat --concurrency 5,25,100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from benchmark import LOCAL_RESULTS
from benchmark.client import EndpointConfig, LoadResult, first_model_id, run_load
from benchmark.goodput import search_goodput
from benchmark.metrics import headline, merge_summary, summarize
from benchmark.workloads import (
    LENGTH_RANGES, WORKLOAD_NAMES, Phase, PromptSpec, build_phases, fixed_requests, random_requests,
    sglang_range,
)

RESULTS_DIR = LOCAL_RESULTS
BUSY_WARNING = 0.7  # client CPU / wall time above which measurements are suspect


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmark.serve_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", help="default: the first id from GET /v1/models")
    p.add_argument("--workload", choices=WORKLOAD_NAMES, required=True)
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--token-ids", action="store_true", help="prompts as random token ids (default for "
                      "/v1/completions without --tokenizer)")
    kind.add_argument("--text", action="store_true", help="prompts as text of common words")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer for exact text prompt lengths")
    p.add_argument("--empty-text-chunks", action="store_true", help="count completion chunks with empty text as "
                   "tokens (a server without a tokenizer, e.g. flashserve --load-format dummy)")
    p.add_argument("--concurrency", type=_ints, default=(), help="streams in flight, e.g. 5,10,25 (shared_prefix: "
                   "the numbers of groups, e.g. 16,64; its requests go all at once)")
    p.add_argument("--request-rate", type=_floats, default=(), help="Poisson req/s, e.g. 2,4,8")
    p.add_argument("--max-concurrency", type=int, help="cap on streams in flight at a request rate")
    p.add_argument("--arrivals", choices=("poisson", "constant"), default="poisson")
    p.add_argument("--num-requests", type=int, help="override the workload's request count")
    p.add_argument("--lengths", choices=LENGTH_RANGES, default="centered",
                   help="random, goodput and max_throughput lengths: centered on the workload's (+-r), or "
                        "drawn as SGLang's bench_serving does, from len * (1 - r) up to len")
    p.add_argument("--range-ratio", type=float, help="SGLang's --random-range-ratio for the random and goodput "
                   "workloads: lengths uniform in [len * R, len] (the seed protocol: 0.25, inputs 512-2,048, "
                   "outputs 64-256); overrides --lengths")
    p.add_argument("--repeats", type=int, help="latency: batches per size; concurrency: requests per stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo-ms", type=float, default=200.0)
    p.add_argument("--goodput-start-rate", type=float, default=2.0)
    p.add_argument("--goodput-step", type=float, default=0.5)
    p.add_argument("--goodput-max-rate", type=float, default=512.0)
    p.add_argument("--workers", type=int, default=1, help="client processes (when one cannot keep up)")
    p.add_argument("--warmup", type=int, default=2, help="short unrecorded requests sent first")
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per network read")
    p.add_argument("--workload-name", help="name written as the result's workload (default: --workload), "
                   "e.g. latency@llama-3.1-8b to keep model shapes apart in summary.json")
    p.add_argument("--label", default="flashserve", help="system name: flashserve or a peer (vllm, sglang)")
    p.add_argument("--gpu-name", help="default: torch.cuda.get_device_name(), else cpu")
    p.add_argument("--out-dir", type=Path, help="default: benchmark/results/local/<gpu>/")
    p.add_argument("--summary-path", type=Path, default=RESULTS_DIR / "summary.json")
    p.add_argument("--no-summary", action="store_true", help="do not refresh summary.json")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x)


def detect_gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no torch or no driver: a CPU run
        pass
    return "cpu"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown"  # as decode_bench names folders


def prompt_spec(args: argparse.Namespace) -> PromptSpec:
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    text = args.text or args.endpoint == "chat" or (tokenizer is not None and not args.token_ids)
    if args.token_ids and args.endpoint == "chat":
        raise SystemExit("--token-ids needs --endpoint completions")
    return PromptSpec(kind="text" if text else "token_ids", tokenizer=tokenizer)


async def run_phase(cfg: EndpointConfig, phase: Phase, args: argparse.Namespace) -> LoadResult:
    """Run a phase; with rounds > 1, its batches go one after another and their times add up."""
    total = LoadResult([], 0.0)
    size = -(-len(phase.requests) // phase.rounds)
    for i in range(0, len(phase.requests), size):
        load = await run_load(cfg, phase.requests[i : i + size], concurrency=phase.concurrency or args.max_concurrency,
                              request_rate=phase.request_rate, arrivals=args.arrivals, seed=args.seed,
                              progress=not args.no_progress, desc=phase.name, workers=args.workers)
        total.results += load.results
        total.duration_s += load.duration_s
        total.client_busy = max(total.client_busy, load.client_busy)
    return total


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload; return the result document (not yet written)."""
    model = args.model or await first_model_id(args.base_url)
    cfg = EndpointConfig(args.base_url, model, args.endpoint, ignore_eos=not args.no_ignore_eos,
                         timeout_s=args.timeout, empty_text_chunks=args.empty_text_chunks)
    spec = prompt_spec(args)
    if args.warmup:
        warm = await run_load(cfg, fixed_requests(args.warmup, 16, 16, spec, seed=10_000), concurrency=args.warmup)
        if not any(r.success for r in warm.results):
            raise SystemExit(f"warm-up failed: {warm.results[0].error_kind}: {warm.results[0].error}")

    phases: list[dict[str, Any]] = []
    goodput = None
    if args.workload == "goodput":
        ratio, lengths = (0.25, args.lengths) if args.range_ratio is None else sglang_range(args.range_ratio)
        reqs = random_requests(args.num_requests or 256, 2048, 256, ratio, spec, args.seed, lengths)

        async def measure(rate: float) -> dict[str, Any]:
            load = await run_load(cfg, reqs, request_rate=rate, concurrency=args.max_concurrency,
                                  arrivals=args.arrivals, seed=args.seed, progress=not args.no_progress,
                                  desc=f"rate {rate:g}", workers=args.workers)
            return summarize(load)

        result = await search_goodput(measure, args.ttft_slo_ms, start_rate=args.goodput_start_rate,
                                      step=args.goodput_step, max_rate=args.goodput_max_rate)
        goodput = result.to_json()
    else:
        for phase in build_phases(args.workload, spec, args.seed, num_requests=args.num_requests,
                                  request_rates=args.request_rate, concurrencies=args.concurrency,
                                  repeats=args.repeats, lengths=args.lengths, range_ratio=args.range_ratio):
            metrics = summarize(await run_phase(cfg, phase, args))
            phases.append({"name": phase.name, "concurrency": phase.concurrency or args.max_concurrency,
                           "request_rate": phase.request_rate, "rounds": phase.rounds,
                           "num_requests": len(phase.requests), "metrics": metrics})

    settings = {k: v for k, v in vars(args).items()
                if k not in ("base_url", "endpoint", "model", "label", "gpu_name", "out_dir", "summary_path",
                             "no_summary", "no_progress", "workload", "workload_name")}
    settings["prompt_kind"] = spec.kind
    return {
        "schema": 1,
        "workload": args.workload_name or args.workload,
        "label": args.label,
        "gpu": args.gpu_name or detect_gpu_name(),
        "git_commit": git_commit(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": cfg.root,
        "endpoint": args.endpoint,
        "model": model,
        "settings": json.loads(json.dumps(settings, default=str)),
        "phases": phases,
        "goodput": goodput,
        "headline": headline(args.workload, phases, goodput),
    }


def _row(name: str, conc: Any, rate: Any, m: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    t, i, p, e = m["ttft_ms"], m["itl_ms"], m["tpot_ms"], m["e2e_ms"]
    return (f"{name:<18}{conc or '-':>5}{rate or '-':>7}{m['completed']:>6}{m['failed']:>6}"
            f"{m['request_throughput']:>8.2f}{m['output_token_throughput']:>10.1f}"
            f"{f(t['median']):>10}{f(t['p99']):>10}{f(i['median']):>9}{f(i['p99']):>9}"
            f"{f(p['median']):>10}{f(e['median']):>10}")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} ms"


def format_table(doc: dict[str, Any]) -> str:
    """The run as a text table: one line per phase (or goodput probe), times in ms."""
    lines = [f"{doc['workload']} | {doc['label']} | {doc['model']} | {doc['gpu']} | {doc['git_commit'][:10]}",
             f"{'phase':<18}{'conc':>5}{'rate':>7}{'ok':>6}{'fail':>6}{'req/s':>8}{'out tok/s':>10}"
             f"{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}{'E2E p50':>10}  (ms)"]
    for ph in doc["phases"]:
        lines.append(_row(ph["name"], ph["concurrency"], ph["request_rate"], ph["metrics"]))
    g = doc.get("goodput")
    if g:
        for pr in g["probes"]:
            lines.append(_row("probe " + ("pass" if pr["passed"] else "FAIL"), None, f"{pr['rate']:g}", pr["metrics"]))
        lines.append(f"goodput: {g['rate']:g} req/s at P99 TTFT <= {g['slo_ms']:g} ms (step {g['step']:g}); "
                     f"median TTFT {_ms(g['median_ttft_ms'])}, median ITL {_ms(g['median_itl_ms'])}")
    for ph in doc["phases"] + (g["probes"] if g else []):
        m = ph["metrics"]
        if m.get("client_busy", 0) > BUSY_WARNING:
            lines.append(f"{ph.get('name', ph.get('rate'))}: client process {m['client_busy']:.0%} busy: its timings "
                         "may include its own lag; rerun with more --workers")
        if m["failed"]:
            lines.append(f"{ph.get('name', ph.get('rate'))}: {m['failed']} failed {m['error_kinds']} {m['errors'][:2]}")
    return "\n".join(lines)


def write_result(doc: dict[str, Any], out_dir: Path) -> Path:
    """Write `<workload>-<label>-<UTC time>.json` under `out_dir`; never overwrites."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{doc['workload']}-{slug(doc['label'])}-{doc['timestamp'].replace(':', '').replace('+0000', 'Z')}"
    path, n = out_dir / f"{stem}.json", 1
    while path.exists():
        path, n = out_dir / f"{stem}-{n}.json", n + 1
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 1 when requests failed (outside goodput probes) or no rate met the SLO."""
    args = parse_args(argv)
    doc = asyncio.run(run(args))
    path = write_result(doc, args.out_dir or RESULTS_DIR / slug(doc["gpu"]))
    print(format_table(doc))
    print(f"wrote {path}")
    if not args.no_summary:
        print(f"updated {merge_summary(args.summary_path.parent, args.summary_path)}")
    failed = any(ph["metrics"]["failed"] for ph in doc["phases"])
    return 1 if failed or (doc["goodput"] is not None and doc["goodput"]["rate"] == 0) else 0


if __name__ == "__main__":
    sys.exit(main())
