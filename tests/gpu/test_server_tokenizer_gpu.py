"""The server on the GPU with dummy Llama-3.1-8B weights and a real Llama-3 tokenizer whose last
entry (<|image|>, id 128256) is one past the model's 128,256 embedding rows: token ids past the
embedding are 400s, from token-id and text prompts alike, and the server keeps serving.

The tokenizer comes from `make gpu-tokenizer` (.whl/llama3-tokenizer, or FLASHSERVE_GPU_TOKENIZER).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from live_server import live_server

MODEL = "llama-3.1-8b"
VOCAB = 128256
BEYOND = "<|image|>"  # id 128256 in this tokenizer
TOKENIZER = os.environ.get("FLASHSERVE_GPU_TOKENIZER", str(Path(__file__).parents[2] / ".whl" / "llama3-tokenizer"))


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    if not os.path.isfile(os.path.join(TOKENIZER, "tokenizer.json")):
        pytest.fail(f"no Llama-3 tokenizer at {TOKENIZER}: run `make gpu-tokenizer` and carry .whl")
    args = ["--model", MODEL, "--load-format", "dummy", "--tokenizer", TOKENIZER,
            "--gpu-memory-utilization", "0.5", "--max-num-seqs", "32"]
    with live_server(args, timeout_s=400) as (base, _proc):
        yield base


def post(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": MODEL, "max_tokens": 4, **body}, timeout=120)


def assert_out_of_range(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and str(VOCAB) in error["message"], error


def assert_serving(base: str) -> None:
    assert httpx.get(f"{base}/health").status_code == 200
    r = post(base, prompt="The quick brown fox", ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_token_ids_past_the_embedding_are_400(server):
    assert_out_of_range(post(server, prompt=[1, 2, VOCAB]))
    assert_out_of_range(post(server, prompt=[[5, 6], [VOCAB + 1000]]))
    assert_out_of_range(post(server, prompt=[1, VOCAB], stream=True))
    assert_serving(server)


def test_text_that_tokenizes_past_the_embedding_is_400(server):
    assert_out_of_range(post(server, prompt=f"Describe this {BEYOND} please"))
    assert_serving(server)


def test_bad_ids_among_many_text_streams_fail_alone(server):
    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=120) as c:
            good = [c.post("/v1/completions", json={"model": MODEL, "prompt": f"Story number {i}: once upon a time",
                                                     "max_tokens": 32, "ignore_eos": True}) for i in range(24)]
            bad = [c.post("/v1/completions", json={"model": MODEL, "prompt": [7, VOCAB], "max_tokens": 8}),
                   c.post("/v1/completions", json={"model": MODEL, "prompt": f"x {BEYOND}", "max_tokens": 8})]
            return await asyncio.gather(*good, *bad)

    *good, bad_ids, bad_text = asyncio.run(main())
    assert [r.json()["usage"]["completion_tokens"] for r in good] == [32] * 24
    assert_out_of_range(bad_ids)
    assert_out_of_range(bad_text)
    assert_serving(server)
