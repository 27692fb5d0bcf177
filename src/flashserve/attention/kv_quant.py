"""The KV cache's storage dtype: the attention dtype, or FP8 (e4m3).

An FP8 cache stores K and V saturated to +-448 and cast to e4m3, with scale 1.0 (vLLM's default
where a checkpoint has no calibrated KV scales; e4m3's range covers Llama-family K/V), and reads
them back cast to the attention dtype. The backends own the pool and apply these on append and
read; FlashInfer's kernels read FP8 pages natively. On a GPU with Triton, `paged_append.append_paged`
saturates, casts and writes a step's K and V into their pages in one kernel (five otherwise: two
clamps, two casts and FlashInfer's append).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_DTYPE = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)


def resolve_kv_cache_dtype(name: str, attention_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype` -> the cache's torch dtype ("auto": the attention dtype)."""
    if name == "auto":
        return attention_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {name!r}; choose {', '.join(KV_CACHE_DTYPES)}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V values in the cache's dtype (saturated for FP8: torch's cast may give NaN beyond 448)."""
    if is_fp8(cache_dtype):
        x = x.clamp(-_FP8_MAX, _FP8_MAX)
    return x.to(cache_dtype)


def bits(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache viewed as bytes, else the cache: torch's CPU indexing kernels (index_copy_,
    index_select, gathers) have no float8 versions, and moving bytes is the same operation."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def read_bits(values: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """Values gathered from `bits(cache)` -> `dtype`."""
    return values.view(cache_dtype).to(dtype) if is_fp8(cache_dtype) else values.to(dtype)
