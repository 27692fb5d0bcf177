"""A step's K and V into the paged cache, RoPE on the way: one Triton kernel a layer.

FlashInfer's way is two kernels a layer: `apply_rope_with_cos_sin_cache_inplace` rotates q and k,
then `append_paged_kv_cache` copies k and v into their pages (and an FP8 cache adds a clamp and a
cast for each of K and V before it). On a GPU with Triton, `append_paged` is one kernel, one
program per new token: it rotates the token's q heads in place and its k heads (neox style, as
HF's `rotate_half`: in float32, rounded to q's and k's dtype as the separate kernel rounds them),
and writes k and v into the token's page slot, saturated to +-448 and cast for an FP8 cache
(`kv_quant.to_cache`). Without RoPE it is the FP8 cache's saturating append alone. On Hopper it
launches with PDL (`layers/pdl.py`).

The cache is FlashInfer's NHD layout, (K, V) each [pages, page_size, Hkv, D]; the page of token t
is `kv_indices[kv_indptr[batch_indices[t]] + positions[t] // page_size]`, as `append_paged_kv_cache`
takes it. RoPE's positions are separate from the append's: a cascade step appends within each
request's own pages.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from flashserve.attention.kv_quant import is_fp8
from flashserve.layers.pdl import triton_pdl

Tensor = torch.Tensor


class Rope(NamedTuple):
    """The rotation a step's q and k still need: absolute `positions` [T] and the model's table
    `cos_sin` [max_positions, rotary_dim] float32 (cos | sin halves, `layers/ops.rope_cos_sin_cache`)."""

    positions: Tensor
    cos_sin: Tensor


def fuses_rope(cos_sin: Tensor, head_dim: int) -> bool:
    """Whether `append_paged` can rotate with `cos_sin`: the whole head rotated (no partial
    rotary), a float32 table, and the kernel available (`_kernel`)."""
    return cos_sin.dtype == torch.float32 and cos_sin.shape[-1] == head_dim and head_dim % 2 == 0 and _kernel() is not None


@functools.cache
def _kernel() -> Any:
    try:
        import triton.language as tl
        from triton import jit
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        return None

    @jit
    def paged_append_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, rope_pos_ptr, cos_sin_ptr, cs_stride,
               batch_ptr, pos_ptr, indices_ptr, indptr_ptr, kc_ptr, vc_ptr, page_size, HQ: tl.constexpr,
               HKV: tl.constexpr, D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
               BLOCK_HALF: tl.constexpr, ROPE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        HALF: tl.constexpr = D // 2
        rd = tl.arange(0, BLOCK_HALF)
        d_in = rd < HALF
        rk = tl.arange(0, BLOCK_HKV)
        kv_in = (rk < HKV)[:, None] & d_in[None, :]
        src = rk[:, None] * D + rd[None, :]
        k1 = tl.load(k_ptr + t * k_stride + src, mask=kv_in, other=0.0)
        k2 = tl.load(k_ptr + t * k_stride + src + HALF, mask=kv_in, other=0.0)
        if ROPE:
            row = cos_sin_ptr + tl.load(rope_pos_ptr + t).to(tl.int64) * cs_stride
            cos = tl.load(row + rd, mask=d_in, other=0.0)[None, :]
            sin = tl.load(row + HALF + rd, mask=d_in, other=0.0)[None, :]
            rq = tl.arange(0, BLOCK_HQ)
            q_in = (rq < HQ)[:, None] & d_in[None, :]
            q_at = q_ptr + t * q_stride + rq[:, None] * D + rd[None, :]
            q1 = tl.load(q_at, mask=q_in, other=0.0).to(tl.float32)
            q2 = tl.load(q_at + HALF, mask=q_in, other=0.0).to(tl.float32)
            tl.store(q_at, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_in)
            tl.store(q_at + HALF, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_in)
            k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
            k1 = (k1f * cos - k2f * sin).to(k_ptr.dtype.element_ty)
            k2 = (k2f * cos + k1f * sin).to(k_ptr.dtype.element_ty)
        v1 = tl.load(v_ptr + t * v_stride + src, mask=kv_in, other=0.0)
        v2 = tl.load(v_ptr + t * v_stride + src + HALF, mask=kv_in, other=0.0)
        pos = tl.load(pos_ptr + t)
        page = tl.load(indices_ptr + tl.load(indptr_ptr + tl.load(batch_ptr + t)) + pos // page_size).to(tl.int64)
        dst = (page * page_size + pos % page_size) * (HKV * D) + src
        if FP8:
            k1 = tl.clamp(k1.to(tl.float32), -448.0, 448.0)
            k2 = tl.clamp(k2.to(tl.float32), -448.0, 448.0)
            v1 = tl.clamp(v1.to(tl.float32), -448.0, 448.0)
            v2 = tl.clamp(v2.to(tl.float32), -448.0, 448.0)
        tl.store(kc_ptr + dst, k1.to(kc_ptr.dtype.element_ty), mask=kv_in)
        tl.store(kc_ptr + dst + HALF, k2.to(kc_ptr.dtype.element_ty), mask=kv_in)
        tl.store(vc_ptr + dst, v1.to(vc_ptr.dtype.element_ty), mask=kv_in)
        tl.store(vc_ptr + dst + HALF, v2.to(vc_ptr.dtype.element_ty), mask=kv_in)

    return paged_append_kernel


def _rows(x: Tensor) -> bool:
    """Each token's [heads, head_dim] contiguous (a column slice of a fused qkv output is)."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def append_paged(
    q: Tensor, k: Tensor, v: Tensor, batch_indices: Tensor, positions: Tensor, kv_indices: Tensor,
    kv_indptr: Tensor, cache: tuple[Tensor, Tensor], rope: Rope | None = None,
) -> bool:  # fmt: skip
    """Writes k, v [T, Hkv, D] into `cache` at token t's position `positions[t]` of request
    `batch_indices[t]` (the module's layout), saturated to e4m3 for an FP8 cache; with `rope`,
    first rotates q [T, Hq, D] in place and k (k itself is left as it was). One kernel.

    Returns False, having done nothing, where it does not run: no Triton, K / V rows that are not
    contiguous, with `rope` q rows that are not or a table that `fuses_rope` refuses, or neither
    RoPE nor an FP8 cache (a plain append is FlashInfer's)."""
    k_cache, v_cache = cache
    kernel = _kernel()
    wanted = rope is not None or is_fp8(k_cache.dtype)
    if kernel is None or not wanted or not (_rows(k) and _rows(v)):
        return False
    d = k.shape[-1]
    if rope is not None and not (_rows(q) and fuses_rope(rope.cos_sin, d)):
        return False
    t = k.shape[0]
    if t:
        hq, hkv = q.shape[-2], k.shape[-2]
        cos_sin = rope.cos_sin if rope is not None else k_cache  # without RoPE: any pointer, never read
        kernel[(t,)](
            q, k, v, q.stride(0), k.stride(0), v.stride(0), rope.positions if rope is not None else positions, cos_sin,
            cos_sin.stride(0), batch_indices, positions, kv_indices, kv_indptr, k_cache, v_cache, k_cache.shape[1],
            HQ=hq, HKV=hkv, D=d, BLOCK_HQ=_pow2(hq), BLOCK_HKV=_pow2(hkv), BLOCK_HALF=_pow2(d // 2),
            ROPE=rope is not None, FP8=is_fp8(k_cache.dtype), num_warps=4, **triton_pdl(k.device),
        )  # fmt: skip
    return True
