"""logit_bias through the real engine (fake model: greedy picks token 7 of 64) and the HTTP app.

The server runs tokenizer-free, so a test sees which token came out through `stop_token_ids`: a
request that stops on its first token sampled that stop id.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from production_helpers import Stack, assert_openai_error, completion, serve_engine


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with serve_engine() as s:
        yield s


def first_token_is(stack: Stack, token: int, **extra: object) -> bool:
    body = completion(4, temperature=0, stop_token_ids=[token], **extra)
    body["ignore_eos"] = False
    r = httpx.post(f"{stack.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 1


def test_without_a_bias_the_greedy_token_comes_out(stack: Stack) -> None:
    assert first_token_is(stack, 7)
    assert not first_token_is(stack, 3)


def test_a_bias_of_plus_100_forces_a_token(stack: Stack) -> None:
    assert first_token_is(stack, 3, logit_bias={"3": 100})


def test_a_bias_of_minus_100_bans_the_greedy_token(stack: Stack) -> None:
    assert not first_token_is(stack, 7, logit_bias={"7": -100})


@pytest.mark.parametrize("bias", [{"64": 1}, {"abc": 1}, {"-1": 1}, {"5": 101}, {"5": -100.5}])
def test_an_out_of_range_bias_is_400(stack: Stack, bias: dict) -> None:
    r = httpx.post(f"{stack.url}/v1/completions", json=completion(2, logit_bias=bias))
    assert assert_openai_error(r, 400)["param"] == "logit_bias"
