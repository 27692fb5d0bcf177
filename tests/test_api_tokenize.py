"""vLLM's /tokenize, /detokenize and /tokenizer_info over the embedded model's tokenizer (a scripted engine), and the
rule on max_tokens 0: only a completion that echoes its prompt (prompt scoring) may ask for no
tokens."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from fake_engine import MODEL, PROMPT_LOGPROB, FakeEngine, api_client, ask, complete, post
from flashserve.api.options import APIOptions
from flashserve.api.server import build_app
from production_helpers import assert_openai_error

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


async def test_tokenize_gives_a_prompts_ids_their_count_and_the_context_length(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("Hello world")
    assert r.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}


async def test_tokenize_gives_the_token_strings_when_asked(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello world"))


async def test_tokenize_of_messages_gives_the_ids_a_chat_completion_sends_the_engine(tokenizer: Any) -> None:
    engine = FakeEngine()
    async with api_client(engine, tokenizer) as c:
        tokenized = (await c.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})).json()
        await c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    (prompt,) = engine.prompts.values()
    assert tokenized["tokens"] == prompt and tokenized["count"] == len(prompt)


async def test_detokenize_gives_the_text_of_token_ids(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    r = await post(FakeEngine(), tokenizer, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize("bad", [-1, 49152])
async def test_detokenize_refuses_a_token_id_outside_the_vocabulary_naming_it(tokenizer: Any, bad: int) -> None:
    engine = FakeEngine()
    async with api_client(engine, tokenizer) as c:
        r = await c.post("/detokenize", json={"tokens": [1, bad]})
        error = assert_openai_error(r, 400)
        assert error["param"] == "tokens" and str(bad) in error["message"] and "index 1" in error["message"]
        assert (await c.post("/detokenize", json={"tokens": [1]})).status_code == 200  # still serving


async def test_tokenizer_info_gives_the_special_tokens_and_the_chat_template(tokenizer: Any) -> None:
    async with api_client(FakeEngine(), tokenizer) as c:
        info = (await c.get("/tokenizer_info")).json()
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["tokenizer_class"]


async def test_tokenize_refuses_a_body_with_neither_prompt_nor_messages(tokenizer: Any) -> None:
    assert_openai_error(await post(FakeEngine(), tokenizer, "/tokenize", {"model": MODEL}), 400)


async def test_tokenize_of_an_unknown_model_is_a_404(tokenizer: Any) -> None:
    r = await post(FakeEngine(), tokenizer, "/tokenize", {"model": "nope", "prompt": "Hi"})
    assert assert_openai_error(r, 404, "model_not_found")["param"] == "model"


async def test_the_tokenizer_endpoints_need_the_api_key(tokenizer: Any) -> None:
    app = build_app(FakeEngine(), tokenizer, [MODEL], 2048, options=APIOptions(api_keys=("secret",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        assert_openai_error(await c.post("/tokenize", json={"prompt": "Hi"}), 401)
        assert_openai_error(await c.post("/detokenize", json={"tokens": [1]}), 401)
        assert_openai_error(await c.get("/tokenizer_info"), 401)
        keyed = await c.post("/tokenize", json={"prompt": "Hi"}, headers={"Authorization": "Bearer secret"})
        assert keyed.status_code == 200


# ---- max_tokens 0 --------------------------------------------------------------------------------


async def test_a_completion_without_echo_may_not_ask_for_0_tokens(tokenizer: Any) -> None:
    error = assert_openai_error(await complete(FakeEngine(), tokenizer, prompt="Hi", max_tokens=0), 400)
    assert error["param"] == "max_tokens" and "echo" in error["message"]


async def test_a_chat_completion_may_not_ask_for_0_tokens(tokenizer: Any) -> None:
    error = assert_openai_error(await ask(FakeEngine(), tokenizer, max_tokens=0), 400)
    assert error["param"] == "max_tokens"


async def test_an_echoed_completion_of_0_tokens_answers_the_prompt_with_its_logprobs_alone(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await complete(engine, tokenizer, prompt="Hi there", max_tokens=0, echo=True, logprobs=1)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    ids = tokenizer.encode("Hi there")
    assert choice["text"] == "Hi there" and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] == len(ids)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert choice["logprobs"]["token_logprobs"] == [None] + [PROMPT_LOGPROB] * (len(ids) - 1)
    (params,) = engine.params.values()
    assert params.max_tokens == 0 and params.prompt_logprobs == 1


async def test_an_echoed_completion_of_0_tokens_without_logprobs_answers_the_prompt(tokenizer: Any) -> None:
    r = await complete(FakeEngine(), tokenizer, prompt="Hi there", max_tokens=0, echo=True)
    (choice,) = r.json()["choices"]
    assert choice["text"] == "Hi there" and choice["logprobs"] is None and choice["finish_reason"] == "length"
