"""An FP8 (e4m3) KV cache on the CPU backends: K/V quantized on append, dequantized on read, the
numerics reference of FlashInfer's FP8 KV paths; and `--kv-cache-dtype` through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from flashserve.attention import get_backend_cls
from flashserve.attention.kv_quant import FP8_KV_DTYPE, resolve_kv_cache_dtype
from flashserve.cli import build_parser
from flashserve.serve_args import to_configs
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams
from flashserve.models.llama import LlamaModel
from test_fp8 import SCHEDULE, SEQS
from test_native_llama import NUM_PAGES, PAGE, SMALL, hf_model, native_teacher_forced


def backend(name: str, model: LlamaModel, kv_dtype: torch.dtype) -> object:
    spec = model.spec
    return get_backend_cls(name)(spec.num_layers, NUM_PAGES, PAGE, spec.num_kv_heads, spec.head_dim, torch.float32,
                                 "cpu", kv_cache_dtype=kv_dtype)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    config = LlamaConfig(**SMALL)
    return LlamaModel.from_hf(hf_model(config), config, torch.float32, "cpu")


def logits(model: LlamaModel, name: str, kv_dtype: torch.dtype) -> list[torch.Tensor]:
    return native_teacher_forced(model, SEQS, SCHEDULE, backend(name, model, kv_dtype))


def test_an_fp8_cache_stores_float8_pages(model: LlamaModel) -> None:
    b = backend("reference", model, FP8_KV_DTYPE)
    native_teacher_forced(model, SEQS, SCHEDULE, b)
    k_cache, v_cache = b.kv_cache[0]  # type: ignore[attr-defined]
    assert k_cache.dtype == v_cache.dtype == FP8_KV_DTYPE
    assert k_cache.float().abs().sum() > 0


def test_the_sdpa_backend_reads_an_fp8_cache_as_the_reference_does(model: LlamaModel) -> None:
    for x, y in zip(logits(model, "torch", FP8_KV_DTYPE), logits(model, "reference", FP8_KV_DTYPE)):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_an_fp8_cache_stays_close_to_a_full_precision_cache(model: LlamaModel) -> None:
    for x, y in zip(logits(model, "reference", FP8_KV_DTYPE), logits(model, "reference", torch.float32)):
        assert (x - y).abs().max() <= 0.05 * y.abs().max()
        assert not torch.equal(x, y)  # the cache did round


def test_kv_cache_dtype_auto_is_the_attention_dtype_and_fp8_is_e4m3() -> None:
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int8'"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)


def test_quantization_and_kv_cache_dtype_flags_and_their_environment_twins() -> None:
    args = to_configs(build_parser({}).parse_args(["serve", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    assert (args.model.quantization, args.cache.kv_cache_dtype) == ("fp8", "fp8")
    env = {"FLASHSERVE_QUANTIZATION": "fp8", "FLASHSERVE_KV_CACHE_DTYPE": "fp8"}
    args = to_configs(build_parser(env).parse_args(["serve"]))
    assert (args.model.quantization, args.cache.kv_cache_dtype) == ("fp8", "fp8")
    args = to_configs(build_parser({}).parse_args(["serve"]))
    assert (args.model.quantization, args.cache.kv_cache_dtype) == (None, "auto")


def test_the_engine_generates_with_fp8_weights_and_an_fp8_cache_from_dummy_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LlamaConfig(**SMALL).to_dict(), "eos_token_id": 0}))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tmp_path), load_format="dummy", quantization="fp8", kv_cache_dtype="fp8", num_pages=32,
              cuda_graph=False)
    try:
        out = llm.generate([[5, 6, 7, 8]], params)[0]
        assert len(out.token_ids) == 6
        assert llm.engine.executor.backend.kv_cache[0][0].dtype == FP8_KV_DTYPE
    finally:
        llm.stack.close()
