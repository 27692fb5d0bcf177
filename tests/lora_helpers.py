"""LoRA adapters for the tests: written by PEFT itself from random weights (B non-zero), and PEFT's
own forward of them as the reference."""

from __future__ import annotations

import os
from typing import Any

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_random_adapter(peft_model: Any, name: str, *, r: int, alpha: float, modules: list[str], seed: int,
                       std: float = 0.05, rslora: bool = False) -> None:  # fmt: skip
    """Adds adapter `name` to a `PeftModel` (or makes the model one) with random A and B."""
    from peft import LoraConfig

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, use_rslora=rslora, lora_dropout=0.0)
    peft_model.add_adapter(name, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if f".{name}." in pname and ("lora_A" in pname or "lora_B" in pname):
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def peft_wrap(model: torch.nn.Module, name: str, **kwargs: Any) -> Any:
    """`model` as a PeftModel whose first adapter is `name` (random, as `add_random_adapter`)."""
    from peft import LoraConfig, get_peft_model

    first = LoraConfig(r=kwargs["r"], lora_alpha=kwargs["alpha"], target_modules=kwargs["modules"],
                       use_rslora=kwargs.get("rslora", False), lora_dropout=0.0)  # fmt: skip
    peft_model = get_peft_model(model, first, adapter_name=name)
    gen = torch.Generator().manual_seed(kwargs["seed"])
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if f".{name}." in pname and ("lora_A" in pname or "lora_B" in pname):
                p.copy_(torch.randn(p.shape, generator=gen) * kwargs.get("std", 0.05))
    return peft_model


def save_adapter(peft_model: Any, name: str, root: str) -> str:
    """Saves adapter `name` in PEFT's format; returns its folder."""
    peft_model.save_pretrained(root, selected_adapters=[name], safe_serialization=True)
    # PEFT saves a non-default adapter in a folder of its name.
    folder = os.path.join(root, name) if name != "default" else root
    assert os.path.isfile(os.path.join(folder, "adapter_model.safetensors")), os.listdir(root)
    return folder


@torch.no_grad()
def peft_logits(peft_model: Any, name: str | None, tokens: list[int]) -> torch.Tensor:
    """PEFT's float32 logits [L, V] of `tokens` with adapter `name` (None: the base model)."""
    ids = torch.tensor([tokens])
    if name is None:
        with peft_model.disable_adapter():
            return peft_model(input_ids=ids, use_cache=False).logits[0].float()
    peft_model.set_adapter(name)
    return peft_model(input_ids=ids, use_cache=False).logits[0].float()
