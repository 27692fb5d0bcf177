"""Frozen configuration, built once from the command line (every flag also an env variable)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from flashserve.spec_decode.config import SpeculativeConfig


# The default of `ModelConfig.piecewise_cuda_graph_max_tokens` on one rank: beyond about 512 tokens an 8B
# step is bound by its GEMMs, not by launching them (H200: 15.2 ms eager at 512 tokens, floor 9.1).
PIECEWISE_GRAPH_TOKENS = 512
# The same with FP8 projections: their GEMMs take half the time and each eager `_scaled_mm` costs
# its set-up on the host, so eager steps stay bound by the host up to about 2,048 tokens (H200, 8B:
# 1,024 tokens 24.1 ms eager, 16.7 from graphs). 2,304: a step of the default `max_prefill_tokens`
# (2,048 prompt tokens) beside 256 decode rows. Over several ranks the same (H200 x 2, the 70B at TP 2,
# FP8: a 128-token prompt 59.0 ms eager, 17.5 from graphs; 512 tokens 59.5 and 45.4).
FP8_PIECEWISE_GRAPH_TOKENS = 2304
# What may carry the overlapped all-reduces (`ModelConfig.tp_overlap_comm`).
TP_OVERLAP_COMMS = ("nccl", "copy-engine")
# The largest chunk of tokens the copy-engine all-reduce takes (its symmetric buffer: this many rows
# of the hidden size, and a rank's share more); larger chunks (steps over 8,192 tokens) take NCCL.
COPY_ENGINE_MAX_CHUNK_TOKENS = 4096
# The largest `piecewise_cuda_graph_max_tokens`: graphs are captured for every 128 tokens up to it.
MAX_PIECEWISE_GRAPH_TOKENS = 8192


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
    # Under tensor parallelism: steps of at least this many tokens run each layer's token-wise part
    # in two chunks, one chunk's all-reduce beside the other's GEMMs (`models/llama.py`,
    # token_chunks). None: off.
    tp_overlap_min_tokens: int | None = None
    # What carries those overlapped all-reduces on GPUs: "nccl", or "copy-engine" (peer copies over
    # NVLink and a small sum kernel, `distributed/copy_engine.py`: no SMs taken from the GEMMs beside).
    tp_overlap_comm: str = "nccl"
    # Steps with prompt tokens of up to this many tokens replay the native model's pieces between
    # attention calls from CUDA graphs (`worker/piecewise_graph.py`), every rank's with its all-reduces
    # inside; 0: eager. None: 512, or 2,304 with FP8 projections. See `piecewise_graph_tokens`.
    piecewise_cuda_graph_max_tokens: int | None = None
    # "fp8": quantize a high-precision checkpoint's projections at load (per-channel weights,
    # per-token activations). FP8 checkpoints (config.json's quantization_config) need no flag.
    quantization: str | None = None
    # `--enable-lora`: the adapters' limits, which the runner sizes its slots by; None: no LoRA.
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.tp_overlap_comm not in TP_OVERLAP_COMMS:
            raise ValueError(f"tp_overlap_comm must be one of {TP_OVERLAP_COMMS}, got {self.tp_overlap_comm!r}")
        tokens = self.piecewise_cuda_graph_max_tokens
        if tokens is not None and not 0 <= tokens <= MAX_PIECEWISE_GRAPH_TOKENS:
            raise ValueError(f"piecewise_cuda_graph_max_tokens must be 0 to {MAX_PIECEWISE_GRAPH_TOKENS}, got {tokens}")

    def piecewise_graph_tokens(self, fp8_projections: bool = False) -> int:
        """The largest step of prompt tokens piecewise CUDA graphs serve (0: none) for a model whose
        projections are FP8 or not, on one rank or several; see the field."""
        if self.piecewise_cuda_graph_max_tokens is not None:
            return self.piecewise_cuda_graph_max_tokens
        return FP8_PIECEWISE_GRAPH_TOKENS if fp8_projections else PIECEWISE_GRAPH_TOKENS


@dataclass(frozen=True)
class LoRAConfig:
    """`--enable-lora`'s limits, as the runner takes them (None on the model config when LoRA is
    off: then the runner has no LoRA cost). `max_loras`: adapters one step may use (the device's
    slots); `max_lora_rank`: the largest rank an adapter may have; `max_cpu_loras`: adapters kept
    loaded in host memory (None: `max_loras`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept loaded on the host."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`: vLLM's KVEventsConfig, field for field (`engine/kv_events.py`)."""

    enable_kv_cache_events: bool = False
    publisher: str = ""  # "zmq" | "null"; "": zmq when enabled, else null (as vLLM)
    endpoint: str = "tcp://*:5557"  # PUB socket; under --data-parallel-size the port plus the rank
    replay_endpoint: str | None = None  # ROUTER socket answering replay requests (port plus rank too)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parses vLLM's JSON shape; ValueError names what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; known: {sorted(known)}")
        kinds = {"enable_kv_cache_events": (bool,), "publisher": (str,), "endpoint": (str,),
                 "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,),
                 "max_queue_size": (int,), "topic": (str,)}
        for name, value in raw.items():
            if not isinstance(value, kinds[name]) or (isinstance(value, bool) and bool not in kinds[name]):
                raise ValueError(f"{name}: {value!r} is not of the expected type")
        config = cls(**raw)
        publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"publisher: {publisher!r} is not one of 'zmq', 'null'")
        for name in ("buffer_steps", "max_queue_size"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if config.hwm < 0:
            raise ValueError("hwm must be zero or more")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(config, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name}: {value!r} is not a tcp://, ipc:// or inproc:// endpoint")
        return cls(**{**raw, "publisher": publisher})


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None  # None: sized from memory (GPU) or cpu_kv_cache_gb (CPU)
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0
    enable_prefix_caching: bool = True  # full KV pages shared by content across requests
    kv_cache_dtype: str = "auto"  # auto (the attention dtype) | fp8 (e4m3, scale 1.0)
    prefix_caching_hash_seed: str = "flashserve"  # the page hash chain's seed (kv_cache/manager.py)
    kv_events: KVEventsConfig | None = None  # None: no KV cache events published


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
    # Prompt tokens a step computes for more than one prompt: a step takes another waiting prompt
    # only while its prompt tokens (running requests' chunks and admitted prompts) stay within this,
    # so that prompts arriving together get their first tokens one after the other instead of all
    # at the end of one long step; a prompt alone may take the whole budget. None: chosen where the
    # device is known (`worker/step_budget.py`): 2048 on a GPU, no bound on a CPU. 0: no bound.
    max_prefill_tokens: int | None = None
    # Prompt tokens of a step in which running streams wait for their next token (like SGLang's
    # --chunked-prefill-size): a longer prompt, or the rest of the step's prompts, continues in the
    # next steps, so that no stream waits on a step much longer than a decode step. Steps that no
    # stream waits on are bounded by the step budgets only. 0 (the default): no bound. Measured under
    # the seed protocol on one H200 (the 8B), 1,024 raised P99 TTFT from 145 to 247 ms with FP8 and
    # from 184 to 257 in bf16 while P99 ITL fell only from 34 to 31 and 48 to 37 ms; with later chunks
    # attended apart since (`attention/flashinfer.py` CONTINUED_MIN_TOKENS), bf16 still measured 286:
    # most prompts take two steps, which cost more than one (`benchmark/results/NVIDIA_H200/mixed_step/`).
    # FP8 at 24 req/s on that tree: 1,280 gave P99 TTFT 195 ms and P99 ITL 3.3x its median, 1,024 206 ms
    # and 2.6x, no bound 135 ms and 4.9x (`benchmark/results/NVIDIA_H200/seed_protocol/README.md`).
    chunked_prefill_size: int = 0
    # Schedule and launch the next step while the device computes the last one; its decode tokens
    # come from the last step's sampled ids on the device (`engine/llm_engine.py`).
    overlap_scheduling: bool = True
    # With overlap scheduling: hold the launch behind a step of decode rows until shortly before that
    # step's predicted end, receiving requests until then, so that a prompt arriving meanwhile joins
    # the next step instead of the one after it (`engine/late_launch.py`). None (the default): behind
    # decode steps of at least 8 ms on the device (`AUTO_MIN_DECODE_S`). On two H200s that took 2-19 ms
    # off the median TTFT of the 70B's shapes (decode steps of 9-21 ms), where the 8B's 3.4-7.5 ms steps
    # gained 0-5 ms in one A/B and lost 0.3 ms of median ITL in another
    # (`benchmark/results/NVIDIA_H200/late_launch/`). True: behind every decode step; False: never (the
    # offline `LLM`'s default: nothing arrives while its generate() drives the engine).
    late_launch: bool | None = None
    # `--speculative-config`: draft tokens verified in each decode step (`spec_decode/`); None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name in ("max_prefill_tokens", "chunked_prefill_size"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be 0 (no bound) or more, got {value}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    api_keys: tuple[str, ...] = field(default=())
