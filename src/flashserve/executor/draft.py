"""The draft model of speculative decoding's draft-model method, built beside the target's runner
(`worker/drafter.py` runs it). `executor/build.py` loads it (`load_draft`) before it sizes the KV
cache, so that the draft's weights are out of the memory it measures and each page of the budget
also pays for the draft's page of the same id; then builds the drafter on as many pages as the
target has (`build_drafter`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from flashserve.attention import get_backend_cls
from flashserve.attention.kv_quant import resolve_kv_cache_dtype
from flashserve.model_loader import LoadedModel, load
from flashserve.worker.assembly import attention_dtype, kv_page_bytes, pick_backend
from flashserve.worker.drafter import Drafter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftModel:
    """A loaded draft model and what its KV pool will need."""

    loaded: LoadedModel
    backend_name: str
    attn_dtype: torch.dtype
    kv_dtype: torch.dtype
    page_bytes: int  # one page of its KV, all its layers, K and V
    weight_bytes: int  # its parameters and buffers on the device

    def kv_bytes(self, num_pages: int) -> int:
        return num_pages * self.page_bytes


def model_bytes(model: Any) -> int:
    """Bytes of a model's parameters and buffers (0 for a model that is not a torch module)."""
    module = getattr(model, "model", model)
    if not isinstance(module, torch.nn.Module):
        return 0
    # parameters() and buffers() yield a shared (tied) tensor once.
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def load_draft(draft_model: str, model_config: Any, device: torch.device, page_size: int) -> DraftModel:
    """Loads the draft model (`model_config` with the draft's path) on the target's `device`."""
    config = replace(model_config, model=draft_model, lora=None, tensor_parallel_size=1)
    loaded = load(config, device)
    shape = loaded.attention
    backend_name = pick_backend(config.attention_backend, device)
    attn_dtype = attention_dtype(config, loaded.dtype, device, backend_name)
    kv_dtype = resolve_kv_cache_dtype("auto", attn_dtype)
    page_bytes = kv_page_bytes(shape.num_layers, page_size, shape.num_kv_heads, shape.head_dim, kv_dtype)
    return DraftModel(loaded, backend_name, attn_dtype, kv_dtype, page_bytes, model_bytes(loaded.model))


def build_drafter(draft: DraftModel, num_pages: int, page_size: int, device: torch.device) -> Drafter:
    """The drafter over `draft`'s own KV pool of `num_pages` pages (the target's page ids)."""
    shape = draft.loaded.attention
    backend = get_backend_cls(draft.backend_name)(
        shape.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, draft.attn_dtype, device,
        shape.sm_scale, num_qo_heads=shape.num_heads, kv_cache_dtype=draft.kv_dtype,
    )  # fmt: skip
    logger.info("draft model %s on %s (%s): weights %.2f GB, its own KV pool of %d pages (%.2f GB), both counted "
                "in the memory sizing", draft.loaded.name, device, draft.loaded.dtype, draft.weight_bytes / 1e9,
                num_pages, draft.kv_bytes(num_pages) / 1e9)  # fmt: skip
    return Drafter(draft.loaded.model, backend, device, page_size)
