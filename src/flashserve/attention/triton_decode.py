"""Decode attention for a few sequences: Triton, split-KV, two kernels with PDL on Hopper.

At one to a few decode rows a layer's attention is latency, not bandwidth: FlashInfer's decode
(the tensor-core prefill kernel over split KV, then its merge) takes about 12 us a layer on an
H100 for 512 cached tokens, which it reads in under 1 us. Here each (request, KV head, split) is
one program that attends the head's query group (the GQA heads that share the KV head, as the rows
of one tensor-core tile) over its slice of the request's pages with an online softmax, and writes
its partial output and log-sum-exp in float32; a second kernel merges a row's splits by their
log-sum-exps. The split count adapts to each request's length on the device (at least
`MIN_CHUNK` tokens a split, at most `max_splits` splits), so one launch shape serves every length
and a CUDA graph can hold it.

Numerics: scores and the softmax in float32 as FlashInfer's; the probabilities enter the product
with V in float16 for a float16 q, as FlashInfer's do, and as TF32 for a bfloat16 q (10 mantissa
bits where FlashInfer rounds them to bfloat16's 7: against a float32 attention the error of a
bfloat16 decode step was half FlashInfer's on an H100); the splits stay float32 until the merge,
which rounds once. An FP8 cache (scale 1) is widened to q's dtype, but to float16 for a bfloat16 q,
which is rounded to float16 for it (clamped to float16's range): e4m3 widens to float16 in one
instruction on sm_89 and later, where widening it to bfloat16 costs several, and float16 keeps all
of e4m3's values and 3 more of q's mantissa bits than bfloat16. The cache is the NHD layout (K, V)
each [pages, page_size, Hkv, D] with FlashInfer's kv_indptr / kv_indices / kv_last_page_len.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from flashserve.layers.pdl import triton_pdl

Tensor = torch.Tensor

# Tokens of one loop iteration (gathered across pages) and the fewest tokens a split takes.
BLOCK_T = 64
MIN_CHUNK = 64
_LOG2E = 1.4426950408889634


def available() -> bool:
    """Whether Triton is installed (the kernels build on first use)."""
    return _kernels() is not None


@functools.cache
def max_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits a request's KV may take: enough (request, head, split) programs for about two on
    every SM of `device`, a power of two from 2 to 64 (each eager decode step asks: cached)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    want = max(2, (2 * sms) // max(1, batch * num_kv_heads))
    return min(64, 1 << (want.bit_length() - 1))


@functools.cache
def _kernels() -> Any:
    try:
        import triton.language as tl
        from triton import jit
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        return None

    @jit
    def decode_split_kernel(q_ptr, kc_ptr, vc_ptr, indptr_ptr, indices_ptr, last_ptr, o_ptr, lse_ptr, q_stride,
               scale_log2, PAGE: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, MAX_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
               PDL: tl.constexpr, F16_KV: tl.constexpr):  # fmt: skip
        bh = tl.program_id(0)
        s = tl.program_id(1)
        b = bh // HKV
        h = bh % HKV
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        # The request's length, and its split's tokens: a multiple of BLOCK_T, at least MIN_CHUNK.
        kv_len = (tl.load(indptr_ptr + b + 1) - tl.load(indptr_ptr + b) - 1) * PAGE + tl.load(last_ptr + b)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len, MAX_SPLITS), BLOCK_T) * BLOCK_T, MIN_CHUNK)
        lo = s * chunk
        if lo < kv_len:
            hi = tl.minimum(lo + chunk, kv_len)
            first_page = tl.load(indptr_ptr + b)
            rg = tl.arange(0, BLOCK_G)
            rd = tl.arange(0, D)
            rt = tl.arange(0, BLOCK_T)
            g_in = rg < G
            heads = h * G + rg
            q = tl.load(q_ptr + b.to(tl.int64) * q_stride + heads[:, None] * D + rd[None, :], mask=g_in[:, None],
                        other=0.0)  # fmt: skip
            if F16_KV:  # an FP8 cache: K and V widen to float16, so q and the products are float16
                q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)  # float16's largest
            m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
            l = tl.zeros((BLOCK_G,), tl.float32)
            acc = tl.zeros((BLOCK_G, D), tl.float32)
            for t0 in range(lo, hi, BLOCK_T):
                tok = t0 + rt
                t_in = tok < hi
                page = tl.load(indices_ptr + first_page + tok // PAGE, mask=t_in, other=0).to(tl.int64)
                rows = ((page * PAGE + tok % PAGE) * HKV + h) * D
                k = tl.load(kc_ptr + rows[:, None] + rd[None, :], mask=t_in[:, None], other=0.0).to(q.dtype)
                scores = tl.dot(q, tl.trans(k)) * scale_log2  # base 2: exp2 below
                scores = tl.where(t_in[None, :], scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(scores - m_new[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                v = tl.load(vc_ptr + rows[:, None] + rd[None, :], mask=t_in[:, None], other=0.0).to(q.dtype)
                if q.dtype == tl.float16:  # p to float16 (10 mantissa bits, rounded to nearest)
                    pv = tl.dot(p.to(tl.float16), v)
                else:  # bfloat16 would keep 7: TF32 keeps 10
                    pv = tl.dot(p, v.to(tl.float32), input_precision="tf32")
                acc = acc * alpha[:, None] + pv
                m = m_new
            part = (b * (HKV * G) + heads) * MAX_SPLITS + s
            tl.store(o_ptr + part[:, None].to(tl.int64) * D + rd[None, :], acc / l[:, None], mask=g_in[:, None])
            tl.store(lse_ptr + part, m + tl.log2(l), mask=g_in)

    @jit
    def decode_merge_kernel(o_ptr, lse_ptr, out_ptr, indptr_ptr, last_ptr, out_stride, PAGE: tl.constexpr,
               HQ: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, MAX_SPLITS: tl.constexpr,
               MIN_CHUNK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)  # b * HQ + query head
        b = r // HQ
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        kv_len = (tl.load(indptr_ptr + b + 1) - tl.load(indptr_ptr + b) - 1) * PAGE + tl.load(last_ptr + b)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len, MAX_SPLITS), BLOCK_T) * BLOCK_T, MIN_CHUNK)  # as the splits'
        rs = tl.arange(0, MAX_SPLITS)
        s_in = rs < tl.cdiv(kv_len, chunk)
        rd = tl.arange(0, D)
        lse = tl.load(lse_ptr + r * MAX_SPLITS + rs, mask=s_in, other=float("-inf"))
        w = tl.where(s_in, tl.exp2(lse - tl.max(lse, axis=0)), 0.0)
        o = tl.load(o_ptr + (r * MAX_SPLITS + rs)[:, None].to(tl.int64) * D + rd[None, :], mask=s_in[:, None],
                    other=0.0)  # fmt: skip
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + b.to(tl.int64) * out_stride + (r % HQ) * D + rd, out.to(out_ptr.dtype.element_ty))

    return decode_split_kernel, decode_merge_kernel


def decode_attention(
    q: Tensor, cache: tuple[Tensor, Tensor], kv_indptr: Tensor, kv_indices: Tensor, kv_last_page_len: Tensor,
    sm_scale: float, splits: int, block_t: int = BLOCK_T, num_warps: int = 4, num_stages: int | None = None,
) -> Tensor:  # fmt: skip
    """q [B, Hq, D] (one new token a request, already in the cache) -> [B, Hq, D] in q's dtype:
    each request's query heads over its pages. `splits`: `max_splits` for the launch (a power of
    two; fixed for a CUDA graph). `block_t`, `num_warps`, `num_stages`: the split kernel's tile of
    tokens and its launch (None: Triton's default stages)."""
    split_kernel, merge_kernel = _kernels()
    k_cache, v_cache = cache
    b, hq, d = q.shape
    hkv, page = k_cache.shape[2], k_cache.shape[1]
    if q.stride(-1) != 1 or q.stride(-2) != d or hq % hkv or d & (d - 1):
        raise ValueError(f"decode_attention: q {tuple(q.shape)} with strides {q.stride()}, {hkv} KV heads")
    g = hq // hkv
    o = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    common = {"PAGE": page, "D": d, "BLOCK_T": block_t, "MAX_SPLITS": splits, "MIN_CHUNK": max(MIN_CHUNK, block_t),
              **triton_pdl(q.device)}
    stages = {} if num_stages is None else {"num_stages": num_stages}
    f16_kv = k_cache.element_size() == 1 and q.dtype == torch.bfloat16  # an FP8 cache, a bfloat16 q
    split_kernel[(b * hkv, splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, o, lse, q.stride(0), sm_scale * _LOG2E,
        HKV=hkv, G=g, BLOCK_G=max(16, 1 << max(g - 1, 0).bit_length()), F16_KV=f16_kv, num_warps=num_warps,
        **stages, **common,
    )  # fmt: skip
    merge_kernel[(b * hq,)](o, lse, out, kv_indptr, kv_last_page_len, out.stride(0), HQ=hq, num_warps=4, **common)
    return out
