"""The FlashInfer backend's CUDA-graph decode (`CudaGraphDecode`, which `FlashInferAttentionBackend`
takes its graph methods from) and what a planned step holds on the device: the static index
buffers and graph-mode wrappers of every captured batch size (`GraphBuffers`), a step's index
views (`StepIndices`) and the Triton decode that stands in for a wrapper (`TritonDecode`).

`init_cuda_graph` builds one graph-mode decode wrapper per batch size over static index buffers,
and with `cascade` a second set for cascade decode steps: a decode wrapper over each request's own
pages and a graph-mode prefill wrapper over a fixed number of level-0 segments (`prefix_slots`).
`plan_cuda_graph` pads a batch to such a size with dummy one-token requests on the scratch page
and re-plans before each replay. `worker/cuda_graph.py` drives it. No flashinfer import here: the
wrappers come from the backend's module handle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashserve.attention import triton_decode
from flashserve.attention.base import BatchLayout
from flashserve.attention.cascade import PrefixLevel


@dataclass(frozen=True)
class TritonDecode:
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
class StepIndices:
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
    # Fresh prompts attended apart (`RAGGED_MIN_TOKENS`): `ragged` attends the step's tokens from
    # `ragged_from` on over their own k and v; `wrapper` (None when no row comes before them) the
    # rows before over their pages.
    ragged: Any = None
    ragged_from: int = 0
    # Continued prompts among the rows apart (`CONTINUED_MIN_TOKENS`), tokens [ragged_from,
    # continued_to): `continued` attends them to their cached tokens, merged into the ragged pass's.
    continued: Any = None
    continued_to: int = 0


def prefix_slots(batch_size: int) -> int:
    """Level-0 segments a cascade decode graph of `batch_size` rows is planned for: enough for
    groups of four with an ungrouped run between each two, and few enough that the prefix pass's
    query tile stays large (FlashInfer sizes a graph plan's tile for its longest possible segment,
    rows - segments + 1). A step that needs more segments runs eagerly."""
    return min(batch_size, max(4, batch_size // 4))


class CudaGraphDecode:
    """The graph methods of `FlashInferAttentionBackend` (its `_graph`, `_staging`, `_step`,
    `_plan_wrapper` and `_plan_kwargs`, `page_size` and `scratch_page`)."""

    _graph: GraphBuffers | None
    _staging: Any
    _step: StepIndices | None
    page_size: int
    scratch_page: int

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
        self._graph = GraphBuffers(self, sizes, capacity, cascade)

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
            level = layout.prefix if layout.prefix is not None else NO_GROUPS
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
        if isinstance(step.wrapper, TritonDecode):
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


NO_GROUPS = PrefixLevel([], [], [], [0], [0], [], [], [], [0], [])  # a cascade graph's capture step


class GraphBuffers:
    """Static index buffers and the graph-mode wrappers of every captured batch size: one decode
    wrapper per size, and with `cascade` a decode wrapper over each request's own pages and a
    prefill wrapper over the level-0 segments per size.

    The buffers' addresses are baked into the captured kernels; only their contents change.
    """

    def __init__(self, backend: Any, sizes: list[int], capacity: int, cascade: bool) -> None:
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
        self.steps: dict[tuple[int, bool], StepIndices] = {}
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
            self.steps[bs, False] = StepIndices(w, *indices)
            if cascade:
                slots = prefix_slots(bs)
                prefix = share("prefix", fi.BatchPrefillWithPagedKVCacheWrapper(
                    backend._workspace, "NHD", use_cuda_graph=True, backend="fa2",
                    qo_indptr_buf=self.prefix_qo_indptr[: slots + 1],
                    paged_kv_indptr_buf=self.prefix_kv_indptr[: slots + 1],
                    paged_kv_indices_buf=self.prefix_kv_indices,
                    paged_kv_last_page_len_buf=self.prefix_last_page_len[:slots],
                ))
                self.steps[bs, True] = StepIndices(decode(bs), *indices, prefix, self.prefix_merge[:bs])
