"""API keys (`Authorization: Bearer`) and CORS."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fake_engine import MODEL, FakeEngine, chat
from flashserve.api.options import APIOptions
from flashserve.api.server import build_app

pytestmark = pytest.mark.anyio
KEYS = ("sk-first", "sk-second")


def client(**options: Any) -> httpx.AsyncClient:
    app = build_app(FakeEngine(), None, [MODEL], 2048, options=APIOptions(**options))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


COMPLETION = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}


def assert_401(r: httpx.Response, code: str | None) -> None:
    assert r.status_code == 401, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": None, "code": code}}
    assert r.headers["www-authenticate"] == "Bearer"


async def test_a_request_without_an_api_key_is_401() -> None:
    async with client(api_keys=KEYS) as c:
        assert_401(await c.post("/v1/completions", json=COMPLETION), None)


async def test_a_request_with_a_wrong_api_key_is_401_invalid_api_key() -> None:
    async with client(api_keys=KEYS) as c:
        r = await c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sk-third"})
        assert_401(r, "invalid_api_key")
        assert "sk-third" not in r.text  # never echo a credential


async def test_a_key_sent_another_way_than_bearer_is_401() -> None:
    async with client(api_keys=KEYS) as c:
        assert_401(await c.get("/v1/models", headers={"Authorization": "Basic sk-first"}), None)


@pytest.mark.parametrize("key", KEYS)
async def test_any_configured_api_key_is_accepted(key: str) -> None:
    async with client(api_keys=KEYS) as c:
        r = await c.post("/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text


async def test_health_and_metrics_stay_open_without_a_key() -> None:
    async with client(api_keys=KEYS) as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.get("/metrics")
    assert r.status_code == 200
    assert 'flashserve_request_errors_total{code="",type="invalid_request_error"}' not in r.text


async def test_refused_keys_are_counted_as_errors() -> None:
    async with client(api_keys=KEYS) as c:
        await c.get("/v1/models")
        text = (await c.get("/metrics")).text
    assert 'flashserve_request_errors_total{code="",type="invalid_request_error"} 1.0' in text


async def test_without_keys_no_authorization_is_needed() -> None:
    async with client() as c:
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 400  # no tokenizer here
        assert (await c.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_cors_preflight_from_an_allowed_origin_is_answered_without_a_key() -> None:
    async with client(api_keys=KEYS, allowed_origins=("https://app.example",)) as c:
        r = await c.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization, Content-Type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]


async def test_cors_headers_go_on_responses_to_an_allowed_origin_only() -> None:
    async with client(allowed_origins=("https://app.example",)) as c:
        ok = await c.get("/v1/models", headers={"Origin": "https://app.example"})
        other = await c.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers


async def test_without_allowed_origins_there_are_no_cors_headers() -> None:
    async with client() as c:
        r = await c.get("/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_an_empty_api_key_is_refused_at_start() -> None:
    with pytest.raises(ValueError):
        APIOptions(api_keys=("",))
