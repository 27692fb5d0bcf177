"""SchedulerOutput -> input tensors -> forward -> logits -> sampled ids, once per step."""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from flashserve.attention import get_backend_cls
from flashserve.attention.base import AttentionBackend
from flashserve.attention.cascade import CascadePolicy, cascade_policy
from flashserve.attention.kv_quant import resolve_kv_cache_dtype
from flashserve.config import CacheConfig, ModelConfig
from flashserve.engine.outputs import NOTHING, SampledTokens, ScheduledRequest, SchedulerOutput, sample_error
from flashserve.model_loader.loader import LoadedModel, load_model, native_checkpoint
from flashserve.models.hf import HFCausalLM, attention_scale
from flashserve.models.llama import LlamaModel, UnsupportedModelError
from flashserve.sample.logprobs import PromptLogprobs, compute_logprobs
from flashserve.structured.grammar import TokenBitmask
from flashserve.worker.input_batch import BatchRow, InputBatch, append_sampled
from flashserve.worker.launched_step import LaunchedStep
from flashserve.worker.step_inputs import StepInputBuilder, StepInputs

if TYPE_CHECKING:
    from flashserve.model_loader.checkpoint import DummyCheckpoint

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TokenSampler(Protocol):
    def sample_ids(
        self, logits: torch.Tensor, requests: Sequence[BatchRow], bitmask: TokenBitmask | None = None
    ) -> torch.Tensor:
        """`logits` [B, V] -> B token ids on the logits' device, without waiting for them."""
        ...


class StepModel(Protocol):
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """input_ids/positions [T] (backend already planned) -> float32 logits [len(logits_indices), V]."""
        ...

    def decode_logits(self, backend: AttentionBackend) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """`(input_ids, positions) -> logits` of every row: what a decode-step CUDA graph captures."""
        ...


class NativeCausalLM:
    """The native Llama-family forward behind the same seam as `HFCausalLM`."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, backend)
        return self.model.compute_logits(hidden if logits_indices is None else hidden[logits_indices])

    def decode_logits(self, backend: AttentionBackend) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda ids, pos: self.model.compute_logits(self.model(ids, pos, backend))


class ModelRunner:
    """Runs one scheduled step: packs its tokens, plans the backend, runs the model, samples.

    A step may be launched while the one before it is still on the device (`launch(out,
    previous)`): rows whose last token is in flight take it from `previous`'s sampled ids there.
    """

    overlap_capable = True  # the engine may schedule a step behind one still running

    def __init__(
        self,
        loaded: LoadedModel,
        backend: AttentionBackend,
        sampler: TokenSampler,
        page_size: int,
        model: StepModel | None = None,
        cascade: CascadePolicy | None = None,
    ) -> None:
        self.loaded = loaded
        self.backend = backend
        self.sampler = sampler
        self.page_size = page_size
        self.cascade = cascade  # None: every step attends flat
        self.device = loaded.device
        self.model: StepModel = model if model is not None else HFCausalLM(loaded.model)
        self.graphs: Any = None  # a CudaGraphRunner for decode-only steps, once captured
        self.batch = InputBatch()  # the running requests, kept across steps
        self.inputs = StepInputBuilder(self.device, page_size)

    def forward(self, out: SchedulerOutput, prompt_rows: Sequence[int] = (),
                previous: LaunchedStep | None = None, rows: list[BatchRow] | None = None) -> torch.Tensor:
        """float32 logits: one row per request with sample=True, in schedule order, then the
        token rows `prompt_rows` (indices into the step's tokens) for prompt logprobs.
        `previous`: the step before, for the rows whose last token it samples. `rows`: the step's
        rows when the caller applied its diffs to the batch already."""
        with torch.inference_mode():
            if rows is None:
                rows = self.batch.update(out)
            inputs = self._step_inputs(rows, prompt_rows, previous)
            if self.graphs is not None and inputs.logits_indices is None:
                # Every decode row samples; the graph (or its eager fallback) plans the backend.
                return self.graphs(inputs.input_ids, inputs.positions, inputs.layout)
            self.backend.plan(inputs.layout)
            return self.model.forward(inputs.input_ids, inputs.positions, self.backend, inputs.logits_indices)

    def _step_inputs(self, rows: list[BatchRow], prompt_rows: Sequence[int], previous: LaunchedStep | None) -> StepInputs:
        return self.inputs.build(rows, prompt_rows, self.cascade, previous)

    def execute(self, out: SchedulerOutput) -> list[SampledTokens]:
        """One result per `out.requests`, in order (no tokens for a chunk that does not sample)."""
        return self.collect(self.launch(out))

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueues the step's forward, sampling and logprobs without waiting for the device.
        `previous`: the launched step whose sampled ids fill this step's tokens in flight."""
        step = self._launch(out, previous)
        if step.ids is not None:
            # Enqueued now, so that collect() waits for this step only, not for later ones.
            step.host_ids = step.ids.to("cpu", non_blocking=True)
            if step.logprobs is not None:
                step.logprobs = step.logprobs.to_cpu()
            if step.ids.is_cuda:
                step.ready = torch.cuda.Event()
                step.ready.record()
        return step

    def _launch(self, out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        rows = self.batch.update(out)
        sampling = [i for i, r in enumerate(rows) if r.sample]
        requests = [rows[i] for i in sampling]
        step = LaunchedStep(len(rows), sampling, [r.request_id for r in requests], requests)
        if out.is_empty:
            return step
        step.prompt_logprobs = PromptLogprobs.plan(rows)
        logits = self.forward(out, step.prompt_logprobs.rows if step.prompt_logprobs is not None else (), previous,
                              rows)
        with torch.inference_mode():
            if step.prompt_logprobs is not None:
                step.prompt_logprobs.compute(logits[len(sampling):])
            if not sampling:
                return step
            logits = logits[: len(sampling)]
            try:
                step.ids = self.sampler.sample_ids(logits, requests, out.token_bitmask)
            except Exception:
                # One bad request must not fail the batch: retry row by row, failing only it.
                logger.exception("sampling the batch failed; retrying request by request")
                step.results = [self._sample_one(logits, j, r, out.token_bitmask) for j, r in enumerate(requests)]
                return step
            step.logprob_rows = [j for j, r in enumerate(requests) if r.params.logprobs is not None]
            if step.logprob_rows:
                step.logprob_top = [requests[j].params.logprobs or 0 for j in step.logprob_rows]
                index = torch.tensor(step.logprob_rows, dtype=torch.long).to(self.device, non_blocking=True)
                step.logprobs = compute_logprobs(logits.index_select(0, index), step.ids.index_select(0, index),
                                                 max(step.logprob_top))
        return step

    def collect(self, step: LaunchedStep) -> list[SampledTokens]:
        """Waits for a launched step: one result per request, as `execute` returns."""
        results: list[SampledTokens] = [NOTHING] * step.num_requests
        prompt = step.prompt_logprobs.to_host() if step.prompt_logprobs is not None else {}
        if step.results is not None:
            for i, result in zip(step.sampling, step.results):
                results[i] = result
            for row, result in zip(step.sampled_rows, step.results):
                row.output_token_ids.extend(result.token_ids)
        elif step.ids is not None:
            if step.ready is not None:
                step.ready.synchronize()
            assert step.host_ids is not None  # launch() enqueues the copy with the ids
            ids = step.host_ids.tolist()
            append_sampled(step.sampled_rows, ids)
            logprobs: dict[int, object] = {}
            if step.logprobs is not None:
                chosen = [ids[j] for j in step.logprob_rows]
                logprobs = dict(zip(step.logprob_rows, step.logprobs.to_host(chosen, step.logprob_top)))
            for j, (i, token) in enumerate(zip(step.sampling, ids)):
                lp = logprobs.get(j)
                results[i] = SampledTokens([token], [lp] if lp is not None else None)  # type: ignore[list-item]
        for i, entries in prompt.items():
            results[i] = SampledTokens(results[i].token_ids, results[i].logprobs, entries, results[i].error)
        return results

    def _sample_one(self, logits: torch.Tensor, row: int, request: BatchRow,
                    bitmask: TokenBitmask | None) -> SampledTokens:
        mask = None
        if bitmask is not None and row in bitmask.rows:
            j = bitmask.rows.index(row)
            mask = TokenBitmask([0], bitmask.array()[j : j + 1])
        try:
            token = int(self.sampler.sample_ids(logits[row : row + 1], [request], mask)[0])
        except Exception as exc:  # noqa: BLE001 - the request fails alone, with its message
            return sample_error(str(exc) or type(exc).__name__)
        lp = None
        if request.params.logprobs is not None:
            pending = compute_logprobs(logits[row : row + 1], torch.tensor([token], device=logits.device),
                                       request.params.logprobs)
            lp = pending.to_host([token], [request.params.logprobs])
        return SampledTokens([token], lp)


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


def model_shape(hf_config: Any) -> tuple[int, int, int, int]:
    """(num_layers, num_heads, num_kv_heads, head_dim) of a transformers config."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return text.num_hidden_layers, num_heads, num_kv_heads, head_dim


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


def step_model(loaded: LoadedModel, model_impl: str, torch_compile: bool = False,
               checkpoint: str | DummyCheckpoint | None = None, quantization: str | None = None) -> StepModel:
    """The native forward for Llama-family models (`auto`/`native`), else the generic HF path.

    torch_compile: compile the native model's non-attention pieces (the HF path runs eagerly).
    checkpoint: a `native_checkpoint` to read or draw the weights from (`loaded.model` is then
        shapes only).
    quantization: `--quantization` (FP8 checkpoints need none); the native path only.
    """
    if model_impl not in ("auto", "native", "hf"):
        raise ValueError(f"model_impl must be auto, native or hf, not {model_impl!r}")
    if checkpoint is not None:
        return NativeCausalLM(LlamaModel.from_checkpoint(
            checkpoint, loaded.hf_config, loaded.dtype, loaded.device, max_positions=loaded.max_model_len,
            compile=torch_compile, quantization=quantization,
        ))  # fmt: skip
    if model_impl != "hf":
        try:
            native = LlamaModel.from_hf(
                loaded.model, loaded.hf_config, loaded.dtype, loaded.device, max_positions=loaded.max_model_len,
                compile=torch_compile, quantization=quantization,
            )  # fmt: skip
            return NativeCausalLM(native)
        except UnsupportedModelError as exc:
            if model_impl == "native":
                raise
            logger.info("generic HF path for %s: %s", loaded.name, exc)
    if quantization is not None:
        raise ValueError(f"--quantization {quantization} needs the native model path (Llama, Mistral, Qwen2, Qwen3)")
    if torch_compile:
        logger.warning("--torch-compile applies to the native model path; the HF path runs uncompiled")
    return HFCausalLM(loaded.model)


def pick_sampler(device: torch.device, seed: int) -> TokenSampler:
    from flashserve.sample.sampler import Sampler

    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        from flashserve.sample.flashinfer import FlashInferSampler

        return FlashInferSampler(seed)
    return Sampler(seed)


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
    from dataclasses import replace

    t0 = time.perf_counter()
    device = pick_device(model_config.device)
    checkpoint = native_checkpoint(model_config)
    loaded = load_model(model_config, device, weights=checkpoint is None)
    backend_name = pick_backend(model_config.attention_backend, device)
    attn_dtype = attention_dtype(model_config, loaded.dtype, device, backend_name)
    kv_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, attn_dtype)
    num_layers, num_heads, num_kv_heads, head_dim = model_shape(loaded.hf_config)
    sm_scale = attention_scale(loaded.model)
    model = step_model(loaded, model_config.model_impl, model_config.torch_compile, checkpoint,
                       model_config.quantization)
    page_size = cache_config.page_size
    t_loaded = time.perf_counter()
    page_bytes = kv_page_bytes(num_layers, page_size, num_kv_heads, head_dim, kv_dtype)
    num_pages = num_kv_pages(cache_config, page_bytes, device)
    backend = get_backend_cls(backend_name)(
        num_layers, num_pages, page_size, num_kv_heads, head_dim, attn_dtype, device, sm_scale,
        num_qo_heads=num_heads, kv_cache_dtype=kv_dtype, **backend_options(model_config, backend_name),
    )  # fmt: skip
    t_kv = time.perf_counter()
    capacity = (num_pages - 1) * page_size  # page 0 is the KV cache manager's scratch page
    if capacity < loaded.max_model_len:
        logger.warning("KV cache holds %d tokens; max_model_len %d lowered to it", capacity, loaded.max_model_len)
        loaded = replace(loaded, max_model_len=capacity)
    logger.info(
        "model %s on %s (%s, %s path), %s attention, KV cache %d pages x %d tokens = %d tokens (%s, %.2f GB); "
        "start-up: model loaded in %.1f s, KV cache sized and allocated in %.1f s",
        loaded.name, device, loaded.dtype, "native" if isinstance(model, NativeCausalLM) else "HF", backend_name,
        num_pages, page_size, num_pages * page_size, kv_dtype, num_pages * page_bytes / 1e9, t_loaded - t0,
        t_kv - t_loaded,
    )
    sampler = pick_sampler(device, model_config.seed if seed is None else seed)
    cascade = cascade_policy(model_config.cascade_attention)
    runner = ModelRunner(loaded, backend, sampler, page_size, model, cascade)
    compiled = isinstance(model, NativeCausalLM) and model.model.compiled
    if device.type == "cuda" or compiled:
        warm_up(runner, num_pages)
        if cuda_graph and backend_name == "flashinfer":
            capture_decode_graphs(runner, model, max_batch_size)
        elif cuda_graph:
            logger.info("CUDA graphs need the FlashInfer backend; decoding eagerly")
    return runner, loaded, num_pages


def warm_up(runner: ModelRunner, num_pages: int) -> None:
    """Runs a prefill step, a decode step (with sampling) and a one-request decode step on free
    pages, so that every kernel module is built (FlashInfer JIT) and every step size class is
    compiled (`--torch-compile`) before the server reports healthy."""
    from flashserve.engine.sampling_params import SamplingParams

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
    graphs = CudaGraphRunner(model.decode_logits(runner.backend), runner.backend, sizes,  # type: ignore[arg-type]
                             cascade=cascade)
    try:
        graphs.capture()
    except NotCapturableError as exc:
        logger.warning("decoding eagerly, without CUDA graphs: %s", exc)
        return
    runner.graphs = graphs
    logger.info("captured decode CUDA graphs%s for batch sizes %s in %.1f s", " (flat and cascade)" if cascade else "",
                sizes, time.perf_counter() - t0)
