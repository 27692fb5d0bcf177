"""A LoRA adapter read from PEFT's format and checked against the base model, on the host.

PEFT saves an adapter as a folder: `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, ...) and `adapter_model.safetensors`, whose tensors are named like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (lora_A is [r, in], lora_B
[out, r]). The adapter's delta on a projection is `scaling * B @ A @ x`, scaling `lora_alpha / r`
(`lora_alpha / sqrt(r)` with rsLoRA). `load_adapter` reads a folder, or an HF id already in the
local HF cache (nothing is downloaded), and returns the adapter's weights by (layer, module) with
the scaling folded into B, in float32; anything the native forward cannot apply (a module other
than the seven projections, `modules_to_save`, DoRA, LoRA biases, a rank over the limit, a shape
that does not fit the base model) is refused with a `LoRAAdapterError` that names the adapter.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from flashserve.message.lora import LoRAAdapterError, LoRARequest

__all__ = ["MODULES", "LoRAAdapter", "load_adapter", "module_shapes", "resolve_adapter_path"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, in the order the native model fuses them.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights on the host: `weights[(layer, module)] = (A [r, in], B [out, r])`,
    float32, the scaling folded into B, for the whole (unsharded) model."""

    lora_int_id: int
    lora_name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(spec: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a whole `LlamaSpec`."""
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}  # fmt: skip


def resolve_adapter_path(lora: LoRARequest) -> str:
    """The folder of `lora.lora_path`: a local folder, or an HF repository id found in the local
    HF cache (huggingface_hub, local files only)."""
    path = os.path.expanduser(lora.lora_path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: {lora.lora_path!r} is a file, not a folder with "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE}")  # fmt: skip
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(lora.lora_path, local_files_only=True, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE])
    except HFValidationError:
        pass  # not a repository id either
    except Exception:  # noqa: BLE001 - not in the local cache (LocalEntryNotFoundError and kin)
        raise LoRAAdapterError(
            f"LoRA adapter {lora.lora_name!r}: {lora.lora_path!r} is neither a local folder nor an HF repository "
            f"in the local HF cache (adapters are not downloaded; save it to a folder or `hf download` it first)"
        ) from None
    raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: no folder {lora.lora_path!r}")


def _read_config(name: str, folder: str) -> dict[str, Any]:
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is missing in {folder}")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return config


def _check_config(name: str, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """(rank, scaling), or LoRAAdapterError for what the native forward does not apply."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: rank r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    if r > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {r} exceeds --max-lora-rank {max_rank}; "
                               f"start the server with --max-lora-rank {r} or more to serve it")  # fmt: skip
    if config.get("modules_to_save"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']} (whole modules "
                               f"replaced beside the adapter) is not supported; only LoRA weights on "
                               f"{', '.join(MODULES)} are")  # fmt: skip
    if config.get("use_dora"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: DoRA (use_dora) is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: LoRA biases (bias={config['bias']!r}) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: per-module ranks or alphas ({key}) are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unsupported = sorted(str(t).split(".")[-1] for t in targets if str(t).split(".")[-1] not in MODULES)
        if unsupported:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: target modules {unsupported} are not supported; "
                                   f"supported: {', '.join(MODULES)}")  # fmt: skip
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(scaling)


def _read_weights(name: str, folder: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(path):
        hint = " (adapter_model.bin is not read: save with safe_serialization)" if os.path.isfile(
            os.path.join(folder, "adapter_model.bin")) else ""  # fmt: skip
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is missing in {folder}{hint}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is not a readable safetensors file "
                               f"({exc})") from None  # fmt: skip


def load_adapter(lora: LoRARequest, spec: Any, max_rank: int) -> LoRAAdapter:
    """Reads and checks `lora`'s adapter for the whole model of `spec` (a `LlamaSpec`). Raises
    LoRAAdapterError naming the adapter and what is wrong."""
    name = lora.lora_name
    folder = resolve_adapter_path(lora)
    config = _read_config(name, folder)
    rank, scaling = _check_config(name, config, max_rank)
    tensors = _read_weights(name, folder)
    shapes = module_shapes(spec)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in MODULES:
            what = m.group(2) if m is not None else key
            raise LoRAAdapterError(f"LoRA adapter {name!r}: weights for {what!r} are not supported; an adapter may "
                                   f"target {', '.join(MODULES)} only")  # fmt: skip
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= spec.num_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} is for layer {layer}; the base model has "
                                   f"{spec.num_layers} layers")  # fmt: skip
        parts.setdefault((layer, module), {})[ab] = tensor
    if not parts:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} "
                                   f"but not both lora_A and lora_B")  # fmt: skip
        a, b = ab["A"], ab["B"]
        out_f, in_f = shapes[module]
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the base model needs ({rank}, {in_f}) and ({out_f}, {rank}) at rank {rank}: "
                f"the adapter was trained for another base model"
            )  # fmt: skip
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module}'s weights are not floating point")
        weights[layer, module] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoRAAdapter(lora.lora_int_id, name, rank, scaling, weights)
