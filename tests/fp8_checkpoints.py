"""FP8 checkpoints written from a model's weights in the published formats' exact tensor names,
dtypes and shapes (compressed-tensors, fbgemm_fp8), for the CPU and GPU tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from flashserve.layers.fp8 import FP8_DTYPE, dequantize_weight, quantize_weight_per_channel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ct_config(weights: str, dynamic: bool, ignore: list[str] | None = None) -> dict[str, Any]:
    """compressed-tensors' quantization_config, as llm-compressor writes it for FP8 schemes."""
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**args, "strategy": weights, "dynamic": False},
            "input_activations": {**args, "strategy": "token" if dynamic else "tensor", "dynamic": dynamic},
        }},
        "ignore": ["lm_head"] + (ignore or []), "kv_cache_scheme": None,
    }  # fmt: skip


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max().float() / 448.0
    return (w.float() / scale).to(FP8_DTYPE), scale.reshape(1)


def write_fp8_checkpoint(
    tmp: Path, hf: torch.nn.Module, config: LlamaConfig, qconfig: dict[str, Any], per_channel: bool,
    scale_dtype: torch.dtype = torch.float32, static_input: bool = False, skip: tuple[str, ...] = (),
) -> tuple[Path, torch.nn.Module]:  # fmt: skip
    """The checkpoint directory, and a float32 copy of `hf` holding the dequantized weights."""
    reference = copy.deepcopy(hf)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.endswith(PROJECTIONS) and not module.endswith(skip):
            if per_channel:
                q, s = quantize_weight_per_channel(p)
                s = s.to(scale_dtype)
                tensors[module + ".weight_scale"] = s.reshape(-1, 1)
            else:
                q, s = quantize_per_tensor(p)
                tensors[module + ".weight_scale"] = s.to(scale_dtype)
            tensors[name] = q
            if static_input:
                tensors[module + ".input_scale"] = torch.tensor([0.05])
            reference.get_parameter(name).data.copy_(dequantize_weight(q, s.float().reshape(-1).expand(q.shape[0]),
                                                                        torch.float32))
        elif name != "lm_head.weight" or not config.tie_word_embeddings:
            tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps({**config.to_dict(), "quantization_config": qconfig}))
    return tmp, reference


def with_quantization(config: LlamaConfig, qconfig: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(**{**config.to_dict(), "quantization_config": qconfig})


