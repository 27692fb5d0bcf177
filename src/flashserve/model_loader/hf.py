"""transformers' side of loading: configs, tokenizers, generation configs and, for the generic path
and GGUF files, `from_pretrained` models. Every function imports transformers when called."""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator

import torch

from flashserve.config import ModelConfig
from flashserve.layers.quantization import fp8_scheme


def read_config(source: str, config: ModelConfig, gguf_file: str | None = None) -> Any:
    """The model's transformers config: of an HF id or directory, or of a GGUF file in `source`."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": config.trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    return AutoConfig.from_pretrained(source, **kwargs)


def generation_config(source: str, default: Any) -> Any:
    """The checkpoint's generation_config.json (its eos ids), else `default`."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except (OSError, ValueError):
        return default


def load_pretrained(
    source: str, gguf_file: str | None, hf_config: Any, dtype: torch.dtype, config: ModelConfig, device: torch.device,
) -> torch.nn.Module:  # fmt: skip
    """transformers' model of `hf_config` with the weights of `source` (a GGUF file in it: dequantized)."""
    from transformers import AutoModelForCausalLM

    refuse_quantized(hf_config, source)
    kwargs: dict[str, Any] = {"trust_remote_code": config.trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if device.type != "cpu":
        kwargs["device_map"] = str(device)  # load straight onto the GPU, not via host memory
    return AutoModelForCausalLM.from_pretrained(source, config=hf_config, dtype=dtype, **kwargs).to(device)


def refuse_quantized(hf_config: Any, source: str) -> None:
    """A quantized checkpoint loads only on the native path, from a local directory: transformers
    would need the quantization library and serve it another way."""
    if fp8_scheme(hf_config) is not None:  # raises for formats that are not FP8
        raise ValueError(f"{source}: FP8 checkpoints load from a local directory of safetensors files on the "
                         "native model path (Llama, Mistral, Qwen2, Qwen3; not --model-impl hf)")


def load_tokenizer(source: str, gguf_file: str | None, trust_remote_code: bool, hf_config: Any = None) -> Any:
    """hf_config: the model's, when the tokenizer comes from the same source (saves reading it again)."""
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if hf_config is not None:
        kwargs["config"] = hf_config
    return AutoTokenizer.from_pretrained(source, **kwargs)


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
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


def split_gguf(path: str) -> tuple[str, str]:
    path = os.path.abspath(path)
    return os.path.dirname(path), os.path.basename(path)
