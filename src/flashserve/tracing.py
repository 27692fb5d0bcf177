"""OpenTelemetry traces: one span per API request, exported over OTLP (`--otlp-traces-endpoint`).

Each front end that is told an endpoint (the flag, its FLASHSERVE_OTLP_TRACES_ENDPOINT twin, or
the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) builds a `RequestTracer` of its own: a tracer
provider with a `BatchSpanProcessor` over an OTLP exporter, gRPC unless
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf; OTEL_SERVICE_NAME names the service
("flashserve" by default) and the exporter reads its other OTEL_EXPORTER_OTLP_* settings itself.

The span is made when the request ends, from what its `metrics.RequestRecord` measured: named
`llm_request`, kind SERVER, starting at the request's arrival, the child of the W3C `traceparent`
the request carried, with the attributes vLLM sets (`SpanAttributes`). Ending a span only queues
it: the processor's thread exports batches off the request path, and an endpoint that does not
answer costs dropped spans, never a slower or failed request.

Without an endpoint nothing of OpenTelemetry is imported (it is the optional `tracing` extra) and
a request pays one `is None` check.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashserve.message.sampling_params import SamplingParams
    from flashserve.metrics import RequestRecord

logger = logging.getLogger("flashserve")

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
PROTOCOLS = ("grpc", "http/protobuf")
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
DEFAULT_SERVICE_NAME = "flashserve"
# At shutdown: how long the last spans get to go out before the process ends without them.
SHUTDOWN_SECONDS = 5.0


class SpanAttributes:
    """The attribute names of vLLM's request span (`vllm/tracing.py`), so that dashboards built on
    vLLM's traces read ours. Latencies are in seconds."""

    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"


def traces_endpoint(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """Where spans go: the flag, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; None: tracing is off."""
    return flag or environ.get(ENDPOINT_ENV) or None


def traces_protocol(environ: Mapping[str, str]) -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, gRPC by default (as vLLM's exporter). Raises ValueError
    for another one."""
    protocol = environ.get(PROTOCOL_ENV, "grpc").strip() or "grpc"
    if protocol not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}")
    return protocol


class RequestTracer:
    """One front end's tracer: `span(...)` when a request starts, `RequestSpan.end` when it ends.
    `exporter`: a span exporter to use instead of OTLP (benchmarks)."""

    def __init__(self, endpoint: str | None, environ: Mapping[str, str], exporter: Any = None) -> None:
        protocol = traces_protocol(environ)
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise RuntimeError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'flashserve[tracing]'") from exc
        if exporter is None:
            exporter = _otlp_exporter(protocol, endpoint)
        # process.pid: which front end of --api-server-count sent a span.
        resource = Resource.create({"service.name": environ.get(SERVICE_NAME_ENV) or DEFAULT_SERVICE_NAME,
                                    "process.pid": os.getpid()})
        # No exit hook: `shutdown` bounds the wait for an endpoint that does not answer.
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("flashserve")
        self.endpoint, self.protocol = endpoint, protocol
        self._kind, self._error = SpanKind.SERVER, Status(StatusCode.ERROR)
        self._propagator = TraceContextTextMapPropagator()

    def span(self, headers: Mapping[str, str], request_id: str, model: str, params: SamplingParams,
             n: int) -> RequestSpan:
        """The span of a request that starts now: its trace headers and what it asked for."""
        carrier = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        attributes: dict[str, Any] = {
            SpanAttributes.GEN_AI_RESPONSE_MODEL: model,
            SpanAttributes.GEN_AI_REQUEST_ID: request_id,
            SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
            SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.GEN_AI_REQUEST_TOP_P: params.top_p,
            SpanAttributes.GEN_AI_REQUEST_N: n,
        }
        return RequestSpan(self, carrier, attributes)

    def export(self, carrier: dict[str, str], attributes: dict[str, Any], start_ns: int, end_ns: int,
               failed: bool) -> None:
        context = self._propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(SPAN_NAME, context=context, kind=self._kind, attributes=attributes,
                                      start_time=start_ns)
        if failed:
            span.set_status(self._error)
        span.end(end_time=end_ns)

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Sends what is queued, waiting at most `timeout` seconds for the endpoint."""
        done = threading.Thread(target=self.provider.shutdown, name="flashserve-tracing-shutdown", daemon=True)
        done.start()
        done.join(timeout)
        if done.is_alive():
            logger.warning("traces not all exported to %s within %.0f s; dropped", self.endpoint, timeout)


class RequestSpan:
    """What a request's span needs until it ends; `metrics.RequestRecord.close` calls `end`."""

    __slots__ = ("tracer", "carrier", "attributes")

    def __init__(self, tracer: RequestTracer, carrier: dict[str, str], attributes: dict[str, Any]) -> None:
        self.tracer = tracer
        self.carrier = carrier
        self.attributes = attributes

    def end(self, record: RequestRecord, latency: float) -> None:
        """Queue the span of the request `record` measured, which took `latency` s and ends now.
        Never raises: a span is not worth a request."""
        try:
            end_ns = time.time_ns()
            attributes = self.attributes
            attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] = record.num_prompt_tokens
            attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] = sum(record.output_tokens)
            attributes[SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES] = len(record.output_tokens)
            attributes[SpanAttributes.GEN_AI_LATENCY_E2E] = latency
            if record.first_token is not None:
                attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = record.first_token - record.arrival
            if record.queue_time is not None:
                attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] = record.queue_time
            failed = "error" in record.finish_reasons
            self.tracer.export(self.carrier, attributes, end_ns - int(latency * 1e9), end_ns, failed)
        except Exception:
            logger.exception("could not record the trace span of request %s", record.request_id)


def _otlp_exporter(protocol: str, endpoint: str | None) -> Any:
    """OTLP over gRPC or HTTP/protobuf; the endpoint is used as given (for HTTP, the whole URL:
    http://collector:4318/v1/traces)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    return OTLPSpanExporter(endpoint=endpoint)


def check_tracing(flag: str | None, environ: Mapping[str, str]) -> None:
    """Raises ValueError for what `build_tracer` would refuse (an unknown protocol, OpenTelemetry
    not installed), so that a server can refuse it before it loads a model."""
    if traces_endpoint(flag, environ) is None:
        return
    traces_protocol(environ)
    try:
        import opentelemetry.exporter.otlp  # noqa: F401
        import opentelemetry.sdk  # noqa: F401
    except ImportError:
        raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'flashserve[tracing]'") from None


def build_tracer(flag: str | None, environ: Mapping[str, str]) -> RequestTracer | None:
    """A front end's tracer, or None when no endpoint is configured (tracing off)."""
    endpoint = traces_endpoint(flag, environ)
    if endpoint is None:
        return None
    tracer = RequestTracer(endpoint, environ)
    logger.info("tracing: a span per request to %s over OTLP %s", endpoint, tracer.protocol)
    return tracer
