"""The server's host path under many streams, without a device: what each streamed token costs the
server process's CPU, and how fast steps can go when the device takes no time.

    python -m benchmark.api_host [--concurrency 5,25,100] [--step-ms 2] [--tokenizer PATH]

The server is the real one short of the model: uvicorn, the app, `AsyncEngine`, `LLMEngine`, the
scheduler, the KV cache manager and the detokenizer, in a process of its own, over an executor
that answers each step at once (after `--step-ms` of sleep standing for the device) with the
token ids of an English text in turn, so that detokenizing costs what it does on real output.
The tokenizer is the embedded SmolLM2's unless `--tokenizer` names a Hugging Face tokenizer
directory. The client is `benchmark.serve_bench`'s concurrency workload (24 prompt tokens, 384
out, streamed, one client process per `--client-workers`).

For each concurrency it reports the server's CPU seconds per streamed token (user + system time of
its process over the phase, from /proc), the engine's steps per second, and the median TPOT the
client saw. At N streams the host's part of a step is about N x the CPU time per token (the
engine thread and the event loop share the GIL); where that exceeds the device's step, the host
sets the pace. Prints a table; writes `api_host.json` under `benchmark/results/local/<machine>/`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS
from benchmark.server_process import wait_healthy

TEXT = (
    "The server streams each token to its client as soon as the engine has it. A step of the engine "
    "schedules the running requests, runs the model once for all of them, samples one token each, "
    "detokenizes it, checks the stop strings, and hands the text to the event loop, which frames it "
    "as a server-sent event and writes it to the socket. "
)


class InstantExecutor:
    """A step's tokens at once: each sampling row gets the next id of `ids` (the request's output
    length picks it), after `step_s` of sleep."""

    def __init__(self, ids: list[int], step_s: float) -> None:
        from flashserve.model.input_batch import InputBatch

        self.ids, self.step_s = ids, step_s
        self.steps = 0
        self.batch = InputBatch()  # a runner's rows: each one's outputs so far

    def launch(self, out: Any, previous: Any = None) -> Any:
        from flashserve.engine.outputs import NOTHING, SampledTokens

        self.steps += 1
        if self.step_s:
            time.sleep(self.step_s)
        ids, results = self.ids, []
        for r in self.batch.update(out):
            if r.sample:
                r.output_token_ids.append(ids[len(r.output_token_ids) % len(ids)])
            results.append(SampledTokens([r.output_token_ids[-1]]) if r.sample else NOTHING)
        return results

    def collect(self, handle: Any) -> Any:
        return handle


def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from flashserve.model.loader import embedded_gguf_path

    directory, name = os.path.split(embedded_gguf_path())
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def serve(port: int, step_ms: float, tokenizer_path: str | None, stats_path: str) -> None:
    """The server process: the real stack over `InstantExecutor`, until killed."""
    import uvicorn

    from flashserve.api.server import build_app
    from flashserve.config import SchedulerConfig
    from flashserve.engine.async_engine import AsyncEngine
    from flashserve.engine.engine import LLMEngine
    from flashserve.engine.kv_cache_manager import KVCacheManager
    from flashserve.engine.scheduler import Scheduler
    from flashserve.metrics import Metrics

    tokenizer = load_tokenizer(tokenizer_path)
    ids = tokenizer(TEXT * 4, add_special_tokens=False)["input_ids"]
    vocab = len(tokenizer)
    max_len = 4096
    kv = KVCacheManager(16384, 16)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048), kv, max_len,
                          vocab_size=vocab)
    executor = InstantExecutor(ids, step_ms / 1e3)
    engine = LLMEngine(scheduler, executor, tokenizer, vocab_size=vocab)
    metrics = Metrics()
    async_engine = AsyncEngine(engine, max_len, metrics=metrics)
    app = build_app(async_engine, tokenizer, ["host-bench"], max_len, eos_token_ids=(), metrics=metrics,
                    vocab_size=vocab)

    def report() -> None:  # the engine's step count, for the driver
        while True:
            Path(stats_path).write_text(json.dumps({"steps": executor.steps}))
            time.sleep(0.2)

    threading.Thread(target=report, daemon=True).start()

    async def main() -> None:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        async_engine.start()
        await server.serve()

    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="5,25,100")
    p.add_argument("--step-ms", type=float, default=2.0,
                   help="sleep per step standing for the device (0: the engine outruns the event loop)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: the embedded SmolLM2's)")
    p.add_argument("--client-workers", type=int, default=1)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stats", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.port, args.step_ms, args.tokenizer, args.stats)
        return 0
    url = f"http://127.0.0.1:{args.port}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        cmd = [sys.executable, "-m", "benchmark.api_host", "--serve", "--port", str(args.port),
               "--step-ms", str(args.step_ms), "--stats", str(stats)] + (["--tokenizer", args.tokenizer] if args.tokenizer else [])  # fmt: skip
        server = subprocess.Popen(cmd)
        try:
            failure = wait_healthy(server, url, time.monotonic() + 120)
            if failure is not None:
                raise RuntimeError(failure)
            print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; step {args.step_ms} ms of "
                  f"sleep standing for the device")
            print(f"{'streams':>8} {'tokens':>8} {'server CPU us/token':>20} {'steps/s':>8} {'TPOT p50 ms':>12} "
                  f"{'out tok/s':>10}")
            for c in map(int, args.concurrency.split(",")):
                out_dir = Path(tmp) / f"c{c}"
                steps0, cpu0 = json.loads(stats.read_text())["steps"], cpu_seconds(server.pid)
                t0 = time.monotonic()
                subprocess.run([sys.executable, "-m", "benchmark.serve_bench", "--base-url", url, "--workload",
                                "concurrency", "--concurrency", str(c), "--repeats", "1", "--token-ids",
                                "--workers", str(args.client_workers), "--gpu-name", "cpu", "--out-dir",
                                str(out_dir), "--no-summary", "--no-progress", "--warmup", "0"],
                               check=True, stdout=subprocess.DEVNULL)  # fmt: skip
                wall = time.monotonic() - t0
                time.sleep(0.5)  # the stats file catches up
                cpu, steps = cpu_seconds(server.pid) - cpu0, json.loads(stats.read_text())["steps"] - steps0
                result = json.loads(next(out_dir.glob("*.json")).read_text())
                m = result["phases"][0]["metrics"]
                tokens = m["total_output_tokens"]
                row = {"streams": c, "output_tokens": tokens, "server_cpu_s": cpu, "wall_s": wall,
                       "server_cpu_us_per_token": cpu / tokens * 1e6, "engine_steps": steps,
                       "steps_per_s": steps / m["duration_s"], "tpot_p50_ms": m["tpot_ms"]["median"],
                       "output_tok_per_s": m["output_token_throughput"]}
                rows.append(row)
                print(f"{c:8d} {tokens:8d} {row['server_cpu_us_per_token']:20.1f} {row['steps_per_s']:8.0f} "
                      f"{row['tpot_p50_ms']:12.2f} {row['output_tok_per_s']:10.0f}", flush=True)
        finally:
            server.kill()
            server.wait()
    path = Path(args.out) / "cpu" / "api_host.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "step_ms": args.step_ms, "tokenizer": args.tokenizer or "embedded SmolLM2",
                                "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
