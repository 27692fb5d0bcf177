"""One process's runner (no tensor parallelism): the model loaded (`model_loader.load`), the KV cache
sized and allocated in the memory left, the backend, sampler and runner built around them, and on
CUDA the kernels warmed up and decode graphs captured. `executor/worker.py` builds a tensor-parallel
rank's runner from the same pieces (`worker/assembly.py`)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from flashserve.attention import get_backend_cls
from flashserve.attention.cascade import cascade_policy
from flashserve.attention.kv_quant import resolve_kv_cache_dtype
from flashserve.config import CacheConfig, ModelConfig
from flashserve.model_loader import LoadedModel, load
from flashserve.models.llama import NativeCausalLM
from flashserve.worker.assembly import (
    attention_dtype, backend_options, capture_decode_graphs, kv_page_bytes, num_kv_pages, pick_backend, pick_device,
    pick_sampler, warm_up,
)  # fmt: skip
from flashserve.worker.runner import ModelRunner

logger = logging.getLogger(__name__)


def build_runner(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    seed: int | None = None,
    *,
    cuda_graph: bool = True,
    max_batch_size: int = 256,
) -> tuple[ModelRunner, LoadedModel, int]:
    """Loads the model, sizes and allocates the KV cache, builds the backend, sampler and runner;
    on CUDA warms the kernels up and captures decode graphs before returning.

    Returns (runner, loaded model with max_model_len capped by the cache, number of pages).
    """
    t0 = time.perf_counter()
    device = pick_device(model_config.device)
    loaded = load(model_config, device)
    model, shape = loaded.model, loaded.attention
    backend_name = pick_backend(model_config.attention_backend, device)
    attn_dtype = attention_dtype(model_config, loaded.dtype, device, backend_name)
    kv_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, attn_dtype)
    page_size = cache_config.page_size
    t_loaded = time.perf_counter()
    page_bytes = kv_page_bytes(shape.num_layers, page_size, shape.num_kv_heads, shape.head_dim, kv_dtype)
    num_pages = num_kv_pages(cache_config, page_bytes, device)
    backend = get_backend_cls(backend_name)(
        shape.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, attn_dtype, device, shape.sm_scale,
        num_qo_heads=shape.num_heads, kv_cache_dtype=kv_dtype, **backend_options(model_config, backend_name),
    )  # fmt: skip
    t_kv = time.perf_counter()
    capacity = (num_pages - 1) * page_size  # page 0 is the KV cache manager's scratch page
    if capacity < loaded.max_model_len:
        logger.warning("KV cache holds %d tokens; max_model_len %d lowered to it", capacity, loaded.max_model_len)
        loaded = replace(loaded, max_model_len=capacity)
    logger.info(
        "model %s on %s (%s, %s path), %s attention, KV cache %d pages x %d tokens = %d tokens (%s, %.2f GB); "
        "start-up: model loaded in %.1f s, KV cache sized and allocated in %.1f s",
        loaded.name, device, loaded.dtype, "native" if loaded.spec is not None else "HF", backend_name,
        num_pages, page_size, num_pages * page_size, kv_dtype, num_pages * page_bytes / 1e9, t_loaded - t0,
        t_kv - t_loaded,
    )
    sampler = pick_sampler(device, model_config.seed if seed is None else seed)
    runner = ModelRunner(model, device, backend, sampler, page_size, cascade_policy(model_config.cascade_attention))
    compiled = isinstance(model, NativeCausalLM) and model.model.compiled
    if device.type == "cuda" or compiled:
        warm_up(runner, num_pages)
        if cuda_graph and backend_name == "flashinfer":
            capture_decode_graphs(runner, model, max_batch_size)
        elif cuda_graph:
            logger.info("CUDA graphs need the FlashInfer backend; decoding eagerly")
    return runner, loaded, num_pages
