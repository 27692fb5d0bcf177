"""The draft model of speculative decoding's draft-model method, built beside the target's runner
(`worker/drafter.py` runs it)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from flashserve.attention import get_backend_cls
from flashserve.attention.kv_quant import resolve_kv_cache_dtype
from flashserve.model_loader import load
from flashserve.worker.assembly import attention_dtype, pick_backend, pick_device
from flashserve.worker.drafter import Drafter

logger = logging.getLogger(__name__)


def build_drafter(draft_model: str, model_config: Any, num_pages: int, page_size: int) -> tuple[Drafter, Any]:
    """Loads the draft model (`model_config` with the draft's path) and its KV pool of `num_pages`
    pages on the target's device; returns the drafter and the loaded model."""
    config = replace(model_config, model=draft_model, lora=None, tensor_parallel_size=1)
    device = pick_device(config.device)
    loaded = load(config, device)
    shape = loaded.attention
    backend_name = pick_backend(config.attention_backend, device)
    attn_dtype = attention_dtype(config, loaded.dtype, device, backend_name)
    backend = get_backend_cls(backend_name)(
        shape.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, attn_dtype, device, shape.sm_scale,
        num_qo_heads=shape.num_heads, kv_cache_dtype=resolve_kv_cache_dtype("auto", attn_dtype),
    )  # fmt: skip
    logger.info("draft model %s on %s (%s), its own KV pool of %d pages", loaded.name, device, loaded.dtype, num_pages)
    return Drafter(loaded.model, backend, device, page_size), loaded
