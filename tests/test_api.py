"""The OpenAI-compatible API over a fake engine: schemas, response shapes, parameters (non-streaming)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from fake_engine import EOS, MODEL, FakeEngine, api_client, ask, chat, complete, post
from flashserve.api import protocol, sampling
from flashserve.api.server import build_app
from flashserve.api.serving import TOKENIZE_INLINE_CHARS

pytestmark = pytest.mark.anyio


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
    params = sampling.to_sampling_params(protocol.CompletionRequest(prompt="x"), 7, EOS)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 1.0, 1.0, -1)
    assert params.eos_token_ids == EOS and params.seed is None


def test_seeded_choice_i_uses_seed_plus_i() -> None:
    base = sampling.to_sampling_params(protocol.CompletionRequest(prompt="x", seed=10), 4, ())
    assert [sampling.for_choice(base, i).seed for i in range(3)] == [10, 11, 12]


# ---- shapes ------------------------------------------------------------------------------------


async def test_chat_completion_has_openai_shape_and_usage(tokenizer: Any) -> None:
    r = await ask(FakeEngine(), tokenizer)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello, world!"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    prompt_len = len(hi_prompt(tokenizer))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4, "total_tokens": prompt_len + 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_completion_has_openai_shape_and_usage(tokenizer: Any) -> None:
    r = await complete(FakeEngine(), tokenizer, prompt="Hello world", max_tokens=2)
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "Hello,", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_prompt_is_the_chat_template_with_generation_prompt(tokenizer: Any) -> None:
    engine = FakeEngine()
    await ask(engine, tokenizer)
    assert list(engine.prompts.values()) == [hi_prompt(tokenizer)]


async def test_text_content_parts_are_joined_into_the_message(tokenizer: Any) -> None:
    engine = FakeEngine()
    parts = [{"type": "text", "text": "Hi"}]
    await post(engine, tokenizer, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})
    plain = FakeEngine()
    await ask(plain, tokenizer)
    assert list(engine.prompts.values()) == list(plain.prompts.values())


async def test_requests_answer_with_the_requested_alias(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/chat/completions", {**chat(), "model": "alias"})
    assert r.status_code == 200 and r.json()["model"] == "alias"


async def test_n_two_gives_two_choices_with_indices(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await ask(engine, tokenizer, n=2, seed=5)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 8
    rid = body["id"]
    assert sorted(engine.params) == [f"{rid}-0", f"{rid}-1"]
    assert [engine.params[f"{rid}-{i}"].seed for i in range(2)] == [5, 6]


async def test_max_completion_tokens_is_an_alias_of_max_tokens(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await ask(engine, tokenizer, max_completion_tokens=3)
    assert only_params(engine).max_tokens == 3 and r.json()["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_null_means_the_rest_of_the_context(tokenizer: Any) -> None:
    engine = FakeEngine()
    await complete(engine, tokenizer, max_model_len=100, prompt=[1, 2, 3], max_tokens=None)
    assert only_params(engine).max_tokens == 97


@pytest.mark.parametrize("stop, expected", [("###", ("###",)), (["a", "bc"], ("a", "bc")), (None, ())])
async def test_stop_string_or_list_reaches_sampling_params(tokenizer: Any, stop: Any, expected: tuple) -> None:
    engine = FakeEngine()
    await complete(engine, tokenizer, prompt="x", stop=stop, stop_token_ids=[7])
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
    r = await complete(engine, tokenizer, prompt=[5, 6, 7])
    assert list(engine.prompts.values()) == [[5, 6, 7]] and r.json()["usage"]["prompt_tokens"] == 3


async def test_a_batch_of_prompts_gives_one_choice_per_prompt(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await complete(engine, tokenizer, prompt=[[5, 6], [7]], max_tokens=1)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["prompt_tokens"] == 3
    assert sorted(engine.prompts.values()) == [[5, 6], [7]]


async def test_token_id_prompts_work_without_a_tokenizer() -> None:
    r = await complete(FakeEngine(), None, prompt=[1, 2])
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


async def test_eos_ids_fall_back_to_the_tokenizer_when_not_given(tokenizer: Any) -> None:
    engine = FakeEngine()
    app = build_app(engine, tokenizer, [MODEL], 2048)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        await client.post("/v1/chat/completions", json=chat())
    assert only_params(engine).eos_token_ids == (tokenizer.eos_token_id,)


async def test_omitted_model_means_the_first_served_name(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/v1/completions", {"prompt": [1]})
    assert r.status_code == 200 and r.json()["model"] == MODEL


async def test_ignored_openai_fields_are_accepted(tokenizer: Any) -> None:
    r = await ask(FakeEngine(), tokenizer, user="u", logit_bias={}, tool_choice="none")
    assert r.status_code == 200


class HeldTokenizer:
    """The real tokenizer, except that encoding a long text waits until `release` is set."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        if len(text) > TOKENIZE_INLINE_CHARS:
            assert self.release.wait(10), "never released"
        return self._tokenizer.encode(text, *args, **kwargs)


async def test_a_long_prompt_is_tokenized_while_other_requests_are_answered(tokenizer: Any) -> None:
    held = HeldTokenizer(tokenizer)
    async with api_client(FakeEngine(), held, max_model_len=8192) as client:
        long = asyncio.create_task(client.post("/v1/completions", json={"model": MODEL, "max_tokens": 2,
                                                                       "prompt": "word " * TOKENIZE_INLINE_CHARS}))
        short = await asyncio.wait_for(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 5)
        assert short.status_code == 200 and not long.done()
        held.release.set()
        r = await asyncio.wait_for(long, 10)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > TOKENIZE_INLINE_CHARS // 2
