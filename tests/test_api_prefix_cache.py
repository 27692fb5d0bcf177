"""The API side of prefix caching: `cache_salt` in requests, `usage.prompt_tokens_details.cached_tokens`
in responses. The engine is a FakeEngine told how many prompt tokens to report as cached."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import httpx2
import openai
import pytest

from fake_engine import MODEL, FakeEngine, ask, complete, post
from flashserve.api.server import build_app
from production_helpers import assert_openai_error

pytestmark = pytest.mark.anyio
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


def handing_out(counts: Iterable[int]) -> Callable[[list[int]], int]:
    """A cached_tokens function giving each engine request the next count, whatever its prompt."""
    it = iter(counts)
    return lambda prompt: next(it)


def per_prompt(counts: dict[tuple[int, ...], list[int]]) -> Callable[[list[int]], int]:
    """A cached_tokens function giving the requests of each prompt that prompt's counts in turn, so
    the counts of a prompt's choices do not depend on the order the engine is called in."""
    left = {prompt: iter(c) for prompt, c in counts.items()}
    return lambda prompt: next(left[tuple(prompt)])


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def final_usage(r: httpx.Response) -> dict[str, Any]:
    """The usage of a stream's last chunk, the one include_usage adds."""
    assert r.status_code == 200, r.text
    blocks = r.text.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]", r.text
    last = json.loads(blocks[-2].removeprefix("data: "))
    assert last["choices"] == [], last
    return last["usage"]


STREAM = {"stream": True, "stream_options": {"include_usage": True}}


# ---- usage.prompt_tokens_details.cached_tokens ----------------------------------------------------


async def test_a_chat_response_reports_the_cached_prompt_tokens(tokenizer: Any) -> None:
    r = await ask(FakeEngine(cached_tokens=16), tokenizer)
    assert cached(r) == 16


async def test_a_completion_response_reports_the_cached_prompt_tokens(tokenizer: Any) -> None:
    r = await complete(FakeEngine(cached_tokens=3), tokenizer, prompt=[1, 2, 3, 4, 5])
    assert cached(r) == 3
    assert r.json()["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": [1, 2, 3, 4]})])
async def test_the_final_usage_chunk_of_a_stream_reports_the_cached_prompt_tokens(
    tokenizer: Any, path: str, body: dict[str, Any]
) -> None:
    r = await post(FakeEngine(cached_tokens=2), tokenizer, path, {"model": MODEL, **STREAM, **body})
    assert final_usage(r)["prompt_tokens_details"] == {"cached_tokens": 2}


async def test_cached_tokens_of_several_prompts_are_summed(tokenizer: Any) -> None:
    engine = FakeEngine(cached_tokens=per_prompt({(5, 6, 7): [3], (8, 9): [2]}))
    r = await complete(engine, tokenizer, prompt=[[5, 6, 7], [8, 9]])
    assert cached(r) == 5


async def test_with_n_choices_a_prompt_counts_once_with_its_fewest_cached_tokens(tokenizer: Any) -> None:
    # Choice 0 is not the one with the fewest, so counting only the first choice would show.
    engine = FakeEngine(cached_tokens=per_prompt({(5, 6, 7): [3, 1], (8, 9): [2, 0]}))
    r = await complete(engine, tokenizer, prompt=[[5, 6, 7], [8, 9]], n=2)
    assert cached(r) == 1 + 0


async def test_a_chat_with_n_choices_counts_its_fewest_cached_tokens(tokenizer: Any) -> None:
    r = await ask(FakeEngine(cached_tokens=handing_out([9, 4, 7])), tokenizer, n=3)
    assert cached(r) == 4


async def test_a_stream_with_n_choices_counts_each_prompt_once_with_its_fewest_cached_tokens(tokenizer: Any) -> None:
    engine = FakeEngine(cached_tokens=per_prompt({(5, 6, 7): [3, 1], (8, 9): [2, 0]}))
    body = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "n": 2, **STREAM}
    r = await post(engine, tokenizer, COMPLETIONS, body)
    assert final_usage(r)["prompt_tokens_details"] == {"cached_tokens": 1}


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_are_zero_when_nothing_was_cached(tokenizer: Any, stream: bool) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3], **(STREAM if stream else {})}
    r = await post(FakeEngine(), tokenizer, COMPLETIONS, body)
    usage = final_usage(r) if stream else r.json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_the_openai_client_reads_the_cached_tokens() -> None:
    app = build_app(FakeEngine(cached_tokens=2), None, [MODEL], 2048)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                                  http_client=http) as sdk:
        resp = await sdk.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2,
                                            extra_body={"cache_salt": "tenant-a"})
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 2


# ---- cache_salt -----------------------------------------------------------------------------------


async def test_a_chat_cache_salt_reaches_every_choices_engine_request(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await ask(engine, tokenizer, n=3, cache_salt="tenant-a")
    assert r.status_code == 200, r.text
    assert len(engine.salts) == 3 and set(engine.salts.values()) == {"tenant-a"}


async def test_a_completion_cache_salt_reaches_every_prompts_and_choices_engine_request(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await complete(engine, tokenizer, prompt=[[1, 2], [3, 4]], n=2, cache_salt="tenant-b")
    assert r.status_code == 200, r.text
    assert len(engine.salts) == 4 and set(engine.salts.values()) == {"tenant-b"}


async def test_a_streamed_requests_cache_salt_reaches_the_engine(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, CHAT, {"model": MODEL, "messages": HI, "stream": True, "cache_salt": "s"})
    assert r.status_code == 200, r.text
    assert list(engine.salts.values()) == ["s"]


async def test_without_cache_salt_the_engine_gets_none(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await complete(engine, tokenizer, prompt=[1, 2], n=2)
    assert r.status_code == 200, r.text
    assert list(engine.salts.values()) == [None, None]


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": [1, 2]})])
async def test_an_empty_cache_salt_is_400_naming_cache_salt(tokenizer: Any, path: str, body: dict[str, Any]) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, path, {"model": MODEL, **body, "cache_salt": ""})
    error = assert_openai_error(r, 400)
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
    assert "cache_salt" in error["message"]
    assert engine.request_ids == []


@pytest.mark.parametrize("salt", [5, True, ["a"], {"salt": "a"}])
@pytest.mark.parametrize("path, body", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": [1, 2]})])
async def test_a_non_string_cache_salt_is_400_naming_cache_salt(
    tokenizer: Any, path: str, body: dict[str, Any], salt: Any
) -> None:
    engine = FakeEngine()
    r = await post(engine, tokenizer, path, {"model": MODEL, **body, "cache_salt": salt})
    error = assert_openai_error(r, 400)
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
    assert engine.request_ids == []


async def test_a_null_cache_salt_means_no_salt(tokenizer: Any) -> None:
    engine = FakeEngine()
    r = await complete(engine, tokenizer, prompt=[1, 2], cache_salt=None)
    assert r.status_code == 200, r.text
    assert list(engine.salts.values()) == [None]
