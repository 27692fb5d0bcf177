"""Dummy models (`load_format="dummy"`): random weights in a real model's shapes, for benchmarks where
no checkpoint can be downloaded. The config comes from a built-in shape name (`DUMMY_SHAPES`), a
config.json or an HF id/dir's config; the native path draws its weights per tensor
(`checkpoint.DummyCheckpoint`), the generic path builds a transformers model (`build_dummy`).
"""

from __future__ import annotations

from typing import Any

import torch

_LLAMA3_COMMON: dict[str, Any] = {
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

# Llama 3.1's RoPE scaling (8B and 70B alike).
_LLAMA31_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# config.json contents of the built-in dummy shapes (legacy rope keys: every transformers version
# reads them).
DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **_LLAMA3_COMMON,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "intermediate_size": 14336,
        "tie_word_embeddings": False,
        "rope_scaling": dict(_LLAMA31_ROPE),
    },
    "llama-3.1-70b": {
        **_LLAMA3_COMMON,
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "head_dim": 128,
        "intermediate_size": 28672,
        "tie_word_embeddings": False,
        "rope_scaling": dict(_LLAMA31_ROPE),
    },
    "llama-3.2-1b": {
        **_LLAMA3_COMMON,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "intermediate_size": 8192,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def dummy_hf_config(source: str) -> Any:
    """The config of a dummy model: a built-in shape name, a config.json, or an HF id/dir."""
    from transformers import AutoConfig

    shape = DUMMY_SHAPES.get(source.lower())
    if shape is not None:
        fields = dict(shape)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    if not source:
        raise ValueError(f"load_format=dummy needs a model: one of {', '.join(DUMMY_SHAPES)} or a config.json")
    return AutoConfig.from_pretrained(source)


def build_dummy(hf_config: Any, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # Built directly on the target device in the target dtype: one allocation, and the random
    # init (normal, std = initializer_range, 0.02 by default) runs there, fast on a GPU.
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
