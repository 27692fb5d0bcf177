"""CUDA graphs for decode steps: capture the model forward once per batch size, replay it.

A decode step of B requests replays the graph of the smallest captured size >= B, with the batch
padded by dummy one-token requests on the attention backend's scratch page. With `cascade`, every
size is captured a second time with cascade attention, which decode steps with a prefix level
replay. Prefill steps, and batches above the largest size, run eagerly. The model forward is any
callable `(input_ids [T], positions [T]) -> Tensor [T, ...]` that attends through the backend and
does not synchronise with the host (no `.item()`, no data-dependent shapes).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence

import torch

from flashserve.attention.base import BatchLayout
from flashserve.attention.flashinfer import FlashInferAttentionBackend

ForwardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NotCapturableError(RuntimeError):
    """The forward synchronises with the host, which a CUDA graph cannot hold. Raised before any
    capture begins, so the process stays fit to run the forward eagerly."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collected first, then the collector kept off while graphs are
    captured, and back on after (if it was on). An object the collector frees runs its destructor
    on the thread that happens to allocate: a CUDA graph held by a dead reference cycle (a runner
    dropped before the next one is built) resets itself, a call a capture does not permit, and the
    capture is invalidated (its next launch fails). torch.cuda.graph no longer collects before a
    capture (torch.compiler.config.force_cudagraph_gc), so such cycles live until the collector
    runs, which may be in the middle of a capture. SGLang pauses the collector during capture too."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# The largest decode batch captured (vLLM's default too): a larger decode step runs eagerly, where
# launching kernels costs little beside the step's own time, and the start does not capture a
# graph for every 8 requests up to 1,024.
MAX_GRAPH_BATCH = 512


def capture_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch_size` (itself included), at most
    `MAX_GRAPH_BATCH`."""
    max_batch_size = min(max_batch_size, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += range(16, max_batch_size + 1, 8)
    if max_batch_size >= 1 and sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def check_no_host_sync(forward: ForwardFn, ids: torch.Tensor, pos: torch.Tensor) -> None:
    """Runs `forward` once with host syncs made errors: NotCapturableError if it synchronises."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward(ids, pos)
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):
            raise
        raise NotCapturableError(f"the forward synchronises with the host: {exc}") from exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class CudaGraphRunner:
    """Runs a step's forward from a captured graph when it can, eagerly otherwise.

    `__call__` also plans the backend, so a caller replaces `backend.plan(layout); forward(ids,
    pos)` with `graph_runner(ids, pos, layout)`. A replayed step returns a view of a static buffer
    that the next call overwrites: consume it (sample) first.

    `plain_forward`: a second forward captured beside `forward` at every size, replayed for the
    steps `__call__` is told are plain: a model with LoRA adapters captures its forward without
    them there, so that decode steps of base-model rows alone skip the adapters' GEMMs.
    """

    def __init__(
        self,
        forward: ForwardFn,
        backend: FlashInferAttentionBackend,
        batch_sizes: Sequence[int],
        *,
        max_total_pages: int | None = None,
        cascade: bool = False,
        plain_forward: ForwardFn | None = None,
    ) -> None:
        if not batch_sizes:
            raise ValueError("at least one batch size to capture is needed")
        self.forward = forward
        self.plain_forward = plain_forward
        self.backend = backend
        self.batch_sizes = sorted(set(batch_sizes))
        self.cascade = cascade
        self._max_total_pages = max_total_pages
        self._graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}  # by (batch size, cascade, plain)
        self._input_ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self.pool: tuple[int, int] | None = None  # the graphs' memory pool, once captured (verify graphs share it)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def release(self) -> None:
        """Frees the captured graphs (later steps run eagerly). A graph with NCCL collectives
        inside holds its communicator: destroying the process group before the graph waits
        forever in ncclCommDestroy, so tensor-parallel ranks release their graphs first."""
        torch.cuda.synchronize()
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def capture(self) -> None:
        """Captures one graph per batch size (two with cascade), largest first, all in one memory pool.

        Run it after any warm-up that builds kernels. Raises NotCapturableError, before capturing
        anything, when the forward synchronises with the host (a failed capture would leave CUDA
        state, the RNG's among it, unfit for eager work).
        """
        backend, device = self.backend, self.backend.device
        backend.init_cuda_graph(self.batch_sizes, self._max_total_pages, cascade=self.cascade)
        max_bs = self.batch_sizes[-1]
        # Padding rows keep whatever ids/positions an earlier step left: any valid value will do.
        self._input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        empty = BatchLayout(backend.page_size, [0], [0], [], [], [])
        pool = None
        # Inference mode as the steps run (compiled pieces guard on it); see collector_paused.
        with torch.inference_mode(), collector_paused():
            variants = (False, True)[: 1 + (self.plain_forward is not None)]
            for bs, cascade, plain in ((bs, c, p) for bs in reversed(self.batch_sizes)
                                       for c in (False, True)[: 1 + self.cascade] for p in variants):  # fmt: skip
                forward = self.plain_forward if plain and self.plain_forward is not None else self.forward
                ids, pos = self._input_ids[:bs], self._positions[:bs]
                backend.plan_cuda_graph(empty, bs, cascade)
                # Eager warm-up on a side stream, as torch.cuda.graphs asks: lazy initialisation
                # (kernel builds, library handles, allocator) must not happen under capture.
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    out = forward(ids, pos)
                    if pool is None:
                        check_no_host_sync(forward, ids, pos)
                torch.cuda.current_stream(device).wait_stream(side)
                if self._out is None:
                    # One output buffer for every size: a graph per size would hold its own.
                    self._out = torch.empty((max_bs, *out.shape[1:]), dtype=out.dtype, device=device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._out[:bs].copy_(forward(ids, pos))
                pool = graph.pool()
                self._graphs[bs, cascade, plain] = graph
        self.pool = pool
        torch.cuda.synchronize(device)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout,
                 plain: bool = False) -> torch.Tensor:  # fmt: skip
        """input_ids/positions [T] (any device) of the step `layout` describes -> forward's output.
        `plain`: the step may replay `plain_forward`'s graph (when there is one)."""
        size = self.backend.cuda_graph_batch_size(layout) if self._graphs else None
        plain = plain and self.plain_forward is not None
        graph = self._graphs.get((size, layout.prefix is not None, plain)) if size is not None else None
        if graph is None:
            self.backend.plan(layout)
            return (self.plain_forward if plain and self.plain_forward is not None else self.forward)(input_ids, positions)
        assert self._input_ids is not None and self._positions is not None and self._out is not None
        n = layout.batch_size
        self._input_ids[:n].copy_(input_ids, non_blocking=True)
        self._positions[:n].copy_(positions, non_blocking=True)
        self.backend.plan_cuda_graph(layout, size, layout.prefix is not None)
        graph.replay()
        return self._out[:n]
