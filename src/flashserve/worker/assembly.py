"""The pieces a runner builder puts together around a loaded model: the device, the attention
backend and its KV cache's size, the sampler, and before serving the warm-up and decode CUDA graphs
(`executor/build.py` builds a runner from them, for one rank or any of several)."""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import Any

import torch

from flashserve.attention.cascade import CascadePolicy
from flashserve.config import CacheConfig, ModelConfig
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.worker.runner import ModelRunner, StepModel, TokenSampler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def backend_options(config: ModelConfig, backend: str) -> dict[str, Any]:
    """Keywords of `backend`'s constructor beyond the shared ones: FlashInfer's `fused_decode`."""
    return {"fused_decode": True} if backend == "flashinfer" and config.fused_decode else {}


def attention_dtype(config: ModelConfig, model_dtype: torch.dtype, device: torch.device, backend: str) -> torch.dtype:
    """KV cache / attention dtype: explicit, else the model's, except float32 under FlashInfer (no fp32 kernels)."""
    if config.attention_dtype != "auto":
        return _DTYPES[config.attention_dtype]
    if device.type == "cuda" and backend == "flashinfer" and model_dtype == torch.float32:
        return torch.bfloat16
    return model_dtype


def kv_page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page across all layers, K and V."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_cache_budget(cache: CacheConfig, device: torch.device) -> int:
    """Bytes for KV pages: `gpu_memory_utilization` of the GPU memory free now, after the models
    loaded (CUDA), or `cpu_kv_cache_gb` (CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * cache.gpu_memory_utilization)
    return int(cache.cpu_kv_cache_gb * (1 << 30))


def num_kv_pages(cache: CacheConfig, page_bytes: int, device: torch.device, draft_page_bytes: int = 0) -> int:
    """Explicit `num_pages`, else as many pages as `kv_cache_budget` holds.

    `draft_page_bytes`: with speculative decoding's draft model, one page of its KV. Its pool has
    as many pages as the target's, addressed by the same ids, so each page of the budget pays for
    both: `page_bytes + draft_page_bytes`. (The draft's weights are loaded before, so that on a
    GPU they are out of the free memory measured.)"""
    if cache.num_pages is not None:
        return cache.num_pages
    budget = kv_cache_budget(cache, device)
    pages = budget // (page_bytes + draft_page_bytes)
    if pages < 1:
        raise RuntimeError(f"no memory left for the KV cache: {budget} bytes for pages of "
                           f"{page_bytes + draft_page_bytes} bytes")
    return pages


def pick_sampler(device: torch.device, seed: int) -> TokenSampler:
    from flashserve.sample.sampler import Sampler

    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        from flashserve.sample.flashinfer import FlashInferSampler

        return FlashInferSampler(seed)
    return Sampler(seed)


def warm_up(runner: ModelRunner, num_pages: int) -> None:
    """Runs a prefill step, a decode step (with sampling) and a one-request decode step on free
    pages, so that every kernel module is built (FlashInfer JIT) and every step size class is
    compiled (`--torch-compile`) before the server reports healthy."""
    from flashserve.message.sampling_params import SamplingParams

    t0 = time.perf_counter()
    n = min(4, num_pages - 1)
    page_ids = [list(range(1 + i * (num_pages - 1) // n, 2 + i * (num_pages - 1) // n)) for i in range(n)]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=20),
              SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.1), SamplingParams(seed=1)]
    prefill = [ScheduledRequest(f"warmup-{i}", [1] * 5, 0, page_ids[i], True, params[i % 4], [1] * 5, [])
               for i in range(n)]
    decode = [ScheduledRequest(r.request_id, [1], 5, r.page_ids, True, r.params, r.prompt_token_ids, [1])
              for r in prefill]
    steps = [prefill, decode, decode[:1]]
    policy = runner.cascade
    if policy is not None and n >= 3:
        # Two requests behind one shared full page, a group under the warm-up's policy of any
        # group: the prefix pass and the merge, whose kernels are built on first use too.
        shared, own = page_ids[0][:1], [page_ids[1][0], page_ids[2][0]]
        tokens = [1] * runner.page_size
        steps.append([ScheduledRequest(f"warmup-cascade-{i}", [1], runner.page_size, shared + [page], True, params[0],
                                       tokens, [1]) for i, page in enumerate(own)])
        runner.cascade = CascadePolicy()
    try:
        for step in steps:
            runner.execute(SchedulerOutput(step))
    finally:
        runner.cascade = policy
        runner.batch.clear()  # no scheduler releases the warm-up's rows
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("warm-up (kernel builds and compilation included) took %.1f s", time.perf_counter() - t0)
    if runner.device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        from flashserve.attention.flashinfer_modules import module_report

        logger.info("%s", module_report())


def capture_decode_graphs(runner: ModelRunner, model: StepModel, max_batch_size: int) -> None:
    """Captures decode-step graphs; a model whose forward synchronises with the host (some
    transformers model's code, say) decodes eagerly instead, with a warning."""
    from flashserve.worker.cuda_graph import CudaGraphRunner, NotCapturableError, capture_batch_sizes

    t0 = time.perf_counter()
    sizes = capture_batch_sizes(max_batch_size)
    cascade = runner.cascade is not None  # cascade decode steps get graphs of their own
    # A model with LoRA adapters: steps of base rows alone replay graphs without the adapters.
    plain_for = getattr(model, "plain_decode_logits", None)
    plain = plain_for(runner.backend) if plain_for is not None else None
    graphs = CudaGraphRunner(model.decode_logits(runner.backend), runner.backend, sizes,  # type: ignore[arg-type]
                             cascade=cascade, plain_forward=plain)
    try:
        graphs.capture()
    except NotCapturableError as exc:
        logger.warning("decoding eagerly, without CUDA graphs: %s", exc)
        return
    runner.graphs = graphs
    logger.info("captured decode CUDA graphs%s for batch sizes %s in %.1f s", " (flat and cascade)" if cascade else "",
                sizes, time.perf_counter() - t0)


def capture_verify_graphs(runner: ModelRunner, model: StepModel, max_batch_size: int, num_draft_tokens: int,
                          disable_by_batch_size: int | None) -> None:  # fmt: skip
    """Captures the graphs of uniform verify steps of `num_draft_tokens` drafts a request
    (`worker/verify_graph.py`), in the decode graphs' memory pool; none for a model with LoRA
    adapters (its verify steps run eagerly) or a forward that synchronises with the host."""
    from flashserve.worker.verify_graph import VerifyGraphRunner, verify_capture_sizes

    if runner.lora is not None:
        logger.info("speculative decoding: verify steps run eagerly with LoRA adapters")
        return
    sizes = verify_capture_sizes(max_batch_size, num_draft_tokens, disable_by_batch_size)
    if not sizes:
        return
    t0 = time.perf_counter()
    graphs = VerifyGraphRunner(model.decode_logits(runner.backend), runner.backend, sizes,  # type: ignore[arg-type]
                               num_draft_tokens)
    if not _captured(graphs, runner, "verifying drafts eagerly, without CUDA graphs"):
        return
    runner.verify_graphs = graphs
    logger.info("captured verify CUDA graphs (%d draft tokens a request) for batch sizes %s in %.1f s",
                num_draft_tokens, sizes, time.perf_counter() - t0)


def capture_piecewise_graphs(runner: ModelRunner, model: StepModel, max_tokens: int) -> None:
    """Captures the piecewise graphs of steps of up to `max_tokens` tokens (`worker/piecewise_graph.py`)
    in the decode graphs' memory pool, for a model that has layer pieces (the native path); a piece
    that synchronises with the host leaves those steps eager, with a warning."""
    from flashserve.worker.piecewise_graph import PiecewiseGraphRunner, capture_token_counts

    layer_pieces = getattr(model, "layer_pieces", None)
    if layer_pieces is None or max_tokens < 1:
        return
    t0 = time.perf_counter()
    counts = capture_token_counts(max_tokens)
    graphs = PiecewiseGraphRunner(layer_pieces(runner.backend), runner.device, counts)
    free_before = torch.cuda.mem_get_info(runner.device)[0]
    if not _captured(graphs, runner, "steps of prompt tokens run eagerly, without piecewise CUDA graphs"):
        return
    runner.piecewise_graphs = graphs
    used = free_before - torch.cuda.mem_get_info(runner.device)[0]
    logger.info("captured piecewise CUDA graphs (the pieces between attention calls) for steps of %s tokens in "
                "%.1f s, %.2f GB", counts, time.perf_counter() - t0, used / 1e9)


def _captured(graphs: Any, runner: ModelRunner, eager: str) -> bool:
    """Captures `graphs` in the decode graphs' memory pool; False, with the warning `eager: <why>`,
    where a captured piece synchronises with the host."""
    from flashserve.worker.cuda_graph import NotCapturableError

    try:
        graphs.capture(runner.graphs.pool if runner.graphs is not None else None)
    except NotCapturableError as exc:
        logger.warning("%s: %s", eager, exc)
        return False
    return True
