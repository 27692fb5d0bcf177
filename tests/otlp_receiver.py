"""OTLP trace receivers for tests: what an OpenTelemetry collector would get, over HTTP/protobuf
(`http_receiver`) or gRPC (`grpc_receiver`), as plain span records."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]

    @property
    def service_name(self) -> str:
        return str(self.resource.get("service.name"))


class Received:
    """The spans a receiver got, in order; `wait` for a count of them."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        s.name, s.kind, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes}, resource))
        with self._changed:
            self.spans.extend(spans)
            self._changed.notify_all()

    def wait(self, count: int, timeout: float = 20.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.spans) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{len(self.spans)} spans received within {timeout} s, expected {count}")
                self._changed.wait(left)
            return list(self.spans)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


@contextmanager
def http_receiver() -> Iterator[tuple[str, Received]]:
    """Yields (the endpoint URL, .../v1/traces, and what it receives)."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.add(request)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", received
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    """Yields (the endpoint, http://127.0.0.1:PORT, and what it receives)."""
    from concurrent import futures

    import grpc

    received = Received()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
            received.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(0)
