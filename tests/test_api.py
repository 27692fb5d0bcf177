"""The OpenAI-compatible API over a fake engine: shapes, parameters, errors (non-streaming)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from fake_engine import FakeEngine, smollm2_tokenizer
from flashserve.api import protocol
from flashserve.api.server import build_app

pytestmark = pytest.mark.anyio
MODEL = "smollm2"
EOS = (2,)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return smollm2_tokenizer()


def make_client(engine: FakeEngine, tokenizer: Any, max_model_len: int = 2048) -> httpx.AsyncClient:
    app = build_app(engine, tokenizer, [MODEL, "alias"], max_model_len, eos_token_ids=EOS)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def post(engine: FakeEngine, tokenizer: Any, path: str, body: Any, **kw: Any) -> httpx.Response:
    async with make_client(engine, tokenizer, **kw) as client:
        return await client.post(path, json=body)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}


def hi_prompt(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": "Hi"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def only_params(engine: FakeEngine):
    (params,) = engine.params.values()
    return params


# ---- schemas -----------------------------------------------------------------------------------


def test_schema_rejects_a_string_where_an_integer_belongs() -> None:
    with pytest.raises(ValidationError):
        protocol.CompletionRequest.model_validate({"prompt": "x", "max_tokens": "5"})


def test_schema_ignores_unknown_fields() -> None:
    req = protocol.ChatCompletionRequest.model_validate({**chat(), "user": "u1", "whatever": 3})
    assert req.messages[0].content == "Hi"


def test_sampling_params_take_openai_defaults() -> None:
    params = protocol.to_sampling_params(protocol.CompletionRequest(prompt="x"), 7, EOS)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 1.0, 1.0, -1)
    assert params.eos_token_ids == EOS and params.seed is None


def test_seeded_choice_i_uses_seed_plus_i() -> None:
    base = protocol.to_sampling_params(protocol.CompletionRequest(prompt="x", seed=10), 4, ())
    assert [protocol.for_choice(base, i).seed for i in range(3)] == [10, 11, 12]


# ---- shapes ------------------------------------------------------------------------------------


async def test_chat_completion_has_openai_shape_and_usage(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/chat/completions", chat())
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello, world!"}, "logprobs": None, "finish_reason": "stop"}
    ]
    prompt_len = len(hi_prompt(tokenizer))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4, "total_tokens": prompt_len + 4}


async def test_completion_has_openai_shape_and_usage(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/completions", {"model": MODEL, "prompt": "Hello world", "max_tokens": 2})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "Hello,", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


async def test_chat_prompt_is_the_chat_template_with_generation_prompt(tokenizer: Any) -> None:
    engine = FakeEngine()
    await post(engine, tokenizer, "/v1/chat/completions", chat())
    assert list(engine.prompts.values()) == [hi_prompt(tokenizer)]


async def test_text_content_parts_are_joined_into_the_message(tokenizer: Any) -> None:
    engine = FakeEngine()
    parts = [{"type": "text", "text": "Hi"}]
    await post(engine, tokenizer, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    plain = FakeEngine()
    await post(plain, tokenizer, "/v1/chat/completions", chat())
    assert list(engine.prompts.values()) == list(plain.prompts.values())


async def test_requests_answer_with_the_requested_alias(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/chat/completions", {**chat(), "model": "alias"})
    assert r.status_code == 200 and r.json()["model"] == "alias"


async def test_n_two_gives_two_choices_with_indices(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/chat/completions", chat(n=2, seed=5))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 8
    rid = body["id"]
    assert sorted(engine.params) == [f"{rid}-0", f"{rid}-1"]
    assert [engine.params[f"{rid}-{i}"].seed for i in range(2)] == [5, 6]


async def test_max_completion_tokens_is_an_alias_of_max_tokens(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/chat/completions", chat(max_completion_tokens=3))
    assert only_params(engine).max_tokens == 3 and r.json()["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_defaults_to_the_rest_of_the_context(tokenizer: Any) -> None:
    engine = FakeEngine()
    await post(engine, tokenizer, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]}, max_model_len=100)
    assert only_params(engine).max_tokens == 97


@pytest.mark.parametrize("stop, expected", [("###", ("###",)), (["a", "bc"], ("a", "bc")), (None, ())])
async def test_stop_string_or_list_reaches_sampling_params(tokenizer: Any, stop: Any, expected: tuple) -> None:
    engine = FakeEngine()
    await post(engine, tokenizer, "/v1/completions", {"model": MODEL, "prompt": "x", "stop": stop, "stop_token_ids": [7]})
    assert only_params(engine).stop == expected and only_params(engine).stop_token_ids == (7,)


async def test_sampling_fields_and_eos_ids_reach_sampling_params(tokenizer: Any) -> None:
    engine = FakeEngine()
    body = chat(temperature=0, top_p=0.5, top_k=20, min_p=0.1, repetition_penalty=1.1, frequency_penalty=0.5,
                presence_penalty=-0.5, ignore_eos=True, min_tokens=1, skip_special_tokens=False, max_tokens=4)
    await post(engine, tokenizer, "/v1/chat/completions", body)
    params = only_params(engine)
    assert params.greedy and (params.top_p, params.top_k, params.min_p) == (0.5, 20, 0.1)
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == (1.1, 0.5, -0.5)
    assert params.ignore_eos and params.min_tokens == 1 and not params.skip_special_tokens
    assert params.eos_token_ids == EOS


async def test_token_id_prompt_goes_to_the_engine_unchanged(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7]})
    assert list(engine.prompts.values()) == [[5, 6, 7]] and r.json()["usage"]["prompt_tokens"] == 3


async def test_a_batch_of_prompts_gives_one_choice_per_prompt(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, "/v1/completions", {"model": MODEL, "prompt": [[5, 6], [7]], "max_tokens": 1})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["prompt_tokens"] == 3
    assert sorted(engine.prompts.values()) == [[5, 6], [7]]


async def test_token_id_prompts_work_without_a_tokenizer() -> None:
    r = await post(FakeEngine(), None, "/v1/completions", {"model": MODEL, "prompt": [1, 2]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


async def test_ignored_openai_fields_are_accepted(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/chat/completions", chat(user="u", logit_bias={}, tool_choice="none"))
    assert r.status_code == 200


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
    async with make_client(FakeEngine(), tokenizer) as client:
        r = await client.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_wrong_type_is_400_naming_the_field(tokenizer: Any) -> None:
    assert_error(await post(FakeEngine(), tokenizer, "/v1/chat/completions", chat(max_tokens="ten")), 400, "max_tokens")


async def test_missing_messages_is_400(tokenizer: Any) -> None:
    assert_error(await post(FakeEngine(), tokenizer, "/v1/chat/completions", {"model": MODEL}), 400, "messages")


async def test_negative_max_tokens_is_400(tokenizer: Any) -> None:
    assert_error(await post(FakeEngine(), tokenizer, "/v1/chat/completions", chat(max_tokens=-1)), 400, "max_tokens")


async def test_temperature_above_two_is_400(tokenizer: Any) -> None:
    assert_error(await post(FakeEngine(), tokenizer, "/v1/chat/completions", chat(temperature=5)), 400, "temperature")


async def test_prompt_plus_max_tokens_over_the_context_is_400(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/completions", {"model": MODEL, "prompt": [1] * 8, "max_tokens": 3}, max_model_len=10)
    assert_error(r, 400, "prompt", "context_length_exceeded")


async def test_prompt_filling_the_context_is_400(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/completions", {"model": MODEL, "prompt": [1] * 10}, max_model_len=10)
    assert_error(r, 400, "prompt", "context_length_exceeded")


async def test_unknown_model_is_404_model_not_found(tokenizer: Any) -> None:
    assert_error(await post(FakeEngine(), tokenizer, "/v1/chat/completions", chat(model="gpt-4")), 404, "model", "model_not_found")


@pytest.mark.parametrize("field, value", [("logprobs", True), ("tools", [{"type": "function"}]), ("logit_bias", {"5": 1})])
async def test_unimplemented_chat_feature_is_400(tokenizer: Any, field: str, value: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/chat/completions", chat(**{field: value}))
    assert_error(r, 400, field, "unsupported_parameter")


async def test_non_text_content_part_is_400(tokenizer: Any) -> None:
    parts = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    r = await post(FakeEngine(), tokenizer, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})
    assert_error(r, 400, "messages")


async def test_chat_without_a_tokenizer_is_400() -> None:
    assert_error(await post(FakeEngine(), None, "/v1/chat/completions", chat()), 400, "messages")


async def test_text_prompt_without_a_tokenizer_is_400() -> None:
    assert_error(await post(FakeEngine(), None, "/v1/completions", {"model": MODEL, "prompt": "hi"}), 400, "prompt")


async def test_token_id_outside_the_vocabulary_is_400(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/completions", {"model": MODEL, "prompt": [len(tokenizer)]})
    assert_error(r, 400, "prompt")


async def test_dead_engine_is_503(tokenizer: Any) -> None:
    assert_error(await post(FakeEngine(dead=True), tokenizer, "/v1/chat/completions", chat()), 503)


async def test_engine_error_before_any_token_is_500(tokenizer: Any) -> None:
    r = await post(FakeEngine(error_after=0), tokenizer, "/v1/chat/completions", chat())
    assert_error(r, 500)
    assert "boom" in r.json()["error"]["message"]


async def test_engine_error_after_tokens_fails_the_whole_non_streaming_request(tokenizer: Any) -> None:
    assert_error(await post(FakeEngine(error_after=2), tokenizer, "/v1/chat/completions", chat()), 500)


async def test_unknown_route_is_404_in_openai_shape(tokenizer: Any) -> None:
    async with make_client(FakeEngine(), tokenizer) as client:
        assert_error(await client.get("/v1/nothing"), 404)


# ---- models and health -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/models"])
async def test_models_lists_every_served_name(tokenizer: Any, path: str) -> None:
    async with make_client(FakeEngine(), tokenizer, max_model_len=512) as client:
        body = (await client.get(path)).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL, "alias"]
    card = body["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "flashserve" and card["max_model_len"] == 512
    assert isinstance(card["created"], int)


async def test_health_is_200_when_the_engine_is_healthy(tokenizer: Any) -> None:
    async with make_client(FakeEngine(), tokenizer) as client:
        r = await client.get("/health")
    assert r.status_code == 200 and r.json() == {}


async def test_health_is_503_when_the_engine_is_not(tokenizer: Any) -> None:
    async with make_client(FakeEngine(healthy=False), tokenizer) as client:
        assert_error(await client.get("/health"), 503)
