"""OpenTelemetry traces (`--otlp-traces-endpoint`): a span per request reaches an OTLP receiver,
the child of the request's `traceparent`, with vLLM's attributes; an endpoint that does not answer
costs the requests nothing. The real app and engine over a fake model (production_helpers), a test
receiver for the collector."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from unittest import mock

import httpx
import pytest

from flashserve.api.options import APIOptions
from flashserve.cli import build_parser
from flashserve.serve_args import to_configs
from flashserve.entrypoints.serve import run as serve_run
from flashserve.tracing import build_tracer
from live_server import live_server
from otlp_receiver import grpc_receiver, http_receiver
from production_helpers import MODEL, serve_engine
from test_production_one_request import dummy_args, model_config  # noqa: F401  (a fixture)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind


@pytest.fixture
def fast_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch processor sends every 50 ms rather than every 5 s."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "flashserve-test")


@pytest.fixture
def http_traced(fast_export: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, object]]:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with http_receiver() as (endpoint, received), serve_engine(APIOptions(otlp_traces_endpoint=endpoint)) as stack:
        yield stack.url, received


def complete(url: str, headers: dict[str, str] | None = None, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=30)


def test_a_request_with_traceparent_gets_a_server_span_that_is_its_child(http_traced: tuple[str, object]) -> None:
    url, received = http_traced
    assert complete(url, {"traceparent": TRACEPARENT}).status_code == 200
    (span,) = received.wait(1)  # type: ignore[attr-defined]
    assert (span.name, span.kind) == ("llm_request", SPAN_KIND_SERVER)
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_SPAN_ID)
    assert span.service_name == "flashserve-test"


def test_the_span_carries_vllms_request_usage_and_latency_attributes(http_traced: tuple[str, object]) -> None:
    url, received = http_traced
    r = complete(url, n=2, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200
    (span,) = received.wait(1)  # type: ignore[attr-defined]
    a = span.attributes
    assert a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.id"].startswith("cmpl-") and a["gen_ai.request.id"] in r.text
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.n"]) == (4, 2)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (5, 8)
    e2e, ttft, queue = (a[f"gen_ai.latency.{k}"] for k in ("e2e", "time_to_first_token", "time_in_queue"))
    assert 0 <= queue <= ttft <= e2e
    assert span.end_ns - span.start_ns == pytest.approx(e2e * 1e9, rel=0.01)


def test_a_request_without_traceparent_gets_a_root_span(http_traced: tuple[str, object]) -> None:
    url, received = http_traced
    assert complete(url).status_code == 200
    (span,) = received.wait(1)  # type: ignore[attr-defined]
    assert span.parent_span_id == "" and span.trace_id != TRACE_ID


def test_spans_go_over_grpc_by_default(fast_export: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    with grpc_receiver() as (endpoint, received), serve_engine(APIOptions(otlp_traces_endpoint=endpoint)) as stack:
        r = httpx.post(f"{stack.url}/v1/chat/completions", headers={"traceparent": TRACEPARENT}, timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        # Tokenizer-free: chat is a 400, and a request that never reached the engine has no span.
        assert r.status_code == 400
        assert complete(stack.url, {"traceparent": TRACEPARENT}).status_code == 200
        (span,) = received.wait(1)
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_SPAN_ID)


def test_an_endpoint_that_never_answers_neither_fails_nor_holds_up_requests(
        fast_export: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with socket.socket() as black_hole:  # accepts connections (the kernel's backlog), never answers
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(64)
        endpoint = f"http://127.0.0.1:{black_hole.getsockname()[1]}/v1/traces"
        with serve_engine(APIOptions(otlp_traces_endpoint=endpoint)) as stack:
            # The exporter waits 10 s for each batch; these finish long before that.
            for _ in range(5):
                assert complete(stack.url).status_code == 200
            streamed = complete(stack.url, stream=True)
            assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


@pytest.mark.slow
def test_each_front_end_of_serve_exports_its_own_spans_and_sends_the_last_at_shutdown(model_config: str) -> None:  # noqa: F811
    requests = 12
    with grpc_receiver() as (endpoint, received):
        args = dummy_args(model_config, "--api-server-count", "2", "--otlp-traces-endpoint", endpoint)
        with live_server(args) as (url, _):
            for _ in range(requests):  # a connection each: the kernel spreads them over the front ends
                with httpx.Client() as client:
                    r = client.post(f"{url}/v1/completions", timeout=60,
                                    json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
                    assert r.status_code == 200
        # The batch processor sends every 5 s by default: these went out when the server stopped.
        spans = received.wait(requests, timeout=10)
    assert len(spans) == requests
    assert len({span.resource["process.pid"] for span in spans}) == 2


def test_the_flag_and_its_environment_variable_set_the_endpoint() -> None:
    parse = lambda argv, env: to_configs(build_parser(env).parse_args(["serve", *argv])).api  # noqa: E731
    assert parse(["--otlp-traces-endpoint", "http://c:4317"], {}).otlp_traces_endpoint == "http://c:4317"
    assert parse([], {"FLASHSERVE_OTLP_TRACES_ENDPOINT": "http://d:4317"}).otlp_traces_endpoint == "http://d:4317"
    assert parse([], {}).otlp_traces_endpoint is None


def test_the_standard_otel_endpoint_variable_turns_tracing_on_and_none_leaves_it_off() -> None:
    assert build_tracer(None, {}) is None
    tracer = build_tracer(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1"})
    assert tracer is not None and tracer.protocol == "grpc"
    tracer.shutdown(0.1)


def test_an_unknown_otlp_protocol_stops_serve_before_it_loads_a_model() -> None:
    args = to_configs(build_parser({}).parse_args(["serve", "--otlp-traces-endpoint", "http://c:4317"]))
    with mock.patch.dict(os.environ, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}), \
            mock.patch("flashserve.entrypoints.serve.Supervisor") as supervisor:
        with pytest.raises(SystemExit, match="http/json"):
            serve_run(args)
    supervisor.assert_not_called()


def test_without_an_endpoint_the_opentelemetry_sdk_and_exporters_are_never_imported() -> None:
    code = ("import sys; from fake_engine import FakeEngine; from flashserve.api.server import build_app; "
            "build_app(FakeEngine(), None, ['m'], 64); "
            "assert not [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))]")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(__file__), env=env, timeout=120)
