"""What tracing (`--otlp-traces-endpoint`) costs: per span, and end to end on the CPU harness.

    python -m benchmark.tracing_bench [--spans 20000] [--repeats 3] [--concurrency 25] [--out FILE]

Per span: `RequestTracer.span` + `RequestSpan.end` for a request's record, as a front end calls
them, with the batch processor exporting over OTLP (gRPC, then HTTP/protobuf) to a receiver in
another process. Two figures: the caller's wall time per span (what a request waits for: a span
queued, never sent on the request path), and this process's CPU time per span, the export thread's
included (what a front end spends).

End to end: `benchmark.api_host`'s `processes` harness (`flashserve serve`'s supervisor, engine
core and front end over an executor that answers each step after a sleep; serve_bench's streamed
concurrency workload) with tracing off and on (gRPC to a receiver in another process), in turn
(off, on, on, off, ...), `--repeats` times each. Tracing passes if on/off is within the spread of off/off: the
gap between the means is no larger than the spread (max - min) of the off runs.

Prints tables; writes `--out` (JSON; by default under the git-ignored benchmark/results/local/).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS

HARNESS_KEYS = ("server_cpu_us_per_token", "tpot_p50_ms", "output_tok_per_s")
# Off, on, on, off, ...: a drift of the machine's load over the runs weighs on both alike.
ORDER = (False, True, True, False)


def receive(protocol: str, port: Any, count: Any, stop: Any, echo: bool = False) -> None:
    """An OTLP receiver (its own process) on `port` (0: any; set once it listens): counts the spans
    it gets, and with `echo` prints each one (a line of JSON)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    def add(request: Any) -> None:
        spans = [span for r in request.resource_spans for s in r.scope_spans for span in s.spans]
        with count.get_lock():
            count.value += len(spans)
        for span in spans if echo else ():
            attributes = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}
            print(json.dumps({"name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                              "parent_span_id": span.parent_span_id.hex(), "attributes": attributes}), flush=True)

    if protocol == "grpc":
        import grpc

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
                add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
        port.value = server.add_insecure_port(f"127.0.0.1:{port.value}")
        server.start()
        stop.wait()
        server.stop(0)
        return
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            add(request)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", port.value), Handler)
    port.value = http.server_address[1]
    import threading

    threading.Thread(target=http.serve_forever, daemon=True).start()
    stop.wait()
    http.shutdown()


class Receiver:
    """`receive` in a process of its own, so that its CPU time is not the tracer's."""

    def __init__(self, protocol: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.port, self.count, self.stop = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()
        self.process = ctx.Process(target=receive, args=(protocol, self.port, self.count, self.stop), daemon=True)
        self.process.start()
        while not self.port.value:
            time.sleep(0.02)
        path = "/v1/traces" if protocol == "http/protobuf" else ""
        self.endpoint = f"http://127.0.0.1:{self.port.value}{path}"

    def close(self) -> None:
        self.stop.set()
        self.process.join(10)


def per_span(protocol: str, spans: int) -> dict[str, Any]:
    """Caller wall us and process CPU us per span, `spans` spans through the OTLP exporter."""
    from flashserve.message.sampling_params import SamplingParams
    from flashserve.metrics import Metrics, RequestRecord
    from flashserve.tracing import RequestTracer

    receiver = Receiver(protocol)
    try:
        env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}
        tracer = RequestTracer(receiver.endpoint, env)
        metrics, params = Metrics(model_name="bench"), SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9)
        headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        records = []
        for i in range(spans):
            record = RequestRecord(metrics, f"cmpl-{i:032x}", 24, 1, time.monotonic() - 1.0)
            record.first_token, record.output_tokens, record.queue_time = record.arrival + 0.1, [128], 0.01
            records.append(record)
        # The batch processor's queue holds 2048 spans and drops the rest: pace the calls so that
        # every span is exported (requests end far more slowly than this in a server).
        batch = 512
        wall, cpu0 = 0.0, time.process_time()
        for start in range(0, spans, batch):
            t0 = time.perf_counter()
            for record in records[start:start + batch]:
                span = tracer.span(headers, record.request_id, "bench", params, 1)
                span.end(record, 1.0)
            wall += time.perf_counter() - t0
            tracer.provider.force_flush()
        tracer.shutdown(30)
        cpu = time.process_time() - cpu0
        deadline = time.monotonic() + 10
        while receiver.count.value < spans and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"protocol": protocol, "spans": spans, "received": receiver.count.value,
                "caller_wall_us_per_span": wall / spans * 1e6, "process_cpu_us_per_span": cpu / spans * 1e6}
    finally:
        receiver.close()


def harness_run(traced: bool, endpoint: str, concurrency: int, port: int, tmp: str, index: int) -> dict[str, Any]:
    """One `benchmark.api_host` run (processes model, one concurrency), tracing on or off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if traced:
        env.update(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="grpc")
    out = Path(tmp) / f"run-{index}.json"
    cmd = [sys.executable, "-m", "benchmark.api_host", "--process-models", "processes", "--concurrency",
           str(concurrency), "--port", str(port), "--out", str(out)]
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:  # once more: a busy machine
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    (row,) = json.loads(out.read_text())["rows"]
    return {"tracing": "on" if traced else "off", **{k: row[k] for k in HARNESS_KEYS},
            "load_average_1min": row["load_average_1min"]}


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the off runs' mean and spread, the on runs' mean, and whether on/off is within it."""
    verdict = {}
    for key in HARNESS_KEYS:
        off = [r[key] for r in runs if r["tracing"] == "off"]
        on = [r[key] for r in runs if r["tracing"] == "on"]
        spread = max(off) - min(off)
        gap = statistics.mean(on) - statistics.mean(off)
        verdict[key] = {"off_mean": statistics.mean(off), "on_mean": statistics.mean(on), "off_spread": spread,
                        "on_minus_off": gap, "within_off_spread": abs(gap) <= spread}
    return verdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spans", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3, help="harness runs with tracing off, and as many on, in turn")
    p.add_argument("--concurrency", type=int, default=25)
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--no-harness", action="store_true", help="the per-span figures only")
    p.add_argument("--receive", choices=["grpc", "http/protobuf"],
                   help="measure nothing: be an OTLP receiver on 127.0.0.1:--receive-port that prints each span")
    p.add_argument("--receive-port", type=int, default=4317)
    p.add_argument("--out", default=str(LOCAL_RESULTS / "cpu" / "tracing.json"), help="results file (default: %(default)s)")
    args = p.parse_args(argv)
    if args.receive:
        from multiprocessing import Event, Value

        stop = Event()
        try:
            receive(args.receive, Value("i", args.receive_port), Value("i", 0), stop, echo=True)
        except KeyboardInterrupt:
            pass
        return 0
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"{'protocol':>14} {'spans':>7} {'received':>9} {'caller us/span':>15} {'CPU us/span':>12}")
    spans = []
    for protocol in ("grpc", "http/protobuf"):
        row = per_span(protocol, args.spans)
        spans.append(row)
        print(f"{protocol:>14} {row['spans']:7d} {row['received']:9d} {row['caller_wall_us_per_span']:15.1f} "
              f"{row['process_cpu_us_per_span']:12.1f}", flush=True)
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "per_span": spans}
    if not args.no_harness:
        receiver = Receiver("grpc")
        runs = []
        try:
            print(f"\nbenchmark.api_host, processes, {args.concurrency} streams; tracing off, on, on, off, ...")
            print(f"{'tracing':>8} {'server CPU us/token':>20} {'TPOT p50 ms':>12} {'out tok/s':>10} {'load':>5}")
            with tempfile.TemporaryDirectory() as tmp:
                for i in range(2 * args.repeats):
                    traced = ORDER[i % len(ORDER)]
                    run = harness_run(traced, receiver.endpoint, args.concurrency, args.port, tmp, i)
                    runs.append(run)
                    print(f"{run['tracing']:>8} {run['server_cpu_us_per_token']:20.1f} {run['tpot_p50_ms']:12.2f} "
                          f"{run['output_tok_per_s']:10.0f} {run['load_average_1min']:5.2f}", flush=True)
        finally:
            receiver.close()
        verdict = compare(runs)
        for key, v in verdict.items():
            print(f"{key}: off {v['off_mean']:.2f} (spread {v['off_spread']:.2f}), on {v['on_mean']:.2f}: "
                  f"on - off {v['on_minus_off']:+.2f}, {'within' if v['within_off_spread'] else 'OUTSIDE'} the spread")
        result.update(harness={"concurrency": args.concurrency, "receiver_spans": receiver.count.value,
                               "runs": runs, "verdict": verdict})
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
