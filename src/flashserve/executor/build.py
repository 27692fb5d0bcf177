"""One rank's runner, for one rank or any of N tensor-parallel ranks: the model (or the rank's
shard) loaded (`model_loader.load`), the KV cache sized and allocated in the memory left (over
several ranks, as many pages as the smallest rank holds, so that the page ids rank 0's scheduler
hands out are valid everywhere), the backend, sampler and runner built around them, and on CUDA
the kernels warmed up and decode (and piecewise) graphs captured. Over several ranks every rank calls
`build_runner` with the same arguments: its warm-up and graph capture run the same steps, whose
collectives pair up. `executor/tensor_parallel.py` drives the ranks' runners."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import torch

from flashserve.attention import get_backend_cls
from flashserve.attention.cascade import cascade_policy
from flashserve.attention.kv_quant import resolve_kv_cache_dtype
from flashserve.config import COPY_ENGINE_MAX_CHUNK_TOKENS, CacheConfig, ModelConfig
from flashserve.distributed.comm import SingleRankGroup, TPGroup
from flashserve.executor.worker import (
    FUSED_ALLREDUCE_MAX_TOKENS, check_copy_engine_sums, rank_device, shared_kv_pages, take_fused_allreduce,
)
from flashserve.lora.manager import enable_lora
from flashserve.model_loader import LoadedModel, load
from flashserve.models.native import NativeCausalLM
from flashserve.models.llama_weights import UnsupportedModelError
from flashserve.spec_decode.config import SpeculativeConfig
from flashserve.worker.assembly import (
    attention_dtype, backend_options, capture_decode_graphs, capture_piecewise_graphs, capture_verify_graphs,
    kv_page_bytes, num_kv_pages,
    pick_backend, pick_sampler, warm_up,
)  # fmt: skip
from flashserve.worker.runner import ModelRunner

logger = logging.getLogger(__name__)


def all_reduce_summary(fused: bool, model_config: ModelConfig) -> str:
    """What carries a model's all-reduces over several ranks, for the start-up log."""
    said = f"FlashInfer's fused all-reduce + RMSNorm (steps up to {FUSED_ALLREDUCE_MAX_TOKENS} tokens)" if fused \
        else "NCCL all-reduce"
    least = model_config.tp_overlap_min_tokens
    if least is not None:
        by = f"copy engines (chunks of up to {COPY_ENGINE_MAX_CHUNK_TOKENS} tokens)" \
            if model_config.tp_overlap_comm == "copy-engine" else "NCCL"
        said += f"; steps of {least}+ tokens in two chunks, all-reduces overlapped by {by}"
    return said


def build_runner(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    group: TPGroup | None = None,
    seed: int | None = None,
    *,
    cuda_graph: bool = True,
    max_batch_size: int = 256,
    speculative: SpeculativeConfig | None = None,
) -> tuple[ModelRunner, LoadedModel, int]:
    """Loads the model (`group`'s rank's shard; default: one rank, the whole model), sizes and
    allocates the KV cache, builds the backend, sampler and runner; on CUDA (or compiled) warms
    the kernels up, and with FlashInfer captures decode graphs and the piecewise graphs of steps
    with prompt tokens (`--piecewise-cuda-graph-max-tokens`) before returning. Collective over
    several ranks: every rank calls it.

    `speculative`: speculative decoding's config. Its draft model loads on rank 0 alone, whole,
    before the KV cache is sized, which leaves room for the draft's weights and its KV pool
    (`executor/draft.py`; over several ranks every rank takes the fewest pages any rank has room
    for). Rank 0's drafter writes the drafts into the step's rows before the step goes to the
    other ranks, which verify them in the same forward. With FlashInfer, verify steps of its k
    drafts get CUDA graphs too.

    Returns (runner, loaded model with max_model_len capped by the cache, number of pages).
    """
    group = group if group is not None else SingleRankGroup()
    several = group.world_size > 1
    if several and model_config.model_impl == "hf":
        raise ValueError("tensor parallelism needs the native model path (model_impl auto or native, not hf)")
    t0 = time.perf_counter()
    device = rank_device(model_config.device, several)
    if several and device.type == "cpu":
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    if several:
        # A safetensors checkpoint or dummy weights: each rank reads (or draws) only its slices,
        # and no rank builds the whole transformers model first.
        try:
            loaded = load(model_config, device, group)
        except UnsupportedModelError as exc:
            raise ValueError(f"tensor parallelism needs a model of the native Llama family: {exc}") from exc
    else:
        loaded = load(model_config, device)
    model, shape = loaded.model, loaded.attention
    fused = several and take_fused_allreduce(model_config, group, device, loaded.dtype)
    if fused:
        assert isinstance(model, NativeCausalLM)
        model.model.use_fused_allreduce(FUSED_ALLREDUCE_MAX_TOKENS)  # before the KV cache takes the memory left
    if several and model_config.tp_overlap_min_tokens is not None:
        assert isinstance(model, NativeCausalLM)
        model.model.overlap_min_tokens = model_config.tp_overlap_min_tokens
        if model_config.tp_overlap_comm == "copy-engine":
            check_copy_engine_sums(group, device)
            model.model.use_copy_engine_sums(COPY_ENGINE_MAX_CHUNK_TOKENS)
    # The adapters' device slots, before the KV cache takes the memory left too.
    lora = enable_lora(model, model_config.lora) if model_config.lora is not None else None
    backend_name = pick_backend(model_config.attention_backend, device)
    attn_dtype = attention_dtype(model_config, loaded.dtype, device, backend_name)
    kv_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, attn_dtype)
    page_size = cache_config.page_size
    t_loaded = time.perf_counter()
    draft = None
    if speculative is not None and speculative.method == "draft_model" and group.rank == 0:
        from flashserve.executor.draft import load_draft

        assert speculative.model is not None
        draft = load_draft(speculative.model, model_config, device, page_size)
    page_bytes = kv_page_bytes(shape.num_layers, page_size, shape.num_kv_heads, shape.head_dim, kv_dtype)
    num_pages = num_kv_pages(cache_config, page_bytes, device, draft.page_bytes if draft is not None else 0)
    if several:
        num_pages = shared_kv_pages(num_pages, page_bytes, device, group)
    backend = get_backend_cls(backend_name)(
        shape.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, attn_dtype, device, shape.sm_scale,
        num_qo_heads=shape.num_heads, kv_cache_dtype=kv_dtype, **backend_options(model_config, backend_name),
    )  # fmt: skip
    t_kv = time.perf_counter()
    capacity = (num_pages - 1) * page_size  # page 0 is the KV cache manager's scratch page
    if capacity < loaded.max_model_len:
        if not several:
            logger.warning("KV cache holds %d tokens; max_model_len %d lowered to it", capacity, loaded.max_model_len)
        loaded = replace(loaded, max_model_len=capacity)
    if not several:
        logger.info(
            "model %s on %s (%s, %s path), %s attention, KV cache %d pages x %d tokens = %d tokens (%s, %.2f GB); "
            "start-up: model loaded in %.1f s, KV cache sized and allocated in %.1f s",
            loaded.name, device, loaded.dtype, "native" if loaded.spec is not None else "HF", backend_name,
            num_pages, page_size, num_pages * page_size, kv_dtype, num_pages * page_bytes / 1e9, t_loaded - t0,
            t_kv - t_loaded,
        )
    elif group.rank == 0:
        logger.info(
            "model %s on %d ranks (%s, %s, native path), rank 0: %d query / %d KV heads, %s attention, "
            "%s, KV cache %d pages x %d tokens (%s, %.2f GB per rank); start-up: shard loaded in %.1f s, "
            "KV cache sized and allocated in %.1f s",
            loaded.name, group.world_size, device, loaded.dtype, shape.num_heads, shape.num_kv_heads, backend_name,
            all_reduce_summary(fused, model_config), num_pages, page_size, kv_dtype, num_pages * page_bytes / 1e9,
            t_loaded - t0, t_kv - t_loaded,
        )  # fmt: skip
    sampler = pick_sampler(device, model_config.seed if seed is None else seed)
    # Cascade attention runs on one rank only.
    cascade = None if several else cascade_policy(model_config.cascade_attention)
    runner = ModelRunner(model, device, backend, sampler, page_size, cascade, group)
    runner.lora = lora
    runner.speculative = speculative is not None
    if draft is not None:
        from flashserve.executor.draft import build_drafter

        runner.drafter = build_drafter(draft, num_pages, page_size, device)
    compiled = isinstance(model, NativeCausalLM) and model.model.compiled
    if device.type == "cuda" or compiled:
        warm_up(runner, num_pages)
        if cuda_graph and backend_name == "flashinfer":
            capture_decode_graphs(runner, model, max_batch_size)
            if speculative is not None:
                capture_verify_graphs(runner, model, max_batch_size, speculative.num_speculative_tokens,
                                      speculative.disable_by_batch_size)  # fmt: skip
            fp8 = isinstance(model, NativeCausalLM) and model.model.fp8 is not None
            capture_piecewise_graphs(runner, model, model_config.piecewise_graph_tokens(fp8))
        elif cuda_graph and group.rank == 0:
            logger.info("CUDA graphs need the FlashInfer backend; decoding eagerly")
    return runner, loaded, num_pages
