"""One request never takes the server down: real `flashserve serve` processes on a small dummy
model whose embedding has SmolLM2's 49,152 rows.

- a token id past the embedding is a 400 naming it, with or without a tokenizer, and with a
  tokenizer that knows one more token than the model has rows;
- when the engine loop dies anyway, open requests end with an error and the process exits 1, so
  that a supervisor restarts it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from faulty_server import FAULT_TOKEN
from live_server import live_server

pytestmark = pytest.mark.slow

VOCAB = 49152  # the embedding rows of the dummy model, as in SmolLM2-135M
ADDED = "<|beyond_the_embedding|>"
TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
    "max_position_embeddings": 512, "eos_token_id": 2, "bos_token_id": 1, "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any) -> str:
    """SmolLM2's tokenizer with one added token, whose id (49,152) is past the model's embedding."""
    tok = smollm2_tokenizer
    saved = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(saved)
    from transformers import AutoTokenizer

    bigger = AutoTokenizer.from_pretrained(saved)
    bigger.add_tokens([ADDED], special_tokens=True)
    bigger.save_pretrained(saved)
    assert len(bigger) == VOCAB + 1 and bigger.convert_tokens_to_ids(ADDED) == VOCAB
    return str(saved)


def dummy_args(model_config: str, *extra: str) -> list[str]:
    return ["--load-format", "dummy", "--model", model_config, "--served-model-name", "tiny", *extra]


@pytest.fixture(scope="module")
def tokenizer_free(model_config: str) -> Iterator[str]:
    with live_server(dummy_args(model_config)) as (base, _):
        yield base


@pytest.fixture(scope="module")
def with_big_tokenizer(model_config: str, big_tokenizer: str) -> Iterator[str]:
    with live_server(dummy_args(model_config, "--tokenizer", big_tokenizer)) as (base, _):
        yield base


def complete(base: str, prompt: Any, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def assert_out_of_range(r: httpx.Response, token_id: int, param: str = "prompt") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert str(token_id) in error["message"] and str(VOCAB) in error["message"], error


def assert_still_serving(base: str) -> None:
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    r = complete(base, [1, 2, VOCAB - 1])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_token_id_past_the_embedding_is_400_on_a_tokenizer_free_server(tokenizer_free: str) -> None:
    assert_out_of_range(complete(tokenizer_free, [VOCAB]), VOCAB)
    assert_out_of_range(complete(tokenizer_free, [[1, 2], [1, 2, 10**6]]), 10**6)
    assert_still_serving(tokenizer_free)


def test_stop_token_id_past_the_embedding_is_400(tokenizer_free: str) -> None:
    assert_out_of_range(complete(tokenizer_free, [1, 2], stop_token_ids=[VOCAB + 5]), VOCAB + 5, "stop_token_ids")
    assert_still_serving(tokenizer_free)


def test_streaming_request_with_a_token_id_past_the_embedding_is_400(tokenizer_free: str) -> None:
    assert_out_of_range(complete(tokenizer_free, [5, VOCAB], stream=True), VOCAB)
    assert_still_serving(tokenizer_free)


def test_text_that_tokenizes_past_the_embedding_is_400(with_big_tokenizer: str) -> None:
    assert_out_of_range(complete(with_big_tokenizer, f"Hello {ADDED} world"), VOCAB)
    assert complete(with_big_tokenizer, "Hello world").status_code == 200


def test_chat_whose_template_output_is_past_the_embedding_is_400(with_big_tokenizer: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"say {ADDED}"}], "max_tokens": 2}
    r = httpx.post(f"{with_big_tokenizer}/v1/chat/completions", json=body, timeout=60)
    assert_out_of_range(r, VOCAB)
    assert_still_serving(with_big_tokenizer)


def test_a_tokenizer_larger_than_the_embedding_is_logged_at_start(
    model_config: str, big_tokenizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    from flashserve.config import ModelConfig
    from flashserve.model_loader.loader import load_model

    with caplog.at_level(logging.WARNING, logger="flashserve.model_loader.loader"):
        loaded = load_model(ModelConfig(model=model_config, load_format="dummy", tokenizer=big_tokenizer), "cpu")
    assert loaded.vocab_size == VOCAB
    assert any(str(VOCAB + 1) in r.getMessage() and str(VOCAB) in r.getMessage() for r in caplog.records)


def test_engine_death_fails_open_requests_and_exits_non_zero(model_config: str) -> None:
    with live_server(dummy_args(model_config), module="faulty_server") as (base, proc):
        events: list[str] = []

        def stream() -> None:
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        deadline_tokens = 50
        while len(events) < 2 and deadline_tokens:  # the stream is under way
            reader.join(0.1)
            deadline_tokens -= 1
        r = complete(base, [FAULT_TOKEN, 1])
        assert r.status_code in (500, 503), r.text
        reader.join(30)
        assert not reader.is_alive()
        assert events and '"error"' in events[-2 if events[-1] == "data: [DONE]" else -1], events[-3:]
        assert proc.wait(20) == 1
