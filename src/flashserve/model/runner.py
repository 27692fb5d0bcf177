"""SchedulerOutput -> input tensors -> forward -> logits -> sampled ids, once per step."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from flashserve.attention import get_backend_cls
from flashserve.attention.base import AttentionBackend, BatchLayout
from flashserve.config import CacheConfig, ModelConfig
from flashserve.engine.outputs import NO_TOKEN, SampleError, ScheduledRequest, SchedulerOutput
from flashserve.model.hf import HFCausalLM, attention_scale
from flashserve.model.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TokenSampler(Protocol):
    def sample(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> list[int]: ...


class ModelRunner:
    """Runs one scheduled step: packs its tokens, plans the backend, runs the model, samples."""

    def __init__(self, loaded: LoadedModel, backend: AttentionBackend, sampler: TokenSampler, page_size: int) -> None:
        self.loaded = loaded
        self.backend = backend
        self.sampler = sampler
        self.page_size = page_size
        self.device = loaded.device
        self.model = HFCausalLM(loaded.model)

    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """float32 logits [number of requests with sample=True, V], in schedule order."""
        with torch.inference_mode():
            layout = BatchLayout.build(out.requests, self.page_size)
            self.backend.plan(layout)
            token_ids = [t for r in out.requests for t in r.new_token_ids]
            # The last new token of a sampling request is the row whose logits pick its next token.
            rows = [layout.qo_indptr[i + 1] - 1 for i, r in enumerate(out.requests) if r.sample]
            input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
            positions = torch.tensor(layout.positions, dtype=torch.long).to(self.device, non_blocking=True)
            logits_indices = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
            return self.model.forward(input_ids, positions, self.backend, logits_indices)

    def execute(self, out: SchedulerOutput) -> list[int | SampleError]:
        """One entry per `out.requests`: a sampled id, NO_TOKEN (sample=False) or a SampleError."""
        results: list[int | SampleError] = [NO_TOKEN] * len(out.requests)
        if out.is_empty:
            return results
        logits = self.forward(out)
        sampling = [i for i, r in enumerate(out.requests) if r.sample]
        if not sampling:
            return results
        requests = [out.requests[i] for i in sampling]
        with torch.inference_mode():
            try:
                sampled: list[int | SampleError] = list(self.sampler.sample(logits, requests))
            except Exception:
                # One bad request must not fail the batch: retry row by row, failing only it.
                logger.exception("sampling the batch failed; retrying request by request")
                sampled = [self._sample_one(logits[j : j + 1], r) for j, r in enumerate(requests)]
        for i, token in zip(sampling, sampled):
            results[i] = token
        return results

    def _sample_one(self, logits: torch.Tensor, request: ScheduledRequest) -> int | SampleError:
        try:
            return self.sampler.sample(logits, [request])[0]
        except Exception as exc:  # noqa: BLE001 - the request fails alone, with its message
            return SampleError(str(exc) or type(exc).__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def pick_backend(name: str, device: torch.device) -> str:
    """"auto": FlashInfer on CUDA when it is installed, else the PyTorch reference."""
    if name != "auto":
        return name
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"


def attention_dtype(config: ModelConfig, model_dtype: torch.dtype, device: torch.device, backend: str) -> torch.dtype:
    """KV cache / attention dtype: explicit, else the model's, except float32 under FlashInfer (no fp32 kernels)."""
    if config.attention_dtype != "auto":
        return _DTYPES[config.attention_dtype]
    if device.type == "cuda" and backend == "flashinfer" and model_dtype == torch.float32:
        return torch.bfloat16
    return model_dtype


def model_shape(hf_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers config."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return text.num_hidden_layers, num_kv_heads, head_dim


def kv_page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page across all layers, K and V."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_kv_pages(cache: CacheConfig, page_bytes: int, device: torch.device) -> int:
    """Explicit `num_pages`, else `gpu_memory_utilization` of the GPU memory left free after the
    model loaded (CUDA), or `cpu_kv_cache_gb` (CPU)."""
    if cache.num_pages is not None:
        return cache.num_pages
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cache.gpu_memory_utilization)
    else:
        budget = int(cache.cpu_kv_cache_gb * (1 << 30))
    pages = budget // page_bytes
    if pages < 1:
        raise RuntimeError(f"no memory left for the KV cache: {budget} bytes for pages of {page_bytes} bytes")
    return pages


def build_runner(
    model_config: ModelConfig, cache_config: CacheConfig, seed: int | None = None
) -> tuple[ModelRunner, LoadedModel, int]:
    """Loads the model, sizes and allocates the KV cache, builds the backend, sampler and runner.

    Returns (runner, loaded model with max_model_len capped by the cache, number of pages).
    """
    from dataclasses import replace

    from flashserve.model.sampler import Sampler

    device = pick_device(model_config.device)
    loaded = load_model(model_config, device)
    backend_name = pick_backend(model_config.attention_backend, device)
    kv_dtype = attention_dtype(model_config, loaded.dtype, device, backend_name)
    num_layers, num_kv_heads, head_dim = model_shape(loaded.hf_config)
    page_size = cache_config.page_size
    page_bytes = kv_page_bytes(num_layers, page_size, num_kv_heads, head_dim, kv_dtype)
    num_pages = num_kv_pages(cache_config, page_bytes, device)
    backend = get_backend_cls(backend_name)(
        num_layers, num_pages, page_size, num_kv_heads, head_dim, kv_dtype, device, attention_scale(loaded.model)
    )
    capacity = (num_pages - 1) * page_size  # page 0 is the block manager's scratch page
    if capacity < loaded.max_model_len:
        logger.warning("KV cache holds %d tokens; max_model_len %d lowered to it", capacity, loaded.max_model_len)
        loaded = replace(loaded, max_model_len=capacity)
    logger.info(
        "model %s on %s (%s), %s attention, %d KV pages of %d tokens (%s)",
        loaded.name, device, loaded.dtype, backend_name, num_pages, page_size, kv_dtype,
    )
    sampler = Sampler(model_config.seed if seed is None else seed)
    return ModelRunner(loaded, backend, sampler, page_size), loaded, num_pages
