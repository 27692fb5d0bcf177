"""Hostile or broken requests: each is a 4xx in OpenAI's shape and the server stays healthy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fake_engine import MODEL, FakeEngine
from flashserve.api.options import APIOptions
from flashserve.api.server import build_app

pytestmark = pytest.mark.anyio
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
JSON = {"content-type": "application/json"}


def json_body(**fields: Any) -> bytes:
    import json

    return json.dumps({"model": MODEL, **fields}).encode()


HI = [{"role": "user", "content": "Hi"}]
CASES: dict[str, tuple[str, bytes, int]] = {
    "malformed json": (CHAT, b'{"model": "smollm2", "messages": [', 400),
    "not an object": (CHAT, b'[1, 2, 3]', 400),
    "null body": (CHAT, b"null", 400),
    "empty body": (COMPLETIONS, b"", 400),
    "invalid utf-8": (CHAT, b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    "deeply nested json": (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400),
    "max_tokens as a string": (CHAT, json_body(messages=HI, max_tokens="ten"), 400),
    "messages as a string": (CHAT, json_body(messages="Hi"), 400),
    "content as a number": (CHAT, json_body(messages=[{"role": "user", "content": 5}]), 400),
    "unknown role": (CHAT, json_body(messages=[{"role": "wizard", "content": "Hi"}]), 400),
    "prompt as an object": (COMPLETIONS, json_body(prompt={"text": "x"}), 400),
    "stream as a string": (COMPLETIONS, json_body(prompt="x", stream="yes"), 400),
    "negative max_tokens": (COMPLETIONS, json_body(prompt="x", max_tokens=-5), 400),
    "negative temperature": (CHAT, json_body(messages=HI, temperature=-0.1), 400),
    "negative top_k": (CHAT, json_body(messages=HI, top_k=-7), 400),
    "zero n": (CHAT, json_body(messages=HI, n=0), 400),
    "negative token id": (COMPLETIONS, json_body(prompt=[1, -2]), 400),
    "huge max_tokens": (CHAT, json_body(messages=HI, max_tokens=10**9), 400),
    "max_tokens past int64": (COMPLETIONS, json_body(prompt="x", max_tokens=2**80), 400),
    "huge n": (COMPLETIONS, json_body(prompt="x", n=10**6), 400),
    "empty messages": (CHAT, json_body(messages=[]), 400),
    "empty prompt": (COMPLETIONS, json_body(prompt=""), 400),
    "empty token list": (COMPLETIONS, json_body(prompt=[]), 400),
    "nan temperature": (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400),
    "unknown model": (CHAT, json_body(messages=HI, model="gpt-9"), 404),
}


@pytest.fixture
def client(smollm2_tokenizer: Any) -> Iterator[httpx.AsyncClient]:
    app = build_app(FakeEngine(), smollm2_tokenizer, [MODEL], 2048, options=APIOptions(max_body_bytes=1 << 20))
    yield httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def assert_refused_and_healthy(client: httpx.AsyncClient, r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (await client.get("/health")).status_code == 200
    ok = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("case", list(CASES))
async def test_a_broken_request_is_a_4xx_in_openai_shape_and_the_server_stays_healthy(
    client: httpx.AsyncClient, case: str
) -> None:
    path, body, status = CASES[case]
    r = await client.post(path, content=body, headers=JSON)
    await assert_refused_and_healthy(client, r, status)


async def test_a_10_mb_body_is_413(client: httpx.AsyncClient) -> None:
    body = json_body(prompt="x" * (10 * 1000 * 1000))
    r = await client.post(COMPLETIONS, content=body, headers=JSON)
    await assert_refused_and_healthy(client, r, 413)
    assert r.json()["error"]["code"] == "request_too_large"


async def test_a_chunked_body_growing_past_the_limit_is_413(client: httpx.AsyncClient) -> None:
    async def chunks() -> Any:  # no Content-Length: the limit has to count the bytes
        yield b'{"model": "smollm2", "prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    r = await client.post(COMPLETIONS, content=chunks(), headers=JSON)
    await assert_refused_and_healthy(client, r, 413)


async def test_a_body_under_the_limit_is_served(client: httpx.AsyncClient) -> None:
    r = await client.post(COMPLETIONS, content=json_body(prompt="word " * 1000, max_tokens=1), headers=JSON)
    assert r.status_code == 200, r.text


async def test_an_unknown_path_and_a_wrong_method_are_4xx_in_openai_shape(client: httpx.AsyncClient) -> None:
    await assert_refused_and_healthy(client, await client.get("/v1/engines"), 404)
    await assert_refused_and_healthy(client, await client.get(COMPLETIONS), 405)
