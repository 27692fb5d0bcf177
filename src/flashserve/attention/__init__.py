"""Attention backends, imported lazily so that the package loads without flashinfer."""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:class". Each backend's constructor takes
# (num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, sm_scale).
# "torch" is the fast PyTorch path (fused SDPA kernels); "reference" the readable oracle it and
# FlashInfer are tested against.
_BACKENDS = {
    "torch": "flashserve.attention.torch_sdpa:SdpaAttentionBackend",
    "reference": "flashserve.attention.torch_ref:TorchAttentionBackend",
    "flashinfer": "flashserve.attention.flashinfer:FlashInferAttentionBackend",
}


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend_cls(name: str) -> Any:
    """The backend class registered under `name`; imports its module only now."""
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(_BACKENDS)}") from None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)
