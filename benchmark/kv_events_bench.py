"""What KV cache events (`--kv-events-config`) cost: per event, and end to end.

    python -m benchmark.kv_events_bench [--repeats 4] [--requests 64] [--rate 32] [--no-serve] [--out FILE]

Micro (CPU time, best of 5 rounds): the engine thread's share, the KV cache manager's bookkeeping
per page registered and evicted with the event log off and on (a workload of 2,048-token prompts
sharing prefixes, through allocate / register / free, with take_events and publish once a
"step"), and `publish()` itself (a queue put); the publisher thread's share, building and encoding
one step's batch and sending it on the PUB socket, per event and per page.

End to end: two `flashserve serve` servers at once over `benchmark.api_host`'s device-free
executor (the real engine core, scheduler and KV cache manager; steps of 2 ms of sleep), one with
events on (a subscriber connected and reading) and one with them off, then a second server with
them off; `benchmark.serve_bench`'s random workload (`--requests` prompts of 2,048 +-25% random
token ids, 256 +-25% out, Poisson at `--rate`, a new seed each repeat so that every repeat stores
new pages and, from the third on, evicts) runs against them in turn, off / on / off2 (rotated each
repeat, so that each takes every place in the order), `--repeats` times. Reported: the server's CPU per streamed token and the median
TPOT; on/off should lie within the spread of off/off2.

Prints tables; writes `--out` (JSON, by default under the git-ignored benchmark/results/local/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from benchmark import LOCAL_RESULTS

PAGE = 16


def timed(fn: Callable[[], Any], rounds: int = 5) -> float:
    """CPU seconds of one call of `fn` (process time: the machine is shared), best of `rounds`."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


# ---- micro ---------------------------------------------------------------------------------------
def manager_workload(record: bool, publish: Callable[[list], None] | None, num_requests: int = 400) -> tuple[float, int]:
    """(CPU s, pages registered) of a prefix-sharing workload through the manager, as the scheduler
    drives it: each request allocates (evicting), registers its pages and is freed; one request a step."""
    from flashserve.kv_cache.hashing import PageHasher
    from flashserve.kv_cache.manager import KVCacheManager

    rng = random.Random(0)
    prefixes = [[rng.randrange(49000) for _ in range(1024)] for _ in range(8)]
    prompts = [rng.choice(prefixes) + [rng.randrange(49000) for _ in range(1024)] for _ in range(num_requests)]
    hasher = PageHasher(PAGE)
    chains = []
    for prompt in prompts:
        hashes: list[bytes] = []
        hasher.extend(hashes, prompt)
        chains.append(hashes)

    def run() -> int:
        kv = KVCacheManager(2048, PAGE)  # 16 requests' worth: the workload evicts all the time
        if record:
            kv.record_events()
        pages = 0
        for i, (prompt, hashes) in enumerate(zip(prompts, chains)):
            cached = kv.match(hashes[:-1])
            assert kv.allocate(f"r{i}", len(prompt), cached)
            kv.register(f"r{i}", hashes, len(hashes), prompt, None)
            pages += len(hashes) - len(cached)
            kv.free(f"r{i}")
            if record:
                events = kv.take_events()
                if publish is not None:
                    publish(events)
        return pages

    pages = run()
    return timed(run), pages


def micro(rows: list[dict[str, Any]]) -> None:
    import zmq

    from flashserve.config import KVEventsConfig
    from flashserve.engine.kv_events import KVEventBatch, KVEventPublisher, to_wire
    from flashserve.kv_cache.events import PagesRemoved, PagesStored
    from flashserve.kv_cache.hashing import PageHasher
    from flashserve.kv_cache.manager import KVCacheManager

    off_s, pages = manager_workload(False, None)
    on_s, _ = manager_workload(True, None)
    print(f"{'engine thread':60s} {'us':>8s}")
    row = {"what": "manager bookkeeping per page registered (off)", "us": off_s / pages * 1e6}
    rows.append(row)
    print(f"{row['what']:60s} {row['us']:8.3f}")
    row = {"what": "manager bookkeeping per page registered (event log on)", "us": on_s / pages * 1e6}
    rows.append(row)
    print(f"{row['what']:60s} {row['us']:8.3f}")

    hasher, tokens = PageHasher(PAGE), list(range(2048))
    hash_s = timed(lambda: [hasher.extend([], tokens) for _ in range(200)])
    row = {"what": "PageHasher.extend per page (2,048-token prompt)", "us": hash_s / (200 * 128) * 1e6}
    rows.append(row)
    print(f"{row['what']:60s} {row['us']:8.3f}")

    with tempfile.TemporaryDirectory() as tmp:
        config = KVEventsConfig(True, "zmq", f"ipc://{tmp}/events", f"ipc://{tmp}/replay", max_queue_size=1_000_000)
        publisher = KVEventPublisher(config, PAGE)
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        sub.connect(config.endpoint)
        step = [PagesStored([os.urandom(32)], os.urandom(32), list(range(PAGE)), None)]
        n = 20000
        publish_s = timed(lambda: [publisher.publish(step) for _ in range(n)])
        row = {"what": "publish() per step (engine thread: a deque append)", "us": publish_s / n * 1e6}
        rows.append(row)
        print(f"{row['what']:60s} {row['us']:8.3f}")
        publisher.close(timeout=30)
        sub.close(linger=0)

    import msgspec

    encoder = msgspec.msgpack.Encoder()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(100_000)
    with tempfile.TemporaryDirectory() as tmp:
        pub.bind(f"ipc://{tmp}/bench")
        reader = ctx.socket(zmq.SUB)
        reader.setsockopt_string(zmq.SUBSCRIBE, "")
        reader.setsockopt(zmq.RCVHWM, 0)
        reader.connect(f"ipc://{tmp}/bench")
        time.sleep(0.2)
        print(f"\n{'publisher thread: build + encode + send a batch':60s} {'us/batch':>8s} {'us/event':>9s} {'us/page':>8s} {'bytes':>7s}")
        cases = [
            ("1 page stored (a decode step's new page)", [PagesStored([os.urandom(32)], os.urandom(32), list(range(PAGE)), None)]),
            ("128 pages stored (a 2,048-token prompt)", [PagesStored([os.urandom(32) for _ in range(128)], None, list(range(2048)), "salt")]),
            ("32 steps' pages: 32 x (1 stored)", [PagesStored([os.urandom(32)], os.urandom(32), list(range(PAGE)), None) for _ in range(32)]),
            ("128 pages evicted", [PagesRemoved([os.urandom(32) for _ in range(128)])]),
        ]
        for name, events in cases:
            num_pages = sum(len(e.page_hashes) for e in events)
            seq = [0]

            def send() -> None:
                payload = encoder.encode(KVEventBatch(ts=time.time(), events=to_wire(events, PAGE), data_parallel_rank=0))
                pub.send_multipart((b"", seq[0].to_bytes(8, "big"), payload))
                seq[0] += 1

            reps = 2000
            s = timed(lambda: [send() for _ in range(reps)]) / reps
            while reader.poll(0):
                reader.recv_multipart()
            size = len(encoder.encode(KVEventBatch(ts=0.0, events=to_wire(events, PAGE), data_parallel_rank=0)))
            row = {"what": f"publisher: {name}", "us_per_batch": s * 1e6, "us_per_event": s / len(events) * 1e6,
                   "us_per_page": s / num_pages * 1e6, "bytes": size}
            rows.append(row)
            print(f"{name:60s} {row['us_per_batch']:8.2f} {row['us_per_event']:9.2f} {row['us_per_page']:8.3f} {size:7d}")
        reader.close(linger=0)
    pub.close(linger=0)


# ---- end to end ------------------------------------------------------------------------------------
def load_instant_core_with_events(args: Any) -> Any:
    """api_host's device-free engine core, publishing KV events when the server's config says so."""
    from benchmark.api_host import load_instant_core

    parts = load_instant_core(args)
    parts.kv_events = args.cache.kv_events
    return parts


def serve(port: int, events: str | None, stats: str) -> int:
    from flashserve.cli import build_parser
    from flashserve.serve_args import to_configs
    from flashserve.entrypoints.serve import run

    os.environ.update(FLASHSERVE_BENCH_STEP_MS="2", FLASHSERVE_BENCH_STATS=stats, FLASHSERVE_BENCH_TOKENIZER="")
    argv = ["serve", "--port", str(port), "--log-level", "warning", "--served-model-name", "host-bench"]
    if events:
        argv += ["--kv-events-config", events]
    return run(to_configs(build_parser({}).parse_args(argv)), load=load_instant_core_with_events)


def end_to_end(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from benchmark.api_host import cpu_seconds, server_processes
    from benchmark.server_process import free_port, wait_healthy

    servers: dict[str, tuple[subprocess.Popen, str, dict[str, int]]] = {}
    stop, counts = threading.Event(), [0]
    event_port, replay_port = free_port(), free_port()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{event_port}",
                         "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})
    # An endpoint without a wildcard is connected to, as vLLM does: the subscriber binds it.
    threading.Thread(target=drain_bound, args=(f"tcp://127.0.0.1:{event_port}", stop, counts), daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in ("off", "on", "off2"):
                port = free_port()
                cmd = [sys.executable, "-m", "benchmark.kv_events_bench", "--serve", str(port), "--stats",
                       f"{tmp}/{name}.json"] + (["--events", events] if name == "on" else [])
                proc = subprocess.Popen(cmd)
                url = f"http://127.0.0.1:{port}"
                failure = wait_healthy(proc, url, time.monotonic() + 120)
                if failure is not None:
                    raise RuntimeError(failure)
                servers[name] = (proc, url, server_processes(proc.pid))
            print(f"\n{'server':>6} {'repeat':>6} {'tokens':>7} {'server CPU us/token':>20} {'TPOT p50 ms':>12} "
                  f"{'out tok/s':>10} {'load 1m':>8}")
            for repeat in range(args.repeats):
                # Each server takes each place in the order in turn: a phase's place (after which
                # phase, how warm the machine) shows in its numbers on a shared machine.
                order = ["off", "on", "off2"][repeat % 3 :] + ["off", "on", "off2"][: repeat % 3]
                for name in order:
                    proc, url, procs = servers[name]
                    out_dir = Path(tmp) / f"{name}-{repeat}"
                    cpu0 = sum(cpu_seconds(pid) for pid in procs.values())
                    subprocess.run([sys.executable, "-m", "benchmark.serve_bench", "--base-url", url, "--workload",
                                    "random", "--num-requests", str(args.requests), "--request-rate", str(args.rate),
                                    "--seed", str(repeat), "--token-ids", "--gpu-name", "cpu", "--out-dir",
                                    str(out_dir), "--no-summary", "--no-progress", "--warmup", "0"],
                                   check=True, stdout=subprocess.DEVNULL)
                    cpu = sum(cpu_seconds(pid) for pid in procs.values()) - cpu0
                    m = json.loads(next(out_dir.glob("*.json")).read_text())["phases"][0]["metrics"]
                    tokens = m["total_output_tokens"]
                    row = {"server": name, "repeat": repeat, "output_tokens": tokens,
                           "server_cpu_us_per_token": cpu / tokens * 1e6, "tpot_p50_ms": m["tpot_ms"]["median"],
                           "output_tok_per_s": m["output_token_throughput"], "load_average_1min": os.getloadavg()[0]}
                    rows.append(row)
                    print(f"{name:>6} {repeat:6d} {tokens:7d} {row['server_cpu_us_per_token']:20.1f} "
                          f"{row['tpot_p50_ms']:12.2f} {row['output_tok_per_s']:10.0f} {row['load_average_1min']:8.2f}",
                          flush=True)
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
            for proc, _, _ in servers.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            stop.set()
    e2e = [r for r in rows if "server" in r]
    print(f"\nbatches the subscriber read from the 'on' server: {counts[0]}")
    for key in ("server_cpu_us_per_token", "tpot_p50_ms"):
        med = {n: statistics.median(r[key] for r in e2e if r["server"] == n) for n in ("off", "on", "off2")}
        print(f"{key}: median off {med['off']:.2f}, on {med['on']:.2f}, off2 {med['off2']:.2f}; "
              f"on/off {med['on'] / med['off']:.3f}, off2/off {med['off2'] / med['off']:.3f}")
    rows.append({"subscriber_batches": counts[0]})


def drain_bound(endpoint: str, stop: threading.Event, counts: list[int]) -> None:
    """`drain`, binding the endpoint (the publisher connects to an endpoint without a wildcard)."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt_string(zmq.SUBSCRIBE, "")
    sock.bind(endpoint)
    while not stop.is_set():
        if sock.poll(100):
            sock.recv_multipart()
            counts[0] += 1
    sock.close(linger=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=32.0)
    p.add_argument("--no-serve", action="store_true", help="the microbenchmark only")
    p.add_argument("--out", default=str(LOCAL_RESULTS / "cpu" / "kv_events.json"), help="results file (default: %(default)s)")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--stats", help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.events, args.stats)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    rows: list[dict[str, Any]] = []
    micro(rows)
    if not args.no_serve:
        end_to_end(args, rows)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "repeats": args.repeats, "requests": args.requests, "rate": args.rate, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
