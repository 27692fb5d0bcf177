"""What `flashserve serve` and `run-batch` start from: the parsed command line turned into the frozen
configs that cross process boundaries (`ServeArgs`, `BatchArgs`). `cli.py` defines the options."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from flashserve.api.options import APIOptions
from flashserve.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, ServerConfig
from flashserve.message.lora import LoRARequest


@dataclass(frozen=True)
class ServeArgs:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    server: ServerConfig
    cuda_graph: bool
    api: APIOptions = APIOptions()
    max_waiting: int | None = None
    queue_timeout: float | None = None
    shutdown_timeout: float = 30.0
    access_log: bool = False
    api_server_count: int = 1
    data_parallel_size: int = 1  # engine cores, each on GPUs of its own
    data_parallel_routing: str = "prefix"  # prefix | load
    # `--lora-modules`, with the ids the engine core loads them under (1, 2, ...).
    lora_modules: tuple[LoRARequest, ...] = ()
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter


def lora_options(ns: argparse.Namespace) -> tuple[LoRAConfig | None, tuple[LoRARequest, ...]]:
    """The LoRA limits (None without --enable-lora) and the adapters to serve from the start.
    Raises ValueError for options that do not go together."""
    modules = list(ns.lora_modules or ())
    if not ns.enable_lora:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None, ()
    if ns.max_cpu_loras is not None and ns.max_cpu_loras < ns.max_loras:
        raise ValueError(f"--max-cpu-loras ({ns.max_cpu_loras}) must be at least --max-loras ({ns.max_loras})")
    config = LoRAConfig(max_loras=ns.max_loras, max_lora_rank=ns.max_lora_rank, max_cpu_loras=ns.max_cpu_loras)
    names = [m["name"] for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules names each adapter once; given more than once: {', '.join(duplicates)}")
    served = set(ns.served_model_name or ()) | ({ns.model} if ns.model else set())
    clashing = sorted(served.intersection(names))
    if clashing:
        raise ValueError(f"--lora-modules: {', '.join(clashing)} is the base model's name; name the adapter otherwise")
    loras = tuple(LoRARequest(m["name"], i, m["path"], m["base_model_name"]) for i, m in enumerate(modules, 1))
    return config, loras


def to_configs(ns: argparse.Namespace) -> ServeArgs:
    """Raises ValueError for options that do not go together (the parser reports it)."""
    lora_config, lora_modules = lora_options(ns)
    model = ModelConfig(
        model=ns.model, tokenizer=ns.tokenizer, served_model_names=tuple(ns.served_model_name or ()),
        dtype=ns.dtype, attention_dtype=ns.attention_dtype, load_format=ns.load_format,
        max_model_len=ns.max_model_len, device=ns.device, attention_backend=ns.attention_backend,
        model_impl=ns.model_impl,
        torch_compile=ns.torch_compile,
        fused_decode=ns.fused_decode,
        cascade_attention=ns.cascade_attention,
        seed=ns.seed,
        tensor_parallel_size=ns.tensor_parallel_size,
        enable_flashinfer_allreduce_fusion=ns.enable_flashinfer_allreduce_fusion,
        tp_overlap_min_tokens=ns.tp_overlap_min_tokens,
        tp_overlap_comm=ns.tp_overlap_comm,
        piecewise_cuda_graph_max_tokens=ns.piecewise_cuda_graph_max_tokens,
        quantization=ns.quantization,
        lora=lora_config,
    )
    cache = CacheConfig(page_size=ns.page_size, num_pages=ns.num_pages,
                        gpu_memory_utilization=ns.gpu_memory_utilization, cpu_kv_cache_gb=ns.cpu_kv_cache_gb,
                        enable_prefix_caching=ns.enable_prefix_caching, kv_cache_dtype=ns.kv_cache_dtype,
                        prefix_caching_hash_seed=ns.prefix_caching_hash_seed,
                        kv_events=ns.kv_events_config if ns.kv_events_config and ns.kv_events_config.enabled else None)
    scheduler = SchedulerConfig(max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
                                max_prefill_tokens=ns.max_prefill_tokens,
                                chunked_prefill_size=ns.chunked_prefill_size, overlap_scheduling=ns.overlap_scheduling,
                                late_launch=ns.late_launch,
                                speculative=ns.speculative_config)
    api_keys = tuple(ns.api_key or ())
    server = ServerConfig(host=ns.host, port=ns.port, log_level=ns.log_level, api_keys=api_keys)
    api = APIOptions(
        api_keys=api_keys, allowed_origins=tuple(ns.allowed_origins or ()),
        allowed_methods=tuple(ns.allowed_methods), allowed_headers=tuple(ns.allowed_headers),
        allow_credentials=ns.allow_credentials, max_body_bytes=ns.max_body_bytes, log_requests=ns.log_requests,
        max_sequences_per_request=ns.max_sequences_per_request, tool_call_parser=ns.tool_call_parser,
        ui=ns.ui,
        responses_store_max_entries=ns.responses_store_max_entries,
        responses_store_max_age_s=ns.responses_store_max_age,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
    )
    return ServeArgs(model, cache, scheduler, server, ns.cuda_graph, api=api, max_waiting=ns.max_waiting,
                     queue_timeout=ns.queue_timeout, shutdown_timeout=ns.shutdown_timeout,
                     access_log=ns.access_log, api_server_count=ns.api_server_count,
                     data_parallel_size=ns.data_parallel_size, data_parallel_routing=ns.data_parallel_routing,
                     lora_modules=lora_modules, allow_runtime_lora_updating=ns.allow_runtime_lora_updating)


@dataclass(frozen=True)
class BatchArgs:
    serve: ServeArgs  # the model, cache and scheduler options, as `serve` takes them
    input_file: str
    output_file: str
    max_concurrency: int | None = None  # None: twice the engine's max_num_seqs
    prefix_grouping: bool = True
    progress: bool = True
    overwrite: bool = False  # False: resume the output file


def to_batch_args(ns: argparse.Namespace) -> BatchArgs:
    return BatchArgs(to_configs(ns), ns.input_file, ns.output_file, max_concurrency=ns.max_concurrency,
                     prefix_grouping=ns.prefix_grouping, progress=ns.progress, overwrite=ns.overwrite)
