"""Servers of one model in several configurations, one after the other, each under the same
serve_bench workload, with the copy and matmul rates measured first; a table of the results.

    python -m benchmark.server_configs --model llama-3.1-8b --tokenizer .whl/llama3-tokenizer --out DIR \
        --config budget-1024="--max-num-batched-tokens 1024" --config budget-2048="--max-num-batched-tokens 2048" \
        -- --workload random --request-rate 8,12,16 --num-requests 256

Dummy weights in the model's shape; with `--tokenizer` the prompts are text and every stream is
tokenized and detokenized. Everything after `--` goes to `benchmark.serve_bench`. Writes
rates.json, one serve_bench result per configuration, the servers' logs and configs.json (the table).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from benchmark.server_process import free_port, stop, wait_ready
from benchmark.suite import model_config


def prompt_flags(tokenizer: str | None) -> list[str]:
    """serve_bench's prompt flags: text through `tokenizer`, else token ids."""
    # A dummy model's server without a tokenizer streams chunks of empty text: count them as tokens.
    return ["--text", "--tokenizer", tokenizer] if tokenizer else ["--token-ids", "--empty-text-chunks"]


def start_server(model: str, tokenizer: str | None, flags: list[str],
                 log: IO[str]) -> tuple[subprocess.Popen, str, str | None]:
    """A dummy-weight server of `model` with `flags`, warmed up: (process, base URL, None once ready,
    else why not). Stop it with `server_process.stop`."""
    port = free_port()
    tok = ["--tokenizer", tokenizer] if tokenizer else []
    proc = subprocess.Popen([sys.executable, "-m", "flashserve", "serve", "--load-format", "dummy", "--model",
                             model, *tok, "--port", str(port), "--log-level", "warning",
                             "--shutdown-timeout", "2", *flags],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    return proc, base, wait_ready(proc, base, time.monotonic() + 600, model_config(model)["vocab_size"])


def bench(base: str, tokenizer: str | None, bench_args: list[str], label: str, out: Path,
          timeout_s: float | None = None) -> dict | None:
    """One serve_bench run against `base`; its result JSON (None if it wrote none, or ran past
    `timeout_s`)."""
    before = set(out.glob("*.json"))
    try:
        subprocess.run([sys.executable, "-m", "benchmark.serve_bench", "--base-url", base, *prompt_flags(tokenizer),
                        *bench_args, "--label", label, "--out-dir", str(out), "--no-summary", "--no-progress"],
                       check=False, timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"{label}: serve_bench ran past {timeout_s:.0f} s", flush=True)
        return None
    new = sorted(set(out.glob("*.json")) - before)
    return json.loads(new[-1].read_text()) if new else None


def run_configs(model: str, tokenizer: str | None, configs: list[tuple[str, list[str]]], bench_args: list[str],
                out: Path) -> list[dict]:
    """Each (label, serve flags) served in turn under `bench_args`; the serve_bench result of each
    (None where the server did not come up)."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "benchmark.floor", "--out", str(out / "rates.json")], check=False)
    results = []
    for label, flags in configs:
        result = None
        with open(out / f"server-{label}.log", "w") as log:
            proc, base, error = start_server(model, tokenizer, flags, log)
            try:
                print(label, "ready" if error is None else error, flush=True)
                if error is None:
                    result = bench(base, tokenizer, bench_args, label, out)
            finally:
                stop(proc)
        results.append({"label": label, "flags": flags, "result": result})
    return results


def rows(results: list[dict]) -> list[dict]:
    """One row per configuration and phase (rate, concurrency or batch size) of its result."""
    table = []
    for entry in results:
        result = entry["result"] or {}
        for phase in result.get("phases", []):
            m = phase.get("metrics", phase)
            table.append({"config": entry["label"], "phase": {k: v for k, v in phase.items() if k != "metrics"},
                          "p99_ttft_ms": m["ttft_ms"]["p99"], "median_ttft_ms": m["ttft_ms"]["median"],
                          "median_itl_ms": m["itl_ms"]["median"], "p99_itl_ms": m["itl_ms"]["p99"],
                          "output_tok_s": m["output_token_throughput"], "completed": m["completed"],
                          "failed": m["failed"]})
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokenizer", help="a tokenizer folder for text prompts (default: token-id prompts)")
    p.add_argument("--config", action="append", required=True, metavar="LABEL=FLAGS",
                   help="a label and the serve flags of one configuration (repeat for more)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv[:split])
    configs = [(label, shlex.split(flags)) for label, _, flags in (c.partition("=") for c in args.config)]
    results = run_configs(args.model, args.tokenizer, configs, argv[split + 1:], args.out)
    table = rows(results)
    (args.out / "configs.json").write_text(json.dumps({"model": args.model, "tokenizer": args.tokenizer,
                                                        "bench_args": argv[split + 1:], "configs": configs,
                                                        "rows": table}, indent=1))
    print(f"{'config':<24} {'phase':<28} {'p99 TTFT':>9} {'med TTFT':>9} {'med ITL':>8} {'p99 ITL':>8} {'out tok/s':>9}")
    for r in table:
        print(f"{r['config']:<24} {r['phase'].get('name', ''):<28} {r['p99_ttft_ms']:9.1f} {r['median_ttft_ms']:9.1f} "
              f"{r['median_itl_ms']:8.2f} {r['p99_itl_ms']:8.2f} {r['output_tok_s']:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
