"""A scripted EngineClient for API tests, and in-process clients of the app built over it.

FakeEngine.generate() echoes a fixed script of (token id, text) pairs, one output per token,
stopping at max_tokens ("length") or at the end of the script ("stop"); max_tokens 0 gives one
finished output with no token (and the prompt's logprobs when asked), as the engine does. It
records what it was asked (`prompts`, `params`, `groups`, `salts`), which requests were aborted or
closed early, can be told to fail, and can report prompt tokens as prefix-cached (`cached_tokens`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from flashserve.api.server import build_app
from flashserve.engine.llm_engine import check_token_ids
from flashserve.message.errors import EngineDead
from flashserve.message.outputs import RequestOutput, TokenLogprob
from flashserve.message.sampling_params import SamplingParams

MODEL = "smollm2"  # served as MODEL and "alias"
EOS = (2,)
SCRIPT: list[tuple[int, str]] = [(100, "Hello"), (101, ","), (102, " world"), (103, "!")]
PROMPT_LOGPROB = -1.5  # every prompt token's, when a request of max_tokens 0 asks for them


class FakeEngine:
    def __init__(
        self,
        script: list[tuple[int, str]] | None = None,
        *,
        delay: float = 0.0,  # seconds before each token
        max_model_len: int = 2048,
        error_after: int | None = None,  # tokens to emit before a finish_reason="error" output
        dead: bool = False,  # generate() raises EngineDead and is_healthy() is False
        healthy: bool = True,
        vocab_size: int = 49152,  # the embedded SmolLM2's embedding rows
        # num_cached_tokens of every output: a count, or a function of the prompt called once per request
        cached_tokens: int | Callable[[list[int]], int] = 0,
    ) -> None:
        self.script = list(script if script is not None else SCRIPT)
        self.delay = delay
        self.max_model_len = max_model_len
        self.error_after = error_after
        self.dead = dead
        self.healthy = healthy
        self.vocab_size = vocab_size
        self.cached_tokens = cached_tokens
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.aborted: list[str] = []  # abort(id) calls
        self.closed: list[str] = []  # iterators closed (or cancelled) before they finished
        self.finished: list[str] = []
        self.groups: dict[str, str | None] = {}
        self.salts: dict[str, str | None] = {}

    def is_healthy(self) -> bool:
        return self.healthy and not self.dead

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, group: str | None = None,
        cache_salt: str | None = None, stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDead("the engine loop died")
        check_token_ids(prompt_token_ids, self.vocab_size, "prompt")
        self.groups[request_id] = group
        self.prompts[request_id] = list(prompt_token_ids)
        self.params[request_id] = params
        self.salts[request_id] = cache_salt
        n_prompt = len(prompt_token_ids)
        cached = self.cached_tokens
        n_cached = cached(list(prompt_token_ids)) if callable(cached) else cached
        done = False
        try:
            if params.max_tokens == 0:  # the prompt alone, as the engine ends it: no token, "length"
                done = True
                scores = None if params.prompt_logprobs is None else [
                    None, *(TokenLogprob(t, PROMPT_LOGPROB, ((t, PROMPT_LOGPROB),)) for t in prompt_token_ids[1:])]
                yield RequestOutput(request_id, [], "", True, "length", n_prompt, 0, num_cached_tokens=n_cached,
                                    prompt_logprobs=scores)
                return
            for count, (token, text) in enumerate(self.script[: params.max_tokens], start=1):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self.error_after is not None and count > self.error_after:
                    done = True
                    yield RequestOutput(request_id, [], "", True, "error", n_prompt, count - 1, error="boom",
                                        num_cached_tokens=n_cached)
                    return
                last = count == min(len(self.script), params.max_tokens)
                reason = None
                if last:
                    reason = "length" if count == params.max_tokens else "stop"
                done = last
                yield RequestOutput(request_id, [token], text, last, reason, n_prompt, count,
                                    num_cached_tokens=n_cached)
        finally:
            (self.finished if done else self.closed).append(request_id)

    @property
    def request_ids(self) -> list[str]:
        return list(self.params)


# ---- clients for the API tests: the app over a FakeEngine, called in-process -------------------


def api_client(engine: FakeEngine, tokenizer: Any, max_model_len: int = 2048) -> httpx.AsyncClient:
    app = build_app(engine, tokenizer, [MODEL, "alias"], max_model_len, eos_token_ids=EOS)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def post(engine: FakeEngine, tokenizer: Any, path: str, body: Any, **kw: Any) -> httpx.Response:
    async with api_client(engine, tokenizer, **kw) as client:
        return await client.post(path, json=body)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}


async def ask(engine: FakeEngine, tokenizer: Any, **fields: Any) -> httpx.Response:
    """A chat completion of "Hi" with these extra fields."""
    return await post(engine, tokenizer, "/v1/chat/completions", chat(**fields))


async def complete(engine: FakeEngine, tokenizer: Any, max_model_len: int = 2048, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, **fields}
    return await post(engine, tokenizer, "/v1/completions", body, max_model_len=max_model_len)
