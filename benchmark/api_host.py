"""The server's host path under many streams, without a device: what each streamed token costs the
server's CPU, per process, and how fast steps can go when the device takes no time.

    python -m benchmark.api_host [--concurrency 5,25,100] [--step-ms 2] [--tokenizer PATH]
        [--process-models thread,processes] [--api-server-count 1] [--out FILE]

The server is the real one short of the model: uvicorn, the app, the engine client, `LLMEngine`,
the scheduler, the KV cache manager and the detokenizer, over an executor that answers each step
at once (after `--step-ms` of sleep standing for the device) with the token ids of an English text
in turn, so that detokenizing costs what it does on real output. Two process models, one after
the other in the same run: `thread` (the engine loop a thread beside the event loop in one
process, as the server was before the engine core got a process of its own) and `processes`
(`flashserve serve`'s supervisor, engine core and `--api-server-count` front ends). The tokenizer
is the embedded SmolLM2's unless `--tokenizer` names a Hugging Face tokenizer directory. The client
is `benchmark.serve_bench`'s concurrency workload (24 prompt tokens, 384 out, streamed, one client
process per `--client-workers`).

For each concurrency it reports the server's CPU seconds per streamed token (user + system time
over the phase, from /proc), in all and per process, the client's, the share of the machine's cores
the two kept busy (near 100%: the machine, not the server, sets the pace), the engine's steps per
second, and the median TPOT the client saw. Prints a table; writes `--out` (JSON; by default under
the git-ignored benchmark/results/local/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
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
        self.ids, self.step_s = ids, step_s
        self.steps = 0

    def launch(self, out: Any, previous: Any = None) -> Any:
        from flashserve.engine.outputs import NOTHING, SampledTokens

        self.steps += 1
        if self.step_s:
            time.sleep(self.step_s)
        ids = self.ids
        return [SampledTokens([ids[(len(r.output_token_ids) + r.last_token_in_flight) % len(ids)]]) if r.sample
                else NOTHING for r in out.requests]  # fmt: skip

    def collect(self, handle: Any) -> Any:
        return handle


def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from flashserve.model_loader.loader import embedded_gguf_path

    directory, name = os.path.split(embedded_gguf_path())
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def build_engine(step_ms: float, tokenizer: Any, detokenize: bool) -> tuple[Any, InstantExecutor]:
    """The real scheduler and KV cache manager over `InstantExecutor`; the engine detokenizes only
    where the process model puts detokenizing in the engine's process."""
    from flashserve.config import SchedulerConfig
    from flashserve.engine.llm_engine import LLMEngine
    from flashserve.engine.scheduler import Scheduler
    from flashserve.kv_cache.manager import KVCacheManager

    ids = tokenizer(TEXT * 4, add_special_tokens=False)["input_ids"]
    vocab = len(tokenizer)
    kv = KVCacheManager(16384, 16)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048), kv, MAX_LEN,
                          vocab_size=vocab)
    executor = InstantExecutor(ids, step_ms / 1e3)
    return LLMEngine(scheduler, executor, tokenizer if detokenize else None, vocab_size=vocab), executor


MAX_LEN = 4096


def report_steps(executor: InstantExecutor, stats_path: str) -> None:
    """The engine's step count, for the driver, from a thread of the engine's process."""
    def report() -> None:
        while True:
            Path(stats_path).write_text(json.dumps({"steps": executor.steps}))
            time.sleep(0.2)

    threading.Thread(target=report, daemon=True).start()


def serve_in_one_process(port: int, step_ms: float, tokenizer_path: str | None, stats_path: str) -> None:
    """The server as it was before the engine core had a process of its own: the engine loop a
    thread beside uvicorn's event loop, until killed."""
    import uvicorn

    from flashserve.api.server import build_app
    from flashserve.client.async_engine import AsyncEngine
    from flashserve.metrics import Metrics

    tokenizer = load_tokenizer(tokenizer_path)
    engine, executor = build_engine(step_ms, tokenizer, detokenize=True)
    metrics = Metrics()
    async_engine = AsyncEngine(engine, MAX_LEN, metrics=metrics)
    app = build_app(async_engine, tokenizer, ["host-bench"], MAX_LEN, eos_token_ids=(), metrics=metrics,
                    vocab_size=engine.vocab_size)
    report_steps(executor, stats_path)

    async def main() -> None:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        async_engine.start()
        await server.serve()

    asyncio.run(main())


def load_instant_core(args: Any) -> Any:
    """`flashserve serve`'s engine core loader, with `InstantExecutor` for the model (runs in the
    engine core process; its settings come in FLASHSERVE_BENCH_* variables)."""
    from flashserve.message.codec import PROTOCOL_VERSION, EngineSetup
    from flashserve.entrypoints.core_process import CoreParts

    tokenizer = load_tokenizer(os.environ.get("FLASHSERVE_BENCH_TOKENIZER") or None)
    engine, executor = build_engine(float(os.environ["FLASHSERVE_BENCH_STEP_MS"]), tokenizer, detokenize=False)
    report_steps(executor, os.environ["FLASHSERVE_BENCH_STATS"])
    setup = EngineSetup(PROTOCOL_VERSION, tokenizer, "host-bench", MAX_LEN, (), engine.vocab_size)
    return CoreParts(engine, setup, None, lambda: None)


def serve_in_processes(port: int, step_ms: float, tokenizer_path: str | None, stats_path: str,
                       api_server_count: int) -> int:
    """`flashserve serve`'s supervisor, engine core and front ends, over `InstantExecutor`."""
    from flashserve.cli import build_parser
    from flashserve.serve_args import to_configs
    from flashserve.entrypoints.serve import run

    os.environ.update(FLASHSERVE_BENCH_STEP_MS=str(step_ms), FLASHSERVE_BENCH_STATS=stats_path,
                      FLASHSERVE_BENCH_TOKENIZER=tokenizer_path or "")
    ns = build_parser({}).parse_args(["serve", "--port", str(port), "--log-level", "warning",
                                      "--served-model-name", "host-bench",
                                      "--api-server-count", str(api_server_count)])
    return run(to_configs(ns), load=load_instant_core)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """User + system CPU time of this process's finished children (the benchmark client's)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_processes(pid: int) -> dict[str, int]:
    """The server's processes by name: the one started, and its children (engine core, front ends)."""
    found = {"server": pid}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == pid:
                    found[(entry / "comm").read_text().strip()] = int(entry.name)
            except OSError:
                continue
    return found


def run_model(args: argparse.Namespace, model: str, tmp: str) -> list[dict[str, Any]]:
    """Every concurrency against one server of process model `model`: "thread" (the engine loop a
    thread of the server's process) or "processes" (`flashserve serve`'s engine core and front ends)."""
    url = f"http://127.0.0.1:{args.port}"
    stats = Path(tmp) / f"stats-{model}.json"
    cmd = [sys.executable, "-m", "benchmark.api_host", "--serve", model, "--port", str(args.port),
           "--step-ms", str(args.step_ms), "--stats", str(stats), "--api-server-count", str(args.api_server_count)]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    server = subprocess.Popen(cmd)
    rows = []
    try:
        failure = wait_healthy(server, url, time.monotonic() + 120)
        if failure is not None:
            raise RuntimeError(failure)
        procs = server_processes(server.pid)
        print(f"{model}: processes {sorted(procs)}")
        print(f"{'streams':>8} {'tokens':>8} {'server CPU us/token':>20} {'client':>7} {'busy':>5} {'steps/s':>8} "
              f"{'TPOT p50 ms':>12} {'out tok/s':>10}  CPU us/token per process")
        for c in map(int, args.concurrency.split(",")):
            out_dir = Path(tmp) / f"{model}-c{c}"
            steps0 = json.loads(stats.read_text())["steps"]
            cpu0 = {name: cpu_seconds(pid) for name, pid in procs.items()}
            t0, client0 = time.monotonic(), children_cpu_seconds()
            subprocess.run([sys.executable, "-m", "benchmark.serve_bench", "--base-url", url, "--workload",
                            "concurrency", "--concurrency", str(c), "--repeats", "1", "--token-ids",
                            "--workers", str(args.client_workers), "--gpu-name", "cpu", "--out-dir",
                            str(out_dir), "--no-summary", "--no-progress", "--warmup", "0"],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
            wall, client_cpu = time.monotonic() - t0, children_cpu_seconds() - client0
            time.sleep(0.5)  # the stats file catches up
            per_process = {name: cpu_seconds(pid) - cpu0[name] for name, pid in procs.items()}
            cpu, steps = sum(per_process.values()), json.loads(stats.read_text())["steps"] - steps0
            result = json.loads(next(out_dir.glob("*.json")).read_text())
            m = result["phases"][0]["metrics"]
            tokens = m["total_output_tokens"]
            row = {"process_model": model, "streams": c, "output_tokens": tokens, "server_cpu_s": cpu, "wall_s": wall,
                   "server_cpu_us_per_token": cpu / tokens * 1e6,
                   "cpu_us_per_token_by_process": {k: v / tokens * 1e6 for k, v in per_process.items()},
                   "client_cpu_us_per_token": client_cpu / tokens * 1e6,
                   # Of the machine's cores over the phase, the share the server and the client kept busy.
                   "machine_busy_share": (cpu + client_cpu) / (wall * (os.cpu_count() or 1)),
                   "engine_steps": steps, "steps_per_s": steps / m["duration_s"], "tpot_p50_ms": m["tpot_ms"]["median"],
                   "output_tok_per_s": m["output_token_throughput"]}
            row["load_average_1min"] = os.getloadavg()[0]  # the machine's other work, which TPOT feels
            rows.append(row)
            shares = ", ".join(f"{k} {v:.1f}" for k, v in row["cpu_us_per_token_by_process"].items())
            print(f"{c:8d} {tokens:8d} {row['server_cpu_us_per_token']:20.1f} {row['client_cpu_us_per_token']:7.1f} "
                  f"{row['machine_busy_share']:5.0%} {row['steps_per_s']:8.0f} "
                  f"{row['tpot_p50_ms']:12.2f} {row['output_tok_per_s']:10.0f}  {shares}", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="5,25,100")
    p.add_argument("--step-ms", type=float, default=2.0,
                   help="sleep per step standing for the device (0: the engine outruns the event loop)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: the embedded SmolLM2's)")
    p.add_argument("--client-workers", type=int, default=1)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--process-models", default="thread,processes",
                   help="thread: the engine loop a thread of the server process (as before the split); "
                        "processes: flashserve serve's engine core and front-end processes")
    p.add_argument("--api-server-count", type=int, default=1, help="front ends, for the processes model")
    p.add_argument("--out", default=str(LOCAL_RESULTS / "cpu" / "api_host.json"),
                   help="results file (default: %(default)s)")
    p.add_argument("--serve", choices=["thread", "processes"], help=argparse.SUPPRESS)
    p.add_argument("--stats", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve == "thread":
        serve_in_one_process(args.port, args.step_ms, args.tokenizer, args.stats)
        return 0
    if args.serve == "processes":
        return serve_in_processes(args.port, args.step_ms, args.tokenizer, args.stats, args.api_server_count)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; step {args.step_ms} ms of "
          f"sleep standing for the device")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.process_models.split(","):
            rows += run_model(args, model, tmp)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "step_ms": args.step_ms, "tokenizer": args.tokenizer or "embedded SmolLM2",
                                "api_server_count": args.api_server_count, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
