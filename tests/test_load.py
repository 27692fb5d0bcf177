"""`model_loader.load`: the ready model straight from a checkpoint's files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_model

from flashserve.config import ModelConfig
from flashserve.model_loader import load
from flashserve.model_loader.loader import load_model
from flashserve.models.native import NativeCausalLM

TIED = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256,
    "eos_token_id": 5, "tie_word_embeddings": True,
}  # fmt: skip


def test_a_tied_checkpoint_saved_as_the_gguf_cache_saves_it_loads_straight_into_the_native_model(
        tmp_path: Path) -> None:
    """The GGUF cache keeps a converted model's tied embedding once, under lm_head.weight (safetensors'
    `save_model`); the native model reads it as the embedding and no transformers model is built."""
    (tmp_path / "config.json").write_text(json.dumps(TIED))
    hf = load_model(ModelConfig(model=str(tmp_path / "config.json"), load_format="dummy", dtype="float32"), "cpu").model
    ckpt = tmp_path / "converted"
    ckpt.mkdir()
    save_model(hf, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(ckpt)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" not in f.keys()  # what makes this checkpoint differ
    loaded = load(ModelConfig(model=str(ckpt)), "cpu")
    assert isinstance(loaded.model, NativeCausalLM) and loaded.spec is not None
    torch.testing.assert_close(loaded.model.model.embed_tokens["weight"], hf.model.embed_tokens.weight)
    assert (loaded.eos_token_ids, loaded.vocab_size, loaded.attention.num_kv_heads) == ((5,), 97, 2)
