"""Non-finite sampling values, retrieving one model, the x-request-id header, CORS for the SDKs."""

from __future__ import annotations

import logging
import re
from typing import Any

import httpx
import httpx2
import openai
import pytest

from fake_engine import MODEL, FakeEngine, api_client
from flashserve.api.options import APIOptions
from flashserve.api.server import build_app
from flashserve.cli import build_parser
from flashserve.serve_args import to_configs
from production_helpers import assert_openai_error

pytestmark = pytest.mark.anyio

SLASHED = "meta-llama/Llama-3.1-8B-Instruct"
JSON = {"Content-Type": "application/json"}
COMPLETION = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}
HEX_ID = re.compile(r"[0-9a-f]{32}")


def client(names: tuple[str, ...] = (MODEL,), engine: FakeEngine | None = None,
           raise_app_exceptions: bool = True, **options: Any) -> httpx.AsyncClient:
    """The app over a tokenizer-free FakeEngine serving `names`, with these APIOptions."""
    app = build_app(engine or FakeEngine(), None, list(names), 2048, options=APIOptions(**options))
    # Starlette re-raises an unexpected exception after sending its 500; False lets a test read it.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def with_raw(field: str, literal: str) -> str:
    """A completion body with `field` set to a bare literal that json.dumps would not write."""
    return f'{{"model": "{MODEL}", "prompt": [1, 2], "max_tokens": 2, "{field}": {literal}}}'


# ---- non-finite sampling values -------------------------------------------------------------------

SAMPLING_FLOATS = ["repetition_penalty", "frequency_penalty", "presence_penalty", "top_p", "min_p", "temperature"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", SAMPLING_FLOATS)
async def test_a_non_finite_sampling_value_is_400_naming_the_field(field: str, literal: str) -> None:
    async with api_client(FakeEngine(), None) as c:
        r = await c.post("/v1/completions", content=with_raw(field, literal), headers=JSON)
    error = assert_openai_error(r, 400)
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert field in error["message"] and "finite" in error["message"]


@pytest.mark.parametrize(("field", "body"), [
    ("prompt", f'{{"model": "{MODEL}", "prompt": [1, 18446744073709551616], "max_tokens": 2}}'),
    ("max_tokens", f'{{"model": "{MODEL}", "prompt": [1, 2], "max_tokens": 18446744073709551616}}'),
])
async def test_an_integer_past_64_bits_is_400_naming_the_field(field: str, body: str) -> None:
    async with api_client(FakeEngine(), None) as c:
        r = await c.post("/v1/completions", content=body, headers=JSON)
    error = assert_openai_error(r, 400)
    assert error["param"] == field


async def test_after_a_non_finite_value_the_server_still_answers() -> None:
    async with api_client(FakeEngine(), None) as c:
        refused = await c.post("/v1/completions", content=with_raw("repetition_penalty", "NaN"), headers=JSON)
        ok = await c.post("/v1/completions", json=COMPLETION)
    assert refused.status_code == 400
    assert ok.status_code == 200, ok.text


# ---- GET /v1/models/{id} ---------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["/v1", ""])
async def test_a_served_model_is_retrieved_with_the_card_the_list_shows(prefix: str) -> None:
    async with client((MODEL, "alias")) as c:
        listed = (await c.get(f"{prefix}/models")).json()["data"]
        r = await c.get(f"{prefix}/models/alias")
    assert r.status_code == 200, r.text
    assert r.json() == listed[1]
    assert set(r.json()) == {"id", "object", "created", "owned_by", "max_model_len", "root", "parent"}
    assert r.json()["id"] == "alias" and r.json()["object"] == "model"
    assert r.json()["root"] == "alias" and r.json()["parent"] is None  # vLLM's card of a base model


@pytest.mark.parametrize("path", [f"/v1/models/{SLASHED}", "/v1/models/meta-llama%2FLlama-3.1-8B-Instruct"])
async def test_a_model_id_holding_a_slash_is_retrieved_plain_or_percent_encoded(path: str) -> None:
    async with client((MODEL, SLASHED)) as c:
        r = await c.get(path)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == SLASHED


async def test_an_unknown_model_id_is_404_model_not_found() -> None:
    async with client() as c:
        r = await c.get("/v1/models/no-such/model")
    error = assert_openai_error(r, 404, "model_not_found")
    assert error["param"] == "model" and "no-such/model" in error["message"]


async def test_the_openai_client_retrieves_a_model_whose_id_holds_a_slash() -> None:
    app = build_app(FakeEngine(), None, [MODEL, SLASHED], 2048)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                                  http_client=http) as sdk:
        card = await sdk.models.retrieve(SLASHED)
        with pytest.raises(openai.NotFoundError):
            await sdk.models.retrieve("missing")
    assert card.id == SLASHED and card.object == "model" and card.owned_by == "flashserve"


# ---- x-request-id --------------------------------------------------------------------------------


async def test_the_clients_request_id_is_echoed() -> None:
    async with client() as c:
        r = await c.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"


async def test_without_a_client_id_a_fresh_hex_id_comes_back_per_request() -> None:
    async with client() as c:
        first = (await c.get("/v1/models")).headers["x-request-id"]
        second = (await c.get("/v1/models")).headers["x-request-id"]
    assert HEX_ID.fullmatch(first) and HEX_ID.fullmatch(second) and first != second


@pytest.mark.parametrize("bad", ["x" * 257, "has space", "caf\u00e9", "tab\there"])
async def test_an_unfit_client_id_is_replaced_by_a_fresh_one(bad: str) -> None:
    async with client() as c:
        r = await c.get("/v1/models", headers={"x-request-id": bad.encode("utf-8")})
    assert HEX_ID.fullmatch(r.headers["x-request-id"])


async def test_a_client_id_of_256_characters_is_kept() -> None:
    async with client() as c:
        r = await c.get("/v1/models", headers={"x-request-id": "a" * 256})
    assert r.headers["x-request-id"] == "a" * 256


async def test_a_400_carries_the_request_id() -> None:
    async with client() as c:
        r = await c.post("/v1/completions", json={**COMPLETION, "max_tokens": 0}, headers={"x-request-id": "r400"})
    assert_openai_error(r, 400)
    assert r.headers["x-request-id"] == "r400"


async def test_a_404_carries_the_request_id() -> None:
    async with client() as c:
        r = await c.get("/v1/models/missing", headers={"x-request-id": "r404"})
    assert_openai_error(r, 404)
    assert r.headers["x-request-id"] == "r404"


async def test_a_streamed_response_carries_the_request_id() -> None:
    async with client() as c:
        r = await c.post("/v1/completions", json={**COMPLETION, "stream": True}, headers={"x-request-id": "rsse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    assert r.headers["x-request-id"] == "rsse"


async def test_the_guards_401_carries_the_request_id() -> None:
    async with client(api_keys=("sk-right",)) as c:
        r = await c.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "r401"})
    assert_openai_error(r, 401)
    assert r.headers["x-request-id"] == "r401"


async def test_the_guards_413_carries_the_request_id() -> None:
    async with client(max_body_bytes=10) as c:
        r = await c.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "r413"})
    assert_openai_error(r, 413, "request_too_large")
    assert r.headers["x-request-id"] == "r413"


async def test_health_carries_the_request_id() -> None:
    async with client() as c:
        r = await c.get("/health", headers={"x-request-id": "rhealth"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rhealth"


class BrokenEngine(FakeEngine):
    """An engine whose health check raises something no handler expects."""

    def is_healthy(self) -> bool:
        raise RuntimeError("unexpected")


async def test_a_500_for_an_unexpected_exception_carries_the_request_id() -> None:
    async with client(engine=BrokenEngine(), raise_app_exceptions=False) as c:
        r = await c.get("/health", headers={"x-request-id": "r500"})
    assert_openai_error(r, 500)
    assert r.headers["x-request-id"] == "r500"


async def test_cors_lets_browsers_read_the_request_id() -> None:
    async with client(allowed_origins=("https://app.example",)) as c:
        r = await c.get("/v1/models", headers={"Origin": "https://app.example"})
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    assert r.headers["x-request-id"]


async def test_the_request_log_line_names_the_id_the_response_carried(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flashserve.requests")
    async with client() as c:
        r = await c.post("/v1/completions", json=COMPLETION)
    (line,) = [rec.getMessage() for rec in caplog.records if rec.name == "flashserve.requests"]
    assert f"request {r.json()['id']} finished:" in line
    assert line.endswith(f" x_request_id={r.headers['x-request-id']}")


# ---- CORS for the OpenAI SDKs ----------------------------------------------------------------------


async def test_the_js_sdks_preflight_passes_with_the_default_allowed_headers() -> None:
    async with client(allowed_origins=("*",)) as c:
        r = await c.options("/v1/chat/completions", headers={
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-stainless-os,x-stainless-lang,authorization,content-type"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    allowed = r.headers["access-control-allow-headers"].lower()
    assert all(h in allowed for h in ("x-stainless-os", "x-stainless-lang", "authorization", "content-type"))


def test_the_command_line_allows_any_request_header_by_default() -> None:
    assert to_configs(build_parser({}).parse_args(["serve"])).api.allowed_headers == ("*",)
