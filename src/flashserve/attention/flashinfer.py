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

CUDA graphs (decode only): `init_cuda_graph` builds one graph-mode decode wrapper per batch size
over static index buffers, and with `cascade` a second set for cascade decode steps: a decode
wrapper over each request's own pages and a graph-mode prefill wrapper over a fixed number of
level-0 segments (`prefix_slots`). `plan_cuda_graph` pads a batch to such a size with dummy
one-token requests on the scratch page and re-plans before each replay. `worker/cuda_graph.py`
drives it.

`flashinfer` is imported in the constructor only, so this module imports without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashserve.attention import triton_decode
from flashserve.attention.base import BatchLayout
from flashserve.attention.cascade import PrefixLevel
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


@dataclass(frozen=True)
class _TritonDecode:
    """`triton_decode.decode_attention` over one step's index tensors, called as a planned
    FlashInfer wrapper is (`run(q, cache)`); nothing to plan."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    sm_scale: float
    splits: int

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return triton_decode.decode_attention(q, cache, self.kv_indptr, self.kv_indices, self.kv_last_page_len,
                                              self.sm_scale, self.splits)  # fmt: skip


@dataclass(frozen=True)
class _StepIndices:
    """What `forward` needs on the device for the planned step (views, no copies)."""

    wrapper: Any  # the planned prefill or decode wrapper
    batch_indices: torch.Tensor  # [T] int32: request of each new token
    positions: torch.Tensor  # [T] int32: position of each new token in its request
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    # A cascade step: `wrapper` attends each request to its pages after its group's prefix, and
    # `prefix_wrapper` every row to its group's prefix (`RowSegments`); rows where `prefix_merge`
    # is set merge the two.
    prefix_wrapper: Any = None
    prefix_merge: torch.Tensor | None = None


def prefix_slots(batch_size: int) -> int:
    """Level-0 segments a cascade decode graph of `batch_size` rows is planned for: enough for
    groups of four with an ungrouped run between each two, and few enough that the prefix pass's
    query tile stays large (FlashInfer sizes a graph plan's tile for its longest possible segment,
    rows - segments + 1). A step that needs more segments runs eagerly."""
    return min(batch_size, max(4, batch_size // 4))


class FlashInferAttentionBackend:
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
        self._staging = PinnedStaging(self.device)
        self._step: _StepIndices | None = None
        self._graph: _GraphBuffers | None = None

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
        self._staging.begin()
        host, dev = self._staging.upload(
            [qo_indptr, layout.kv_indptr, layout.kv_last_page_len, layout.kv_indices, batch_indices, layout.positions,
             *levels]
        )
        qo_h, kv_indptr_h, last_h = host[:3]
        kv_indptr_d, last_d, indices_d, batch_d, pos_d = dev[1:6]
        # The main pass: over each request's pages, or under a cascade its pages after its prefix.
        attend_indptr_h, attend_indices_d = (kv_indptr_h, indices_d) if not levels else (host[6], dev[7])
        out_dtype = self.dtype if not levels else torch.float16  # a cascade's levels: see the module doc
        if layout.is_decode_only and not levels and self.triton_decodes(layout.batch_size):
            wrapper = self._triton_decode(kv_indptr_d, indices_d, last_d, layout.batch_size)
            self._step = _StepIndices(wrapper, batch_d, pos_d, indices_d, kv_indptr_d, last_d)
            self._staging.end()
            return
        if layout.is_decode_only:
            wrapper, args = self._decode, (attend_indptr_h, attend_indices_d, last_h)
            kwargs = self._plan_kwargs(out_dtype)
        else:
            wrapper, args = self._prefill, (qo_h, attend_indptr_h, attend_indices_d, last_h)
            kwargs = {**self._plan_kwargs(out_dtype), "causal": True}
        prefix_wrapper = merge = None
        if levels:
            # Every row over its group's shared pages, all computed before this step's tokens:
            # non-causal (`cascade.shareable_pages`).
            prefix_wrapper, merge = self._cascade_prefix_wrapper(), dev[12].to(torch.bool)
            self._plan_wrapper(prefix_wrapper, (host[8], host[9], dev[11], host[10]),
                               {**self._plan_kwargs(out_dtype), "causal": False})
        self._step = _StepIndices(wrapper, batch_d, pos_d, indices_d, kv_indptr_d, last_d, prefix_wrapper, merge)
        self._plan_wrapper(wrapper, args, kwargs)

    def triton_decodes(self, batch_size: int) -> bool:
        """Whether a decode-only step of `batch_size` requests (no cascade level) attends through
        `triton_decode` rather than FlashInfer's decode: with `fused_decode`, up to
        `TRITON_DECODE_MAX_BATCH`, on a GPU with Triton."""
        return (self.fused_decode and batch_size <= TRITON_DECODE_MAX_BATCH and self.device.type == "cuda"
                and triton_decode.available())

    def _triton_decode(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last: torch.Tensor,
                       batch_size: int) -> _TritonDecode:  # fmt: skip
        splits = triton_decode.max_splits(batch_size, self.num_kv_heads, self.device)
        return _TritonDecode(kv_indptr, kv_indices, last, self.sm_scale, splits)

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

    def _plan_wrapper(self, wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        wrapper.plan(*args, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, **kwargs)
        self._staging.end()

    def takes_rope(self, cos_sin: torch.Tensor, head_dim: int) -> bool:
        """Whether `forward` can be given q and k before RoPE, with the step's `Rope`: with
        `fused_decode` it rotates them in the kernel that appends K and V (`paged_append`), one
        launch instead of two."""
        return self.fused_decode and self.device.type == "cuda" and fuses_rope(cos_sin, head_dim)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D] in q's dtype. See `AttentionBackend`.
        `rope` (where `takes_rope`): q and k are not rotated yet; this rotates them (q in place)."""
        step = self._step
        if step is None:
            raise RuntimeError("plan() must run before forward()")
        out_dtype = q.dtype
        cache = self.kv_cache[layer]
        if not append_paged(q, k, v, step.batch_indices, step.positions, step.kv_indices, step.kv_indptr, cache, rope):
            if rope is not None:  # rows the kernel does not take (a model's qkv views always are)
                t, d = q.shape[0], q.shape[-1]
                q, k = apply_rope_torch(rope.positions, q.reshape(t, -1), k.reshape(t, -1), d, rope.cos_sin)
                q, k = q.view(t, -1, d), k.view(t, -1, d)
            # append_paged_kv_cache reinterprets its input as the cache dtype without checking it.
            k, v = to_cache(k, self.cache_dtype), to_cache(v, self.cache_dtype)
            self._fi.append_paged_kv_cache(
                k, v, step.batch_indices, step.positions, cache,
                step.kv_indices, step.kv_indptr, step.kv_last_page_len, kv_layout="NHD",
            )
        if q.dtype != self.dtype:
            q = q.to(self.dtype)
        if step.prefix_wrapper is None:
            out = step.wrapper.run(q, cache)
        else:
            out = self._cascade(step, q, cache)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def _cascade(self, step: _StepIndices, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Each request over its own pages, each group's rows over its prefix once, merged by
        their log-sum-exps (FlashInfer's, base 2, as `merge_state_in_place` takes them) where the
        row is in a group. No host work and no data-dependent shape: a graph can hold it."""
        out, lse = step.wrapper.run(q, cache, return_lse=True)
        prefix_out, prefix_lse = step.prefix_wrapper.run(q, cache, return_lse=True)
        self._fi.merge_state_in_place(out, lse, prefix_out, prefix_lse, mask=step.prefix_merge)
        return out.to(self.dtype)

    # ---- CUDA-graph decode -------------------------------------------------------------------

    def init_cuda_graph(
        self, batch_sizes: Sequence[int], max_total_pages: int | None = None, *, cascade: bool = False
    ) -> None:
        """Builds a graph-mode decode wrapper per batch size over shared static index buffers, and
        with `cascade` the wrappers of cascade decode graphs too.

        `max_total_pages` bounds the pages of one graph step (default: every page once, plus one
        scratch page per padding row); a step with more runs eagerly.
        """
        sizes = sorted(set(batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
        capacity = max_total_pages if max_total_pages is not None else self.num_pages + sizes[-1]
        self._graph = _GraphBuffers(self, sizes, capacity, cascade)

    def cuda_graph_batch_size(self, layout: BatchLayout) -> int | None:
        """The captured batch size this step pads to, or None when it must run eagerly.

        A cascade step pads to a cascade graph of that size (`plan_cuda_graph`)."""
        g = self._graph
        if g is None or not layout.is_decode_only:
            return None
        n, prefix = layout.batch_size, layout.prefix
        size = next((s for s in g.wrappers if s >= n), None)
        if size is None:
            return None
        own_pages = len(layout.kv_indices) if prefix is None else len(prefix.suffix_kv_indices)
        if own_pages + size - n > g.capacity:
            return None
        if prefix is not None:
            slots = prefix_slots(size)
            if (not g.cascade or prefix.num_row_segments(layout.num_tokens, size) > slots
                    or len(prefix.kv_indices) + slots > g.capacity):
                return None
        return size

    def plan_cuda_graph(self, layout: BatchLayout, batch_size: int, cascade: bool | None = None) -> None:
        """Plans the graph of `batch_size` (flat, or with `cascade`, by default when the layout has
        a prefix level, the cascade graph) for a decode step padded to that size.

        Padding rows are one-token requests at position 0 on the scratch page. Call before every
        replay (the kernels' split schedule depends on the current lengths) and before capture
        (with an empty layout: every row is padding).
        """
        g = self._graph
        cascade = layout.prefix is not None if cascade is None else cascade
        if g is None or batch_size not in g.wrappers or (cascade and not g.cascade):
            raise ValueError(f"no CUDA-graph decode wrapper for batch size {batch_size} (cascade: {cascade})")
        if not layout.is_decode_only or layout.batch_size > batch_size:
            raise ValueError(f"a decode step of at most {batch_size} requests is needed, got {layout.batch_size} requests")
        prefix = layout.prefix if cascade else None
        pad = batch_size - layout.batch_size
        kv_indptr = np.asarray(layout.kv_indptr if prefix is None else prefix.suffix_kv_indptr, dtype=np.int32)
        indices = np.asarray(layout.kv_indices if prefix is None else prefix.suffix_kv_indices, dtype=np.int32)
        positions = np.asarray(layout.positions, dtype=np.int32)
        if prefix is not None:  # appends go through each request's own pages: positions within them
            positions = positions - np.asarray(prefix.prefix_pages, dtype=np.int32) * self.page_size
        arrays = [
            np.concatenate([kv_indptr, kv_indptr[-1] + np.arange(1, pad + 1, dtype=np.int32)]),
            np.concatenate([np.asarray(layout.kv_last_page_len, dtype=np.int32), np.ones(pad, dtype=np.int32)]),
            np.concatenate([positions, np.zeros(pad, dtype=np.int32)]),
            np.concatenate([indices, np.full(pad, self.scratch_page, np.int32)]),
        ]
        segments = None
        if cascade:
            level = layout.prefix if layout.prefix is not None else _NO_GROUPS
            segments = level.row_segments(layout.num_tokens, self.scratch_page, batch_size, prefix_slots(batch_size))
            if segments is None:
                raise ValueError(f"the step needs more level-0 segments than the {batch_size}-row graph's")
            arrays += [segments.qo_indptr, segments.kv_indptr, segments.kv_last_page_len, segments.kv_indices,
                       np.frombuffer(segments.merge, dtype=np.uint8)]
        self._staging.begin()
        host, dev = self._staging.upload(arrays)
        indptr_h, last_h = host[:2]
        pos_d, indices_d = dev[2:4]
        g.positions[:batch_size].copy_(pos_d, non_blocking=True)
        # The wrappers copy indptr, indices and last_page_len into the static buffers they were built
        # on; the Triton decode reads them there, so they are copied here.
        self._step = step = g.steps[batch_size, cascade]
        if isinstance(step.wrapper, _TritonDecode):
            g.kv_indptr[: batch_size + 1].copy_(dev[0], non_blocking=True)
            g.last_page_len[:batch_size].copy_(dev[1], non_blocking=True)
            g.kv_indices[: len(arrays[3])].copy_(indices_d, non_blocking=True)
            self._staging.end()
            return
        if segments is not None:
            g.prefix_merge[:batch_size].copy_(dev[8], non_blocking=True)
            self._plan_wrapper(step.prefix_wrapper, (host[4], host[5], dev[7], host[6]),
                               {**self._plan_kwargs(torch.float16), "causal": False})
        self._plan_wrapper(step.wrapper, (indptr_h, indices_d, last_h),
                           self._plan_kwargs(torch.float16 if cascade else None))


_NO_GROUPS = PrefixLevel([], [], [], [0], [0], [], [], [], [0], [])  # a cascade graph's capture step


class _GraphBuffers:
    """Static index buffers and the graph-mode wrappers of every captured batch size: one decode
    wrapper per size, and with `cascade` a decode wrapper over each request's own pages and a
    prefill wrapper over the level-0 segments per size.

    The buffers' addresses are baked into the captured kernels; only their contents change.
    """

    def __init__(self, backend: FlashInferAttentionBackend, sizes: list[int], capacity: int, cascade: bool) -> None:
        fi, dev, max_bs = backend._fi, backend.device, sizes[-1]
        self.capacity = capacity
        self.cascade = cascade
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.batch_indices = torch.arange(max_bs, dtype=torch.int32, device=dev)
        self.kv_indices = torch.full((capacity,), backend.scratch_page, dtype=torch.int32, device=dev)
        max_slots = prefix_slots(max_bs)
        self.prefix_merge = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        self.prefix_qo_indptr = torch.zeros(max_slots + 1, dtype=torch.int32, device=dev)
        self.prefix_kv_indptr = torch.zeros(max_slots + 1, dtype=torch.int32, device=dev)
        self.prefix_last_page_len = torch.ones(max_slots, dtype=torch.int32, device=dev)
        self.prefix_kv_indices = torch.full((capacity,), backend.scratch_page, dtype=torch.int32, device=dev) \
            if cascade else self.kv_indices
        self.wrappers: dict[int, Any] = {}
        self.steps: dict[tuple[int, bool], _StepIndices] = {}
        # Graphs never run concurrently and each replay is preceded by its own plans, so wrappers
        # of one role share one int workspace and its pinned twin (8 MB each per wrapper
        # otherwise); the staging event orders every plan's pinned writes. A cascade step's two
        # passes are planned together, so decode and prefix wrappers keep separate ones.
        shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def share(role: str, w: Any) -> Any:
            if role in shared:
                w._int_workspace_buffer, w._pin_memory_int_workspace_buffer = shared[role]
            else:
                shared[role] = (w._int_workspace_buffer, w._pin_memory_int_workspace_buffer)
            return w

        def decode(bs: int) -> Any:
            return share("decode", fi.BatchDecodeWithPagedKVCacheWrapper(
                backend._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend="fa2",
                paged_kv_indptr_buffer=self.kv_indptr[: bs + 1],
                paged_kv_indices_buffer=self.kv_indices,
                paged_kv_last_page_len_buffer=self.last_page_len[:bs],
            ))

        for bs in sizes:
            small = backend.triton_decodes(bs)
            self.wrappers[bs] = w = backend._triton_decode(
                self.kv_indptr[: bs + 1], self.kv_indices, self.last_page_len[:bs], bs) if small else decode(bs)
            indices = (self.batch_indices[:bs], self.positions[:bs], self.kv_indices,
                       self.kv_indptr[: bs + 1], self.last_page_len[:bs])
            self.steps[bs, False] = _StepIndices(w, *indices)
            if cascade:
                slots = prefix_slots(bs)
                prefix = share("prefix", fi.BatchPrefillWithPagedKVCacheWrapper(
                    backend._workspace, "NHD", use_cuda_graph=True, backend="fa2",
                    qo_indptr_buf=self.prefix_qo_indptr[: slots + 1],
                    paged_kv_indptr_buf=self.prefix_kv_indptr[: slots + 1],
                    paged_kv_indices_buf=self.prefix_kv_indices,
                    paged_kv_last_page_len_buf=self.prefix_last_page_len[:slots],
                ))
                self.steps[bs, True] = _StepIndices(decode(bs), *indices, prefix, self.prefix_merge[:bs])
