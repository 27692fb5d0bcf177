"""Frozen configuration, built once from the command line (every flag also an env variable)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    model: str = ""  # hf id, local dir, .gguf file, config.json or built-in shape name; "" = embedded
    tokenizer: str | None = None
    served_model_names: tuple[str, ...] = ()
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    attention_dtype: str = "auto"  # for float32 models on CUDA: float16 | bfloat16
    load_format: str = "auto"  # auto | dummy
    max_model_len: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | torch | flashinfer
    model_impl: str = "auto"  # auto (native for Llama-family models) | native | hf
    torch_compile: bool = False  # torch.compile the native model's non-attention pieces
    # FlashInfer backend: RoPE inside the KV append kernel and a Triton split-KV decode attention
    # for decode steps of a few requests (`attention/flashinfer.py`, fused_decode).
    fused_decode: bool = False
    seed: int = 0
    trust_remote_code: bool = False
    # Cascade attention for groups of requests sharing cached prefix pages: auto | on | off
    # (`attention/cascade.py`, `cascade_policy`).
    cascade_attention: str = "auto"
    tensor_parallel_size: int = 1  # ranks sharing the model: this process and N-1 workers (native path)
    # Under tensor parallelism on GPUs: each all-reduce with the add + RMSNorm after it in one
    # FlashInfer kernel (`distributed/comm.py`, FlashInferAllReduceNorm) instead of NCCL, then the norm.
    # True: forced; False: NCCL; None: where it can run and NVLink links the GPUs
    # (`executor/worker.py`, take_fused_allreduce).
    enable_flashinfer_allreduce_fusion: bool | None = None
    # "fp8": quantize a high-precision checkpoint's projections at load (per-channel weights,
    # per-token activations). FP8 checkpoints (config.json's quantization_config) need no flag.
    quantization: str | None = None


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None  # None: sized from memory (GPU) or cpu_kv_cache_gb (CPU)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0
    enable_prefix_caching: bool = True  # full KV pages shared by content across requests
    kv_cache_dtype: str = "auto"  # auto (the attention dtype) | fp8 (e4m3, scale 1.0)


@dataclass(frozen=True)
class SchedulerConfig:
    # None: chosen where the device is known (`worker/step_budget.py`): 1024 on a GPU of 70 GiB or
    # more (not an A100), else 256.
    max_num_seqs: int | None = None
    # None: chosen where the device is known (`worker/step_budget.py`): 8192 on a GPU of 70 GiB or
    # more (not an A100), 2048 on other GPUs, on a CPU the tokens that one step computes in about
    # 0.4 s, measured at start-up.
    max_num_batched_tokens: int | None = None
    # Tokens a step may hold when no running request has output yet (nobody's stream waits on the
    # step, so chunking a prompt only costs time). None: max_num_batched_tokens. On a CPU with the
    # budget left to the default, a lone prompt of up to 8,192 tokens prefills in one step.
    prefill_only_budget: int | None = None
    # Schedule and launch the next step while the device computes the last one; its decode tokens
    # come from the last step's sampled ids on the device (`engine/engine.py`).
    overlap_scheduling: bool = True


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    api_keys: tuple[str, ...] = field(default=())
