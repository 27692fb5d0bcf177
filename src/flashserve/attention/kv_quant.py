"""The KV cache's storage dtype: the attention dtype, or FP8 (e4m3).

An FP8 cache stores K and V saturated to +-448 and cast to e4m3, with scale 1.0 (vLLM's default
where a checkpoint has no calibrated KV scales; e4m3's range covers Llama-family K/V), and reads
them back cast to the attention dtype. The backends own the pool and apply these on append and
read; FlashInfer's kernels read FP8 pages natively. On a GPU with Triton, `append_fp8_paged` saturates,
casts and writes a step's K and V into their pages in one kernel (five otherwise: two clamps, two
casts and FlashInfer's append).
"""

from __future__ import annotations

import functools
from typing import Any

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


@functools.cache
def _fp8_append_kernel() -> Any:
    try:
        import triton.language as tl
        from triton import jit
    except ImportError:
        return None

    @jit
    def fp8_append_kernel(k_ptr, v_ptr, k_stride, v_stride, batch_ptr, pos_ptr, indices_ptr, indptr_ptr, kc_ptr, vc_ptr,
               page_size, N: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t)
        page = tl.load(indices_ptr + tl.load(indptr_ptr + tl.load(batch_ptr + t)) + pos // page_size).to(tl.int64)
        dst = (page * page_size + pos % page_size) * N
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        k = tl.load(k_ptr + t * k_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(kc_ptr + dst + offs, tl.clamp(k, -448.0, 448.0).to(tl.float8e4nv), mask=mask)
        v = tl.load(v_ptr + t * v_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(vc_ptr + dst + offs, tl.clamp(v, -448.0, 448.0).to(tl.float8e4nv), mask=mask)

    return fp8_append_kernel


def _rows(x: torch.Tensor) -> bool:
    """Each token's [heads, head_dim] contiguous (a column slice of a fused qkv output is)."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def append_fp8_paged(
    k: torch.Tensor, v: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
    kv_indices: torch.Tensor, kv_indptr: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
) -> bool:  # fmt: skip
    """Writes k, v [T, Hkv, D] (saturated to e4m3, as `to_cache`) into an FP8 NHD paged cache
    [pages, page_size, Hkv, D] at token t's position `positions[t]` of request `batch_indices[t]`,
    whose pages are `kv_indices[kv_indptr[b]:]` (FlashInfer's `append_paged_kv_cache` arguments):
    one kernel (the FlashInfer backend's, so on a GPU). Returns False, having done nothing, where it
    cannot run: a cache that is not FP8, no Triton, or K / V rows that are not contiguous."""
    k_cache, v_cache = cache
    kernel = _fp8_append_kernel() if is_fp8(k_cache.dtype) else None
    if kernel is None or not (_rows(k) and _rows(v)):
        return False
    t = k.shape[0]
    n = k.shape[-2] * k.shape[-1]
    if t:
        block = 1 << max(n - 1, 1).bit_length()
        kernel[(t,)](k, v, k.stride(0), v.stride(0), batch_indices, positions, kv_indices, kv_indptr, k_cache,
                     v_cache, k_cache.shape[1], N=n, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return True
