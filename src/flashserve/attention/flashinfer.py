"""Paged attention on CUDA through FlashInfer: one plan per step, one append + one kernel per layer.

Steps with any prefill chunk go through `BatchPrefillWithPagedKVCacheWrapper` (fa2, causal,
bottom-right aligned, so a chunk attends to its cached prefix); decode-only steps through the
tensor-core `BatchDecodeWithPagedKVCacheWrapper` (any GQA group size, faster than the CUDA-core
kernel on Hopper). A step's index arrays are packed into one pinned buffer and go up in one copy.

Cascade steps (a layout with a prefix level, `attention/cascade.py`): the same wrapper attends each
request to its pages after its group's shared prefix, a second prefill wrapper attends every query
row of the step once more, each group's rows to the group's prefix pages (non-causal, several
groups in one pass) and the rows of no group to the scratch page, and `merge_state_in_place`
merges the two by their log-sum-exps where a row's mask says it is in a group (FLASHINFER.md §4).
Passing every row, not only the groups', keeps the pass's shapes those of the step, which is what a
CUDA graph needs. Both passes write float16 (10 mantissa bits against bfloat16's 7; FlashInfer
builds no float32 output), so the two roundings before the merge cost less than the one rounding to
the cache dtype after it. Attention outputs are convex combinations of V rows, so they stay within
float16's range wherever V does.

`fused_decode` (off by default): RoPE in the append kernel (`paged_append`) and decode steps of a
few requests through `triton_decode`; see the class.

CUDA graphs: decode steps through `flashinfer_graphs.CudaGraphDecode`, uniform verify steps of
speculative decoding through `flashinfer_verify.CudaGraphVerify`, whose methods the backend has.

`flashinfer` is imported in the constructor only, so this module imports without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flashserve.attention import triton_decode
from flashserve.attention.base import BatchLayout
from flashserve.attention.flashinfer_graphs import CudaGraphDecode, GraphBuffers, StepIndices, TritonDecode
from flashserve.attention.flashinfer_verify import CudaGraphVerify, VerifyGraphBuffers
from flashserve.attention.kv_quant import is_fp8, to_cache
from flashserve.attention.paged_append import Rope, append_paged, fuses_rope
from flashserve.layers.ops import apply_rope_torch
from flashserve.pinned_staging import PinnedStaging

_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
# FA2 prefill reads out of bounds (or computes garbage) for other head sizes (FLASHINFER.md §8).
_HEAD_DIMS = (64, 128, 256)


# With `fused_decode`, decode-only steps of up to this many requests attend through
# `triton_decode` on a GPU with Triton (no cascade level); larger ones through FlashInfer's decode.
# On an H100 (8B, FP8) the Triton decode was faster at 1-4 requests of 512 and 4,096 tokens and
# even at 8.
TRITON_DECODE_MAX_BATCH = 4
# FlashInfer's backend for prefill steps (no cascade level, the KV cache in the attention dtype):
# "fa2", or "fa3" (Hopper's FlashAttention-3 kernels, sm_90 only). `benchmark.prefill_attention`
# measures the two.
PREFILL_BACKEND = "fa2"
# A prefill step whose trailing fresh prompts (`BatchLayout.fresh_rows_from`: nothing cached, so
# they attend only this step's K/V) hold at least this many tokens, or twice as many when rows over
# pages come before them, attends them apart: through FlashInfer's ragged prefill over the step's k
# and v as computed (FA3 on Hopper, which does not read an FP8 cache), and the rows before over their
# pages. Per layer call on an H200, 8B heads (`benchmark.prefill_attention`, results under
# `benchmark/results/NVIDIA_H200/prefill_attention/`), paged FA2 -> apart, bf16 / FP8 cache:
# a lone prompt of 512 tokens 73 -> 58 / 109 -> 89 us, of 2,048 172 -> 83 / 213 -> 120 us; beside
# 40 decode rows a prompt of 2,048 tokens 237 -> 142 / 291 -> 137 us, but one of 512 81 -> 96 /
# 108 -> 134 us (the rows' own pass and its launch).
RAGGED_MIN_TOKENS = 512
# Continued prompts (`BatchLayout.continued_rows_from`: a prompt's later chunk, or the rest of a prompt
# after its prefix-cache hit, over its tokens cached before the step) of at least this many tokens
# just before the fresh ones attend apart with them (`apart_min_tokens`):
# their own tokens in the ragged pass, their cached ones in a second, non-causal pass over pages
# (`_continued`), the two merged by their log-sum-exps. In the paged pass beside 48 decode rows of
# the 8B on an H200, a 1,024-token chunk after 1,024 cached tokens took 9.9 ms of attention a step
# over an FP8 cache against 4.1 for the same chunk fresh (bf16: 6.8 against 3.6;
# `benchmark.mixed_step`, results under `benchmark/results/NVIDIA_H200/mixed_step/`).
CONTINUED_MIN_TOKENS = 128


def apart_min_tokens(first: int, continued: bool) -> int:
    """The tokens that rows from `first` on must hold to attend apart: `RAGGED_MIN_TOKENS`, twice as
    many with rows over pages before them, four times as many for continued prompts alone. Per layer
    call on an H200, 8B heads (`benchmark.prefill_attention`), paged FA2 -> apart, bf16 / FP8 cache: a
    chunk of 1,024 tokens after 1,024 cached ones beside 40 decode rows 202 -> 182 / 257 -> 223 us, of
    2,048 after 2,048 452 -> 368 / 596 -> 418 us; alone, of 1,024 tokens 112 -> 186 / 134 -> 225 us
    (three launches where the paged pass is already efficient), of 2,048 384 -> 308 / 485 -> 356 us."""
    if first == 0:
        return 4 * RAGGED_MIN_TOKENS if continued else RAGGED_MIN_TOKENS
    return 2 * RAGGED_MIN_TOKENS


class FlashInferAttentionBackend(CudaGraphDecode, CudaGraphVerify):
    """Owns per-layer K/V pages `[num_pages, page_size, Hkv, D]` (NHD) in `dtype` and attends.

    Same positional constructor as `TorchAttentionBackend`. `dtype` is the cache and attention
    dtype (float16 or bfloat16: FlashInfer has no float32 kernels); q/k/v of another dtype (a
    float32 model) are cast to it and the output is cast back to q's dtype. `num_qo_heads` (the
    model's query heads) is needed by every plan, so the constructor takes it.
    `scratch_page` is a page no request owns (the KV cache manager's page 0): CUDA-graph padding
    rows write their K/V there. `kv_cache_dtype`: the pages' dtype (default `dtype`); an FP8
    (e4m3) cache stores K/V quantized on append (`attention/kv_quant.py`) and FlashInfer's kernels
    read it with q in `dtype` (prefill, decode and cascade alike).

    `fused_decode` (`--fused-decode`): fewer, shorter kernels for decode at a few requests. RoPE
    moves into the kernel that appends K and V (`takes_rope`, `paged_append`: one launch a layer
    instead of FlashInfer's RoPE and append), and decode-only steps of up to
    `TRITON_DECODE_MAX_BATCH` requests attend through `triton_decode`. The 8B FP8 decode step at
    batch 1 (H100): 3.61 ms with it, 3.90 ms without (docs/gpu.md). Off by default: against a
    float32 attention both are as accurate as FlashInfer's kernels (the bfloat16 decode attention
    twice as accurate), but they round otherwise, and the engine's decode logits then drift from
    its own FlashInfer prefill by a little more than with FlashInfer's decode (max 3.2e-2 against
    2.8e-2 in `test_input_batch_gpu`, whose bound is 3e-2).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sm_scale: float | None = None,
        *,
        num_qo_heads: int | None = None,  # required: a keyword for the shared positional signature
        workspace_bytes: int = 256 << 20,
        scratch_page: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
        fused_decode: bool = False,
        prefill_backend: str | None = None,
    ) -> None:
        if dtype not in _ATTENTION_DTYPES:
            raise ValueError(f"FlashInfer attention runs in float16 or bfloat16, not {dtype}")
        if head_dim not in _HEAD_DIMS:
            raise ValueError(f"FlashInfer attention supports head_dim {_HEAD_DIMS}, not {head_dim}")
        if num_qo_heads is None:
            raise ValueError("FlashInfer's plans need num_qo_heads, the model's query head count")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{num_qo_heads} query heads are not a multiple of {num_kv_heads} kv heads")
        if kv_cache_dtype not in (None, dtype) and not is_fp8(kv_cache_dtype):
            raise ValueError(f"the FlashInfer KV cache is in the attention dtype or float8_e4m3fn, not {kv_cache_dtype}")
        if not 0 <= scratch_page < num_pages:
            raise ValueError(f"scratch page {scratch_page} is outside [0, {num_pages})")
        import flashinfer

        from flashserve.attention.flashinfer_modules import use_prebuilt_modules

        use_prebuilt_modules(torch.device(device))
        self._fi = flashinfer
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.num_qo_heads: int = num_qo_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.cache_dtype = kv_cache_dtype or dtype
        self.device = torch.device(device)
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.scratch_page = scratch_page
        self.fused_decode = fused_decode
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=self.cache_dtype, device=self.device),
             torch.zeros(shape, dtype=self.cache_dtype, device=self.device))
            for _ in range(num_layers)
        ]
        # One float workspace for every wrapper: only one of them runs at a time, in stream order.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True, backend="fa2"
        )
        self._prefix: Any = None  # cascade prefix passes' wrapper, built when first needed
        self._continued: Any = None  # continued prompts' cached-token pass, built when first needed
        hopper = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] == 9
        # FA3 for plain prefill steps where it can run (see PREFILL_BACKEND): Hopper, and q, K/V and
        # output in one 16-bit dtype (cascade levels write float16, an FP8 cache mixes dtypes).
        fa3 = (prefill_backend or PREFILL_BACKEND) == "fa3"
        self._prefill_fa3 = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa3") \
            if fa3 and hopper and self.cache_dtype == dtype else None
        # Fresh prompts' pass (RAGGED_MIN_TOKENS): q, k and v in `dtype` whatever the cache holds,
        # so FA3 serves it on Hopper. Planned once here so that its module is built (or loaded)
        # at start-up with the others, not on the first long prompt.
        self._ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace, "NHD", backend="fa3" if hopper else "fa2")
        self._staging = PinnedStaging(self.device)
        self._plan_ragged(torch.tensor([0, 1], dtype=torch.int32))
        self._step: StepIndices | None = None
        self._graph: GraphBuffers | None = None
        self._verify: VerifyGraphBuffers | None = None

    # ---- eager steps -------------------------------------------------------------------------

    def plan(self, layout: BatchLayout) -> None:
        """Once per step: uploads the index arrays and plans the prefill or decode wrapper."""
        if layout.page_size != self.page_size:
            raise ValueError(f"layout page_size {layout.page_size} != cache page_size {self.page_size}")
        qo_indptr = np.asarray(layout.qo_indptr, dtype=np.int32)
        batch_indices = np.repeat(np.arange(layout.batch_size, dtype=np.int32), np.diff(qo_indptr))
        prefix = layout.prefix
        levels: list[Sequence[int] | np.ndarray] = []
        if prefix is not None:
            segments = prefix.row_segments(layout.num_tokens, self.scratch_page)
            assert segments is not None  # without a slot count there is no limit
            levels = [prefix.suffix_kv_indptr, prefix.suffix_kv_indices, segments.qo_indptr, segments.kv_indptr,
                      segments.kv_last_page_len, segments.kv_indices, np.frombuffer(segments.merge, dtype=np.uint8)]
        # Rows [apart, batch) attend apart (`RAGGED_MIN_TOKENS`): fresh prompts from `fresh`, and the
        # continued prompts before them (`CONTINUED_MIN_TOKENS`), whose cached tokens' pages go up too.
        fresh = apart = layout.batch_size
        continued: list[Sequence[int]] = []
        if not layout.is_decode_only and not levels:
            fresh = layout.fresh_rows_from()
            apart = layout.continued_rows_from(fresh, CONTINUED_MIN_TOKENS)
            if apart < fresh and layout.num_tokens - int(qo_indptr[apart]) < apart_min_tokens(apart, True):
                apart = fresh  # too few tokens for the continued prompts' passes: fresh prompts only
            if layout.num_tokens - int(qo_indptr[apart]) < apart_min_tokens(apart, apart < fresh):
                fresh = apart = layout.batch_size  # too few tokens: every row in the paged pass
            elif apart < fresh:
                continued = list(layout.prefix_pages(range(apart, fresh)))
        self._staging.begin()
        host, dev = self._staging.upload(
            [qo_indptr, layout.kv_indptr, layout.kv_last_page_len, layout.kv_indices, batch_indices, layout.positions,
             *levels, *continued]
        )
        qo_h, kv_indptr_h, last_h = host[:3]
        kv_indptr_d, last_d, indices_d, batch_d, pos_d = dev[1:6]
        # The main pass: over each request's pages, or under a cascade its pages after its prefix.
        attend_indptr_h, attend_indices_d = (kv_indptr_h, indices_d) if not levels else (host[6], dev[7])
        out_dtype = self.dtype if not levels else torch.float16  # a cascade's levels: see the module doc
        if layout.is_decode_only and not levels and self.triton_decodes(layout.batch_size):
            wrapper = self._triton_decode(kv_indptr_d, indices_d, last_d, layout.batch_size)
            self._step = StepIndices(wrapper, batch_d, pos_d, indices_d, kv_indptr_d, last_d)
            self._staging.end()
            return
        if apart < layout.batch_size:
            # The rows from `apart` over their own k and v; the rows before them over their pages.
            apart_from = int(qo_indptr[apart])  # the first token attended apart
            self._plan_ragged(qo_h[apart:] - apart_from)
            wrapper = prior = None
            if apart:
                wrapper = self._prefill_fa3 if self._prefill_fa3 is not None else self._prefill
                self._plan_wrapper(wrapper, (qo_h[: apart + 1], kv_indptr_h[: apart + 1], indices_d, last_h[:apart]),
                                   {**self._plan_kwargs(), "causal": True}, last=False)  # fmt: skip
            if continued:  # their cached tokens, all before their new ones: non-causal
                prior = self._continued_wrapper()
                self._plan_wrapper(prior, (qo_h[apart : fresh + 1] - apart_from, host[6], dev[7], host[8]),
                                   {**self._plan_kwargs(), "causal": False}, last=False)  # fmt: skip
            self._staging.end()
            self._step = StepIndices(wrapper, batch_d, pos_d, indices_d, kv_indptr_d, last_d, ragged=self._ragged,
                                     ragged_from=apart_from, continued=prior, continued_to=int(qo_indptr[fresh]))  # fmt: skip
            return
        if layout.is_decode_only:
            wrapper, args = self._decode, (attend_indptr_h, attend_indices_d, last_h)
            kwargs = self._plan_kwargs(out_dtype)
        else:
            plain = self._prefill_fa3 if not levels and self._prefill_fa3 is not None else self._prefill
            wrapper, args = plain, (qo_h, attend_indptr_h, attend_indices_d, last_h)
            kwargs = {**self._plan_kwargs(out_dtype), "causal": True}
        prefix_wrapper = merge = None
        if levels:
            # Every row over its group's shared pages, all computed before this step's tokens:
            # non-causal (`cascade.shareable_pages`).
            prefix_wrapper, merge = self._cascade_prefix_wrapper(), dev[12].to(torch.bool)
            self._plan_wrapper(prefix_wrapper, (host[8], host[9], dev[11], host[10]),
                               {**self._plan_kwargs(out_dtype), "causal": False})
        self._step = StepIndices(wrapper, batch_d, pos_d, indices_d, kv_indptr_d, last_d, prefix_wrapper, merge)
        self._plan_wrapper(wrapper, args, kwargs)

    def triton_decodes(self, batch_size: int) -> bool:
        """Whether a decode-only step of `batch_size` requests (no cascade level) attends through
        `triton_decode` rather than FlashInfer's decode: with `fused_decode`, up to
        `TRITON_DECODE_MAX_BATCH`, on a GPU with Triton."""
        return (self.fused_decode and batch_size <= TRITON_DECODE_MAX_BATCH and self.device.type == "cuda"
                and triton_decode.available())

    def _triton_decode(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last: torch.Tensor,
                       batch_size: int) -> TritonDecode:  # fmt: skip
        splits = triton_decode.max_splits(batch_size, self.num_kv_heads, self.device)
        return TritonDecode(kv_indptr, kv_indices, last, self.sm_scale, splits)

    def _continued_wrapper(self) -> Any:
        """The prefill wrapper of continued prompts' cached-token passes, built when first needed."""
        if self._continued is None:
            self._continued = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
        return self._continued

    def _cascade_prefix_wrapper(self) -> Any:
        """The prefill wrapper of cascade prefix passes, built on the first cascade step."""
        if self._prefix is None:
            self._prefix = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
        return self._prefix

    def _plan_kwargs(self, out_dtype: torch.dtype | None = None) -> dict[str, Any]:
        # Keywords only after page_size (positional ones are deprecated); the dtypes explicitly,
        # since they default to float16.
        return {"q_data_type": self.dtype, "kv_data_type": self.cache_dtype, "o_data_type": out_dtype or self.dtype,
                "sm_scale": self.sm_scale, "non_blocking": True}

    def _plan_wrapper(self, wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any], last: bool = True) -> None:
        """Plans a paged wrapper from the step's staged arrays; `last`: the step's last plan, after
        which the staging buffer may be reused."""
        wrapper.plan(*args, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, **kwargs)
        if last:
            self._staging.end()

    def _plan_ragged(self, indptr: torch.Tensor) -> None:
        """Plans the fresh prompts' pass: causal over their own tokens (`indptr`, host int32, for
        queries and keys alike), all in `dtype`."""
        self._ragged.plan(indptr, indptr, self.num_qo_heads, self.num_kv_heads, self.head_dim, causal=True,
                          **{**self._plan_kwargs(), "kv_data_type": self.dtype})  # fmt: skip

    def takes_rope(self, cos_sin: torch.Tensor, head_dim: int) -> bool:
        """Whether `forward` can be given q and k before RoPE, with the step's `Rope`: with
        `fused_decode` it rotates them in the kernel that appends K and V (`paged_append`), one
        launch instead of two."""
        return self.fused_decode and self.device.type == "cuda" and fuses_rope(cos_sin, head_dim)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D] in q's dtype. See `AttentionBackend`.
        `rope` (where `takes_rope`): q and k are not rotated yet; this rotates them (q in place).
        `out`: a contiguous [T, Hq, D] buffer in q's dtype that the output is written into (and
        returned): FlashInfer's wrappers write it directly, other paths copy into it."""
        step = self._step
        if step is None:
            raise RuntimeError("plan() must run before forward()")
        out_dtype = q.dtype
        cache = self.kv_cache[layer]
        if step.ragged is not None and rope is not None:
            q, k = self._rotate(q, k, rope)  # the ragged pass reads k rotated
            rope = None
        fresh_k, fresh_v = k, v  # before the append casts them to an FP8 cache's dtype
        if not append_paged(q, k, v, step.batch_indices, step.positions, step.kv_indices, step.kv_indptr, cache, rope):
            if rope is not None:  # rows the kernel does not take (a model's qkv views always are)
                q, k = self._rotate(q, k, rope)
            # append_paged_kv_cache reinterprets its input as the cache dtype without checking it.
            k, v = to_cache(k, self.cache_dtype), to_cache(v, self.cache_dtype)
            self._fi.append_paged_kv_cache(
                k, v, step.batch_indices, step.positions, cache,
                step.kv_indices, step.kv_indptr, step.kv_last_page_len, kv_layout="NHD",
            )
        if q.dtype != self.dtype:
            q = q.to(self.dtype)
        if step.ragged is not None:
            return self._apart(step, cache, q, fresh_k, fresh_v, out, out_dtype)
        if out is not None and step.prefix_wrapper is None and out_dtype == self.dtype \
                and not isinstance(step.wrapper, TritonDecode):
            return step.wrapper.run(q, cache, out=out)
        result = step.wrapper.run(q, cache) if step.prefix_wrapper is None else self._cascade(step, q, cache)
        if out is not None:
            return out.copy_(result)
        return result if result.dtype == out_dtype else result.to(out_dtype)

    @staticmethod
    def _rotate(q: torch.Tensor, k: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        t, d = q.shape[0], q.shape[-1]
        q, k = apply_rope_torch(rope.positions, q.reshape(t, -1), k.reshape(t, -1), d, rope.cos_sin)
        return q.view(t, -1, d), k.view(t, -1, d)

    def _apart(self, step: StepIndices, cache: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """A step planned with its last rows apart: the rows before them over their pages, the rows
        apart over their own k and v, each writing its rows of one output; continued prompts' rows
        then merge in their pass over their cached tokens, by the two passes' log-sum-exps."""
        into = out if out is not None and out_dtype == self.dtype else torch.empty_like(q)
        t = step.ragged_from
        if step.wrapper is not None:
            step.wrapper.run(q[:t], cache, out=into[:t])
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        if step.continued is None:
            step.ragged.run(q[t:], k[t:], v[t:], out=into[t:])
        else:
            c = step.continued_to
            _, lse = step.ragged.run(q[t:], k[t:], v[t:], out=into[t:], return_lse=True)
            prior, prior_lse = step.continued.run(q[t:c], cache, return_lse=True)
            self._fi.merge_state_in_place(into[t:c], lse[: c - t], prior, prior_lse)
        if out is not None and into is not out:
            return out.copy_(into)
        return into if into.dtype == out_dtype else into.to(out_dtype)

    def _cascade(self, step: StepIndices, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Each request over its own pages, each group's rows over its prefix once, merged by
        their log-sum-exps (FlashInfer's, base 2, as `merge_state_in_place` takes them) where the
        row is in a group. No host work and no data-dependent shape: a graph can hold it."""
        out, lse = step.wrapper.run(q, cache, return_lse=True)
        prefix_out, prefix_lse = step.prefix_wrapper.run(q, cache, return_lse=True)
        self._fi.merge_state_in_place(out, lse, prefix_out, prefix_lse, mask=step.prefix_merge)
        return out.to(self.dtype)
