"""The FlashInfer backend's CUDA-graph verify steps of speculative decoding (`CudaGraphVerify`, which
`FlashInferAttentionBackend` takes its verify-graph methods from), beside the decode graphs of
`flashinfer_graphs.py`.

A uniform verify step has every request carry its last token and exactly k draft tokens: k + 1
query rows a request, causal over its pages. Per captured batch size B, `init_verify_graphs` builds
a graph-mode `BatchPrefillWithPagedKVCacheWrapper` over static index buffers, planned for
B * (k + 1) query rows (FlashInfer fixes a graph wrapper's rows at its first plan) with
`uniform_q_len = k + 1`, so that its query tile is sized for k + 1 rows per request rather than for
the ragged worst case. `plan_verify_graph` pads a step to B requests with (k + 1)-token requests on
the scratch page (`padded_verify_arrays`) and re-plans before each replay.
`worker/verify_graph.py` drives it. No flashinfer import here: the wrappers come from the
backend's module handle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashserve.attention.base import BatchLayout, last_page_len
from flashserve.attention.flashinfer_graphs import StepIndices


def padding_pages(num_query_tokens: int, page_size: int) -> int:
    """Scratch-page entries of one padding request of `num_query_tokens` tokens: as many pages as
    the tokens fill (at page size 16: one, two when k = 16), each the scratch page again."""
    return -(-num_query_tokens // page_size)


def is_uniform_verify_layout(layout: BatchLayout, num_query_tokens: int) -> bool:
    """Every request of the step has exactly `num_query_tokens` new tokens, and no prefix level."""
    n, q = layout.batch_size, num_query_tokens
    return layout.prefix is None and layout.qo_indptr == list(range(0, n * q + 1, q))


@dataclass(frozen=True)
class VerifyPlanArrays:
    """A verify step padded to a graph's batch size, in FlashInfer's vocabulary (int32)."""

    qo_indptr: np.ndarray  # [B + 1]: k + 1 rows a request
    kv_indptr: np.ndarray  # [B + 1]
    kv_last_page_len: np.ndarray  # [B]
    kv_indices: np.ndarray  # the step's pages, then the padding requests' scratch entries
    positions: np.ndarray  # [B * (k + 1)]: where each token is appended in its request


def padded_verify_arrays(layout: BatchLayout, batch_size: int, num_query_tokens: int,
                         scratch_page: int) -> VerifyPlanArrays:  # fmt: skip
    """`layout` (a uniform verify step of at most `batch_size` requests, `num_query_tokens` = k + 1
    tokens each) padded to `batch_size` requests: each padding request holds k + 1 tokens at
    positions 0..k on the scratch page (`padding_pages` entries of it), so that every request of
    the graph's plan has k + 1 query rows."""
    q, n = num_query_tokens, layout.batch_size
    if not is_uniform_verify_layout(layout, q):
        raise ValueError(f"a verify step of {q} tokens a request (and no prefix level) is needed")
    if n > batch_size:
        raise ValueError(f"a verify step of at most {batch_size} requests is needed, got {n}")
    pad, per = batch_size - n, padding_pages(q, layout.page_size)
    kv_indptr = np.asarray(layout.kv_indptr, dtype=np.int32)
    return VerifyPlanArrays(
        np.arange(0, batch_size * q + 1, q, dtype=np.int32),
        np.concatenate([kv_indptr, kv_indptr[-1] + per * np.arange(1, pad + 1, dtype=np.int32)]),
        np.concatenate([np.asarray(layout.kv_last_page_len, dtype=np.int32),
                        np.full(pad, last_page_len(q, layout.page_size), dtype=np.int32)]),
        np.concatenate([np.asarray(layout.kv_indices, dtype=np.int32), np.full(pad * per, scratch_page, np.int32)]),
        np.concatenate([np.asarray(layout.positions, dtype=np.int32), np.tile(np.arange(q, dtype=np.int32), pad)]),
    )


class CudaGraphVerify:
    """The verify-graph methods of `FlashInferAttentionBackend` (its `_verify`, `_staging`,
    `_step`, `_plan_wrapper` and `_plan_kwargs`, `page_size`, `num_pages` and `scratch_page`)."""

    _verify: VerifyGraphBuffers | None
    _staging: Any
    _step: StepIndices | None
    page_size: int
    num_pages: int
    scratch_page: int

    def init_verify_graphs(self, batch_sizes: Sequence[int], num_draft_tokens: int,
                           max_total_pages: int | None = None) -> None:  # fmt: skip
        """Builds a graph-mode prefill wrapper per batch size for verify steps of `num_draft_tokens`
        drafts a request, over shared static index buffers. `max_total_pages` bounds the pages of
        one graph step (default: every page once, plus the padding requests' scratch entries); a
        step with more runs eagerly."""
        sizes = sorted(set(batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes)}")
        if num_draft_tokens < 1:
            raise ValueError(f"verify graphs need at least one draft token, got {num_draft_tokens}")
        q = num_draft_tokens + 1
        capacity = max_total_pages if max_total_pages is not None else \
            self.num_pages + sizes[-1] * padding_pages(q, self.page_size)
        self._verify = VerifyGraphBuffers(self, sizes, q, capacity)

    def verify_graph_batch_size(self, layout: BatchLayout) -> int | None:
        """The captured batch size this verify step pads to, or None when it must run eagerly (not
        a uniform verify step of the captured k, more requests than the largest graph, or more
        pages than its index buffer holds)."""
        v = self._verify
        if v is None or not is_uniform_verify_layout(layout, v.num_query_tokens):
            return None
        n = layout.batch_size
        size = next((s for s in v.wrappers if s >= n), None)
        if size is None:
            return None
        if len(layout.kv_indices) + (size - n) * padding_pages(v.num_query_tokens, self.page_size) > v.capacity:
            return None
        return size

    def plan_verify_graph(self, layout: BatchLayout, batch_size: int) -> None:
        """Plans the verify graph of `batch_size` for `layout` padded to that size. Call before
        every replay (the split schedule depends on the current lengths) and before capture (with
        an empty layout: every request is padding)."""
        v = self._verify
        if v is None or batch_size not in v.wrappers:
            raise ValueError(f"no CUDA-graph verify wrapper for batch size {batch_size}")
        a = padded_verify_arrays(layout, batch_size, v.num_query_tokens, self.scratch_page)
        if len(a.kv_indices) > v.capacity:
            raise ValueError(f"the step's {len(a.kv_indices)} pages exceed the verify graphs' {v.capacity}")
        self._staging.begin()
        host, dev = self._staging.upload([a.qo_indptr, a.kv_indptr, a.kv_last_page_len, a.kv_indices, a.positions])
        v.positions[: len(a.positions)].copy_(dev[4], non_blocking=True)
        self._step = step = v.steps[batch_size]
        kwargs = {**self._plan_kwargs(), "causal": True, "uniform_q_len": v.num_query_tokens}
        self._plan_wrapper(step.wrapper, (host[0], host[1], dev[3], host[2]), kwargs)


class VerifyGraphBuffers:
    """Static index buffers and one graph-mode prefill wrapper per captured batch size, for verify
    steps of `num_query_tokens` (k + 1) tokens a request. The buffers' addresses are baked into
    the captured kernels; only their contents change."""

    def __init__(self, backend: Any, sizes: list[int], num_query_tokens: int, capacity: int) -> None:
        fi, dev, max_bs, q = backend._fi, backend.device, sizes[-1], num_query_tokens
        self.num_query_tokens = q
        self.capacity = capacity
        self.qo_indptr = torch.arange(0, (max_bs + 1) * q, q, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(max_bs * q, dtype=torch.int32, device=dev)
        # Token t belongs to request t // (k + 1) in every verify step.
        self.batch_indices = torch.arange(max_bs, dtype=torch.int32, device=dev).repeat_interleave(q)
        self.kv_indices = torch.full((capacity,), backend.scratch_page, dtype=torch.int32, device=dev)
        self.wrappers: dict[int, Any] = {}
        self.steps: dict[int, StepIndices] = {}
        shared: tuple[torch.Tensor, torch.Tensor] | None = None  # one int workspace (and its pinned twin) for all
        for bs in sizes:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(
                backend._workspace, "NHD", use_cuda_graph=True, backend="fa2",
                qo_indptr_buf=self.qo_indptr[: bs + 1],
                paged_kv_indptr_buf=self.kv_indptr[: bs + 1],
                paged_kv_indices_buf=self.kv_indices,
                paged_kv_last_page_len_buf=self.last_page_len[:bs],
            )  # fmt: skip
            # Graphs never run concurrently and each replay follows its own plan (GraphBuffers).
            if shared is None:
                shared = (w._int_workspace_buffer, w._pin_memory_int_workspace_buffer)
            else:
                w._int_workspace_buffer, w._pin_memory_int_workspace_buffer = shared
            self.wrappers[bs] = w
            self.steps[bs] = StepIndices(w, self.batch_indices[: bs * q], self.positions[: bs * q], self.kv_indices,
                                         self.kv_indptr[: bs + 1], self.last_page_len[:bs])
