"""The API's errors in OpenAI's shape and status codes; the models list and health check."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fake_engine import MODEL, FakeEngine, api_client, ask, complete, post
from flashserve.message.errors import EngineDead

pytestmark = pytest.mark.anyio


# ---- errors ------------------------------------------------------------------------------------


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


async def test_malformed_json_is_400(tokenizer: Any) -> None:
    async with api_client(FakeEngine(), tokenizer) as client:
        headers = {"content-type": "application/json"}
        r = await client.post("/v1/chat/completions", content=b'{"model": ', headers=headers)
    assert_error(r, 400)
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_wrong_type_is_400_naming_the_field(tokenizer: Any) -> None:
    assert_error(await ask(FakeEngine(), tokenizer, max_tokens="ten"), 400, "max_tokens")


async def test_missing_messages_is_400(tokenizer: Any) -> None:
    assert_error(await post(FakeEngine(), tokenizer, "/v1/chat/completions", {"model": MODEL}), 400, "messages")


async def test_negative_max_tokens_is_400(tokenizer: Any) -> None:
    assert_error(await ask(FakeEngine(), tokenizer, max_tokens=-1), 400, "max_tokens")


async def test_temperature_above_two_is_400(tokenizer: Any) -> None:
    assert_error(await ask(FakeEngine(), tokenizer, temperature=5), 400, "temperature")


async def test_prompt_plus_max_tokens_over_the_context_is_400(tokenizer: Any) -> None:
    r = await complete(FakeEngine(), tokenizer, max_model_len=10, prompt=[1] * 8, max_tokens=3)
    assert_error(r, 400, "prompt", "context_length_exceeded")


async def test_prompt_filling_the_context_is_400(tokenizer: Any) -> None:
    r = await complete(FakeEngine(), tokenizer, max_model_len=10, prompt=[1] * 10)
    assert_error(r, 400, "prompt", "context_length_exceeded")


async def test_unknown_model_is_404_model_not_found(tokenizer: Any) -> None:
    assert_error(await ask(FakeEngine(), tokenizer, model="gpt-4"), 404, "model", "model_not_found")


@pytest.mark.parametrize(
    "field, value", [("functions", [{"name": "f"}]), ("function_call", {"name": "f"})]
)
async def test_unimplemented_chat_feature_is_400(tokenizer: Any, field: str, value: Any) -> None:
    r = await ask(FakeEngine(), tokenizer, **{field: value})
    assert_error(r, 400, field, "unsupported_parameter")


async def test_non_text_content_part_is_400(tokenizer: Any) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    body = {"messages": [{"role": "user", "content": parts}]}
    r = await post(FakeEngine(), tokenizer, "/v1/chat/completions", body)
    assert_error(r, 400, "messages")


async def test_chat_without_a_tokenizer_is_400() -> None:
    assert_error(await ask(FakeEngine(), None), 400, "messages")


async def test_text_prompt_without_a_tokenizer_is_400() -> None:
    assert_error(await complete(FakeEngine(), None, prompt="hi"), 400, "prompt")


async def test_token_id_outside_the_vocabulary_is_400(tokenizer: Any) -> None:
    r = await complete(FakeEngine(), tokenizer, prompt=[len(tokenizer)])
    assert_error(r, 400, "prompt")


async def test_dead_engine_is_503(tokenizer: Any) -> None:
    assert_error(await ask(FakeEngine(dead=True), tokenizer), 503)


class RefusingEngine(FakeEngine):
    """An engine whose generate() raises at the call rather than at the first step."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: Any, group: Any = None,
                 cache_salt: Any = None, stream: bool = True) -> Any:
        raise EngineDead("stopped")


async def test_engine_refusing_at_the_call_is_503(tokenizer: Any) -> None:
    assert_error(await ask(RefusingEngine(), tokenizer), 503, code="engine_dead")


async def test_engine_error_before_any_token_is_500(tokenizer: Any) -> None:
    r = await ask(FakeEngine(error_after=0), tokenizer)
    assert_error(r, 500)
    assert "boom" in r.json()["error"]["message"]


async def test_engine_error_after_tokens_fails_the_whole_non_streaming_request(tokenizer: Any) -> None:
    assert_error(await ask(FakeEngine(error_after=2), tokenizer), 500)


async def test_unknown_route_is_404_in_openai_shape(tokenizer: Any) -> None:
    async with api_client(FakeEngine(), tokenizer) as client:
        assert_error(await client.get("/v1/nothing"), 404)


# ---- models and health -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/models"])
async def test_models_lists_every_served_name(tokenizer: Any, path: str) -> None:
    async with api_client(FakeEngine(), tokenizer, max_model_len=512) as client:
        body = (await client.get(path)).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL, "alias"]
    card = body["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "flashserve" and card["max_model_len"] == 512
    assert isinstance(card["created"], int)


async def test_health_is_200_when_the_engine_is_healthy(tokenizer: Any) -> None:
    async with api_client(FakeEngine(), tokenizer) as client:
        r = await client.get("/health")
    assert r.status_code == 200 and r.json() == {}


async def test_health_is_503_when_the_engine_is_not(tokenizer: Any) -> None:
    async with api_client(FakeEngine(healthy=False), tokenizer) as client:
        assert_error(await client.get("/health"), 503)

