"""The FP8 Triton kernels run by Triton's interpreter on a CPU (`TRITON_INTERPRET=1`, set before
Triton is imported: run this file as a script). Prints a JSON object of measurements that
`test_fp8_kernels_interpreted.py` asserts on. The interpreter rounds float8 casts that carry into
the next power of two wrongly, so what it checks avoids depending on those roundings: the indexing
and saturation of the KV append with values e4m3 holds exactly, the same append rotating q and k
(RoPE) into a bfloat16 cache, the split-KV decode attention and its merge, the residual update and the norm in float32, the scales each kernel
picks, and the FP8-weight GEMV."""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from flashserve.attention.kv_quant import FP8_KV_DTYPE, to_cache  # noqa: E402
from flashserve.attention.paged_append import Rope, append_paged  # noqa: E402
from flashserve.attention.triton_decode import decode_attention  # noqa: E402
from flashserve.layers.fp8 import MIN_SCALE, UnscaledRows, dequantize_weight, quantize_weight_per_channel  # noqa: E402
from flashserve.layers.fp8_fused import add_rmsnorm_quant, silu_and_mul_quant  # noqa: E402
from flashserve.layers.fp8_gemm import fp8_weight_gemv  # noqa: E402
from flashserve.layers.ops import apply_rope_torch, rope_cos_sin_cache, rope_inv_freq  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


PAGE, PAGES = 4, 12
NEW, BEFORE = [1, 5, 6], [3, 2, 0]  # three requests whose new tokens cross page boundaries


def step_pages(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch_indices, positions, kv_indices, kv_indptr) of the three requests, pages shuffled."""
    table = torch.randperm(PAGES, generator=gen).int()
    counts = [(b + n + PAGE - 1) // PAGE for b, n in zip(BEFORE, NEW)]
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(NEW)).int()
    pos = torch.cat([torch.arange(b, b + n) for b, n in zip(BEFORE, NEW)]).int()
    return batch, pos, table[: int(indptr[-1])].contiguous(), indptr


def reference_append(k: torch.Tensor, v: torch.Tensor, pages: tuple, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    batch, pos, indices, indptr = pages
    ref = tuple(torch.zeros_like(like) for _ in range(2))
    for t in range(k.shape[0]):
        b, p = int(batch[t]), int(pos[t])
        slot = (int(indices[int(indptr[b]) + p // PAGE]), p % PAGE)
        ref[0][slot] = to_cache(k[t], like.dtype)
        ref[1][slot] = to_cache(v[t], like.dtype)
    return ref


def append() -> dict[str, bool]:
    """K / V as column slices of a fused qkv, values e4m3 holds exactly and two that saturate."""
    gen = torch.Generator().manual_seed(0)
    heads, dim = 2, 8
    pages = step_pages(gen)
    exact = torch.tensor([0.5, -1.5, 3.0, -6.0, 0.75, 448.0, -448.0, 1000.0, -2000.0, 13.0])  # the last two saturate
    qkv = exact[torch.randint(0, len(exact), (sum(NEW), 6 * heads * dim), generator=gen)]
    q = qkv[:, : 4 * heads * dim].view(-1, 4 * heads, dim)
    k = qkv[:, 4 * heads * dim : 5 * heads * dim].view(-1, heads, dim)
    v = qkv[:, 5 * heads * dim :].view(-1, heads, dim)
    cache = tuple(torch.zeros(PAGES, PAGE, heads, dim, dtype=FP8_KV_DTYPE) for _ in range(2))
    ran = append_paged(q, k, v, *pages, cache)
    ref = reference_append(k, v, pages, cache[0])
    same = all(torch.equal(c.view(torch.uint8), r.view(torch.uint8)) for c, r in zip(cache, ref))
    return {"append_ran": ran, "append_bytes_equal": same}


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in units of bfloat16's spacing at b (8 significant bits)."""
    spacing = torch.ldexp(torch.ones_like(b, dtype=torch.float32), torch.frexp(b.float()).exponent - 8)
    return float(((a.float() - b.float()).abs() / spacing).max())


def rope_append() -> dict[str, float | bool]:
    """bfloat16 q / k / v of a fused qkv (6 q heads, 2 KV heads, head size 12: no power of two),
    rotated at absolute positions other than the append's (as a cascade step's), into a bfloat16
    cache; against `apply_rope_torch` and the reference append. The interpreter truncates float32
    to bfloat16 where a GPU rounds to nearest, so the two may differ by one bfloat16 step."""
    gen = torch.Generator().manual_seed(4)
    hq, hkv, dim = 6, 2, 12
    pages = step_pages(gen)
    qkv = torch.randn(sum(NEW), (hq + 2 * hkv) * dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, : hq * dim].view(-1, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(-1, hkv, dim)
    v = qkv[:, (hq + hkv) * dim :].view(-1, hkv, dim)
    rope_pos = pages[1].long() + 100
    cos_sin = rope_cos_sin_cache(rope_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, dim), 128, "cpu")
    want_q, want_k = apply_rope_torch(rope_pos, q.reshape(-1, hq * dim).clone(), k.reshape(-1, hkv * dim).clone(), dim, cos_sin)
    k_before = k.clone()
    cache = tuple(torch.zeros(PAGES, PAGE, hkv, dim, dtype=torch.bfloat16) for _ in range(2))
    ran = append_paged(q, k, v, *pages, cache, Rope(rope_pos, cos_sin))
    ref = reference_append(want_k.view(-1, hkv, dim), v, pages, cache[0])
    return {"rope_append_ran": ran, "rope_q_ulps": bf16_ulps(q.reshape(-1, hq * dim), want_q),
            "rope_k_cache_ulps": bf16_ulps(cache[0], ref[0]), "rope_v_cache_equal": torch.equal(cache[1], ref[1]),
            "rope_k_left_alone": torch.equal(k, k_before)}


def reference_decode(q: torch.Tensor, cache: tuple, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
                     sm_scale: float) -> torch.Tensor:  # fmt: skip
    """Each request's query heads over its pages in float32: softmax(q k^T * scale) v."""
    k_cache, v_cache = cache
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    outs = []
    for i in range(q.shape[0]):
        pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
        n = (len(pages) - 1) * page + int(last[i])
        k = k_cache[pages].float().reshape(-1, hkv, k_cache.shape[-1])[:n]
        v = v_cache[pages].float().reshape(-1, hkv, v_cache.shape[-1])[:n]
        scores = torch.einsum("hgd,nhd->hgn", q[i].float().view(hkv, q.shape[1] // hkv, -1), k) * sm_scale
        outs.append(torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v).reshape(q.shape[1], -1))
    return torch.stack(outs)


def decode() -> dict[str, float]:
    """Four requests of 1, 17, 300 and 64 cached tokens on shuffled pages of 16, 3 query heads a KV
    head, q a column slice of a fused qkv; float32 q (the interpreter's bfloat16 products are not
    a GPU's), a float32 cache and an FP8 one, 2 and 8 splits."""
    gen = torch.Generator().manual_seed(5)
    page, hkv, group, dim, pages = 16, 2, 3, 16, 60
    lens = [1, 17, 300, 64]
    counts = [(n + page - 1) // page for n in lens]
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.randperm(pages, generator=gen)[: int(indptr[-1])].int()
    last = torch.tensor([n - (c - 1) * page for n, c in zip(lens, counts)], dtype=torch.int32)
    qkv = torch.randn(len(lens), (group + 2) * hkv * dim, generator=gen)
    q = qkv[:, : group * hkv * dim].view(len(lens), group * hkv, dim)
    out: dict[str, float] = {}
    for name, dtype in (("f32", torch.float32), ("fp8", FP8_KV_DTYPE)):
        cache = tuple((torch.randn(pages, page, hkv, dim, generator=gen) * 2).to(dtype) for _ in range(2))
        want = reference_decode(q, cache, indptr, indices, last, 0.3)
        for splits in (2, 8):
            got = decode_attention(q, cache, indptr, indices, last, 0.3, splits)
            out[f"decode_{name}_{splits}_splits_err"] = rel(got, want)
        if name == "fp8":  # a bfloat16 q: widened to float16 with the cache, products in float16
            q_bf16 = q.to(torch.bfloat16)
            got = decode_attention(q_bf16, cache, indptr, indices, last, 0.3, 2)
            out["decode_fp8_bf16_q_err"] = rel(got, reference_decode(q_bf16.float(), cache, indptr, indices, last, 0.3))
    return out


def norm() -> dict[str, float | bool]:
    gen = torch.Generator().manual_seed(1)
    m, h = 3, 96  # not a power of two: the kernel masks its block's tail
    y = torch.randn(m, h, generator=gen) * 100
    xs, ws = torch.rand(m, 1, generator=gen) * 0.05 + 0.05, torch.rand(1, h, generator=gen) * 0.05 + 0.05
    bias = torch.randn(h, generator=gen)
    residual, w = torch.randn(m, h, generator=gen), torch.rand(h, generator=gen) + 0.5
    r_ref = residual + (y * xs * ws + bias)
    n_ref = r_ref * torch.rsqrt(r_ref.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    res = residual.clone()
    out, res = add_rmsnorm_quant(UnscaledRows(y, xs, ws, bias), res, w, 1e-5, quantize=False)
    assert isinstance(out, torch.Tensor)
    first = residual.clone()
    _, first_after = add_rmsnorm_quant(None, first, w, 1e-5, quantize=False)
    (q, s), _ = add_rmsnorm_quant(UnscaledRows(y, xs, ws, bias), residual.clone(), w, 1e-5)
    (_, s_static), _ = add_rmsnorm_quant(None, residual.clone(), w, 1e-5, True, torch.tensor(0.02))
    (_, s_ub), _ = add_rmsnorm_quant(UnscaledRows(y, xs, ws, bias), residual.clone(), w, 1e-5, True, None, 0.5)
    amax = n_ref.abs().amax(-1, keepdim=True)
    return {
        "norm_residual_err": rel(res, r_ref),
        "norm_out_err": rel(out, n_ref),
        "norm_first_layer_residual_untouched": torch.equal(first_after, residual),
        "norm_scale_err": rel(s, (amax / 448).clamp(min=MIN_SCALE)),
        "norm_static_scale_kept": bool((s_static == torch.tensor(0.02)).all()),
        "norm_bounded_scale_err": rel(s_ub, (amax.clamp(max=0.5) / 448).clamp(min=MIN_SCALE)),
        "norm_quantized_shape": list(q.shape) == [m, h] and q.dtype == torch.float8_e4m3fn,
    }


def silu() -> dict[str, float]:
    gen = torch.Generator().manual_seed(2)
    m, inter = 4, 80
    y = torch.randn(m, 2 * inter, generator=gen) * 100
    xs, ws = torch.rand(m, 1, generator=gen) * 0.05 + 0.05, torch.rand(1, 2 * inter, generator=gen) * 0.05 + 0.05
    bias = torch.randn(2 * inter, generator=gen)
    value = y * xs * ws + bias
    h = torch.nn.functional.silu(value[:, :inter]) * value[:, inter:]
    _, s = silu_and_mul_quant(UnscaledRows(y, xs, ws, bias))
    _, s_plain = silu_and_mul_quant(value)
    want = (h.abs().amax(-1, keepdim=True) / 448).clamp(min=MIN_SCALE)
    return {"silu_scale_err": rel(s, want), "silu_plain_scale_err": rel(s_plain, want)}


def weight_gemv() -> dict[str, float]:
    """One row, N and K no multiples of the blocks; float32 (exact) and bfloat16 activations."""
    gen = torch.Generator().manual_seed(3)
    out: dict[str, float] = {}
    for n, k, dtype in [(96, 80, torch.float32), (70, 1100, torch.float32), (40, 600, torch.bfloat16)]:
        wq, ws = quantize_weight_per_channel(torch.randn(n, k, generator=gen))
        w = dequantize_weight(wq, ws, torch.float32)
        x, bias = torch.randn(1, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
        plain = fp8_weight_gemv(x, wq, ws.view(1, -1), bias)
        gated = fp8_weight_gemv(x, wq, ws.view(1, -1), bias, gated=True)
        full = x.float() @ w.T + bias.float()
        name = f"{n}x{k}_{str(dtype).removeprefix('torch.')}"
        out[f"gemv_{name}_err"] = rel(plain, full)
        out[f"gemv_gated_{name}_err"] = rel(gated, torch.nn.functional.silu(full[:, : n // 2]) * full[:, n // 2 :])
        out[f"gemv_{name}_small_blocks_err"] = rel(fp8_weight_gemv(x, wq, ws.view(1, -1), bias, False, (4, 128, 1)), full)
    return out


if __name__ == "__main__":
    print(json.dumps({**append(), **rope_append(), **decode(), **norm(), **silu(), **weight_gemv()}))
