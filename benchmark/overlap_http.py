"""Overlap scheduling over HTTP: one server with it, then one without, each under the latency
workload (batch 1 and batch 8, 128 in / 128 out), with the copy and matmul rates measured first.

    python -m benchmark.overlap_http --model llama-3.1-8b --tokenizer .whl/llama3-tokenizer --out DIR

Dummy weights in the model's shape; with `--tokenizer` the prompts are text and every stream is
tokenized and detokenized. Writes rates.json, one serve_bench result per server and their logs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmark.server_process import free_port, stop, wait_ready
from benchmark.suite import model_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokenizer", help="a tokenizer folder for text prompts (default: token-id prompts)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "benchmark.floor", "--out", str(args.out / "rates.json")], check=False)
    tokenizer = ["--tokenizer", args.tokenizer] if args.tokenizer else []
    prompts = ["--text", *tokenizer] if args.tokenizer else ["--token-ids"]
    for label, flag in (("flashserve-overlap", "--overlap-scheduling"), ("flashserve-in-turn", "--no-overlap-scheduling")):
        port = free_port()
        with open(args.out / f"server-{label}.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "flashserve", "serve", "--load-format", "dummy", "--model",
                                     args.model, *tokenizer, "--port", str(port), "--log-level", "warning",
                                     "--shutdown-timeout", "2", flag],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                base = f"http://127.0.0.1:{port}"
                error = wait_ready(proc, base, time.monotonic() + 600, model_config(args.model)["vocab_size"])
                print(label, "ready" if error is None else error, flush=True)
                if error is None:
                    subprocess.run([sys.executable, "-m", "benchmark.serve_bench", "--base-url", base, "--workload",
                                    "latency", *prompts, "--repeats", str(args.repeats), "--label", label,
                                    "--out-dir", str(args.out), "--no-summary", "--no-progress"], check=False)
            finally:
                stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
