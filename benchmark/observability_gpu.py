"""What tracing and KV cache events cost a GPU server: the seed protocol with each on and off.

    python -m benchmark.observability_gpu --tokenizer DIR [--model llama-3.1-8b] [--rate 12]
        [--num-requests 256] [--repeats 3] [--out DIR]

Four `flashserve serve` servers of the same dummy model, one a GPU (CUDA_VISIBLE_DEVICES 0-3):
`off`, `traces` (`--otlp-traces-endpoint` to an OTLP/gRPC receiver in another process), `events`
(`--kv-events-config`, a ZMQ subscriber connected and reading) and `off2`. Prefix caching is on in
all four (the seed protocol turns it off, but with it off no page is ever stored, so events would
cost nothing); the prompts are random, so nothing is shared. The first server starts alone (it
builds FlashInfer's kernels), the other three then start together from its kernel cache.

Each repeat runs `benchmark.serve_bench`'s seed protocol (random workload, SGLang's range ratio
0.25: inputs 512-2,048, outputs 64-256; text prompts through the real tokenizer; Poisson arrivals
at `--rate`) against all four servers at once, a new seed each repeat. The servers do not share a
GPU, so the comparison holds if on/off lies within the spread of off/off2 (which includes the
difference between two GPUs of one host).

Prints a table; writes `observability.json` and the runs' serve_bench JSONs under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmark.server_process import free_port, stop, wait_ready
from benchmark.tracing_bench import Receiver

CONFIGS = ("off", "traces", "events", "off2")
FIGURES = (("ttft_ms", "median"), ("ttft_ms", "p99"), ("itl_ms", "median"), ("itl_ms", "p99"), ("tpot_ms", "median"))


class Subscriber:
    """Reads every frame the events server publishes, as a router would, and counts them."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._socket.connect(endpoint)
        self.messages = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                frames = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self.messages += 1
            self.bytes += len(frames[-1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)


def start(name: str, gpu: int, args: argparse.Namespace, extra: list[str], out: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
    cmd = [sys.executable, "-m", "flashserve", "serve", "--load-format", "dummy", "--model", args.model,
           "--tokenizer", args.tokenizer, "--port", str(port), *extra]
    log = open(out / f"server_{name}.log", "w")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def bench(name: str, base: str, args: argparse.Namespace, seed: int, out: Path) -> subprocess.Popen:
    run_dir = out / f"{name}_seed{seed}"
    cmd = [sys.executable, "-m", "benchmark.serve_bench", "--base-url", base, "--workload", "random",
           "--range-ratio", "0.25", "--request-rate", str(args.rate), "--num-requests", str(args.num_requests),
           "--text", "--tokenizer", args.tokenizer, "--seed", str(seed), "--label", f"flashserve-{name}",
           "--workload-name", f"seed_protocol@{Path(args.model).name}", "--out-dir", str(run_dir), "--no-summary",
           "--no-progress"]
    return subprocess.Popen(cmd, stdout=open(out / f"bench_{name}_seed{seed}.log", "w"), stderr=subprocess.STDOUT)


def figures(run_dir: Path) -> dict[str, Any]:
    doc = json.loads(next(run_dir.glob("*.json")).read_text())
    m = doc["phases"][0]["metrics"]
    row = {f"{k}_{stat}": m[k][stat] for k, stat in FIGURES}
    row.update(completed=m["completed"], failed=m["failed"], output_tok_s=m["output_token_throughput"], gpu=doc["gpu"])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.observability_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--rate", type=float, default=12.0)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--out", type=Path, default=Path("benchmark/results/local/observability"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    receiver = Receiver("grpc")
    events_port = free_port()
    extra = {
        "off": [], "off2": [],
        "traces": ["--otlp-traces-endpoint", receiver.endpoint],
        "events": ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": f"tcp://*:{events_port}"})],
    }
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    subscriber = None
    result: dict[str, Any] = {"model": args.model, "rate": args.rate, "num_requests": args.num_requests,
                              "range_ratio": 0.25, "prefix_caching": True, "runs": {c: [] for c in CONFIGS}}
    try:
        t0 = time.monotonic()
        servers["off"] = start("off", 0, args, extra["off"], args.out)
        failure = wait_ready(*servers["off"], time.monotonic() + args.start_timeout, 128256)
        print(f"off: ready after {time.monotonic() - t0:.0f} s ({failure or 'ok'})", flush=True)
        if failure:
            return 1
        t1 = time.monotonic()
        for gpu, name in enumerate(CONFIGS[1:], start=1):
            servers[name] = start(name, gpu, args, extra[name], args.out)
        for name in CONFIGS[1:]:
            failure = wait_ready(*servers[name], time.monotonic() + args.start_timeout, 128256)
            print(f"{name}: ready after {time.monotonic() - t1:.0f} s ({failure or 'ok'})", flush=True)
            if failure:
                return 1
        subscriber = Subscriber(f"tcp://127.0.0.1:{events_port}")
        for seed in range(args.repeats):
            procs = {name: bench(name, servers[name][1], args, seed, args.out) for name in CONFIGS}
            for name, proc in procs.items():
                proc.wait()
                row = figures(args.out / f"{name}_seed{seed}")
                result["runs"][name].append(row)
                print(f"seed {seed} {name:<7} " + " ".join(f"{k}={v:.1f}" for k, v in row.items()
                                                          if isinstance(v, float)), flush=True)
        result["spans_received"] = receiver.count.value
        result["event_messages"], result["event_bytes"] = subscriber.messages, subscriber.bytes
    finally:
        if subscriber is not None:
            subscriber.close()
        for proc, _ in servers.values():
            stop(proc)
        receiver.close()
    result["gpu"] = result["runs"]["off"][0]["gpu"]
    summary = {name: {k: statistics.mean(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], float)}
               for name, runs in result["runs"].items()}
    result["mean"] = summary
    keys = [f"{k}_{s}" for k, s in FIGURES] + ["output_tok_s"]
    print(f"\n{result['gpu']}, {args.model}, seed protocol at {args.rate:g} req/s, {args.num_requests} prompts, "
          f"mean of {args.repeats} repeats")
    print(f"{'config':<8}" + "".join(f"{k:>18}" for k in keys))
    for name in CONFIGS:
        print(f"{name:<8}" + "".join(f"{summary[name][k]:>18.1f}" for k in keys))
    spread = {k: abs(summary["off"][k] - summary["off2"][k]) for k in keys}
    for name in ("traces", "events"):
        gaps = {k: summary[name][k] - (summary["off"][k] + summary["off2"][k]) / 2 for k in keys}
        result[f"{name}_vs_off"] = {k: {"gap": gaps[k], "off_off2_spread": spread[k],
                                        "within": abs(gaps[k]) <= spread[k]} for k in keys}
        print(f"{name} - mean(off, off2): " + ", ".join(f"{k} {gaps[k]:+.1f} (off/off2 {spread[k]:.1f})" for k in keys))
    print(f"spans received: {result['spans_received']}; event messages: {result['event_messages']} "
          f"({result['event_bytes']} bytes)")
    (args.out / "observability.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
