"""CUDA graphs for uniform verify steps of speculative decoding: one graph per batch size at the
speculative config's k, replayed by the runner.

A uniform verify step is a step in which every request is a decoding request carrying exactly k
draft tokens (k + 1 query tokens each, the logits of all of them sampled), with no prompt logprobs
and no cascade prefix level (`is_uniform_verify_step`). Such a step of B requests replays the graph
of the smallest captured size >= B, padded with (k + 1)-token requests on the scratch page
(`attention/flashinfer_verify.py`); the graph computes the logits of every token, which in a
uniform verify step are exactly the logits the eager forward computes. Everything else runs
eagerly: steps with prefill chunks or plain decode rows, rows with fewer drafts (an n-gram lookup
that found fewer than k, a request near its max_tokens), prompt logprobs, cascade steps, batches
above the largest graph, and models with LoRA adapters (`capture_verify_graphs` captures none).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashserve.attention.base import BatchLayout
from flashserve.attention.flashinfer import FlashInferAttentionBackend
from flashserve.worker.cuda_graph import (MAX_GRAPH_BATCH, ForwardFn, capture_batch_sizes, check_no_host_sync,
                                         collector_paused)
from flashserve.worker.input_batch import BatchRow

# The largest verify batch captured when the speculative config sets no `disable_by_batch_size`:
# speculation pays at low concurrency, and each graph holds a whole forward.
MAX_VERIFY_GRAPH_BATCH = 64


def verify_capture_sizes(max_batch_size: int, num_draft_tokens: int, disable_by_batch_size: int | None) -> list[int]:
    """The batch sizes to capture verify graphs for: `capture_batch_sizes` up to the largest
    batch that speculates (`disable_by_batch_size`, else `MAX_VERIFY_GRAPH_BATCH`), at most
    `max_batch_size`, and at most `MAX_GRAPH_BATCH` tokens a step (k + 1 a request)."""
    limit = disable_by_batch_size if disable_by_batch_size is not None else MAX_VERIFY_GRAPH_BATCH
    limit = min(limit, max_batch_size, MAX_GRAPH_BATCH // (num_draft_tokens + 1))
    return capture_batch_sizes(limit) if limit >= 1 else []


def is_uniform_verify_step(rows: Sequence[BatchRow], num_draft_tokens: int, prompt_rows: Sequence[int] = ()) -> bool:
    """Whether a verify graph of k = `num_draft_tokens` can run the step: every row samples and is
    a decoding row of its last token and exactly k drafts, and no prompt logprobs are asked.
    (The layout must also have no cascade prefix level: `VerifyGraphRunner` checks it.)"""
    if not rows or prompt_rows:
        return False
    q = num_draft_tokens + 1
    return all(r.sample and r.num_draft_tokens == num_draft_tokens and r.num_new_tokens == q for r in rows)


class VerifyGraphRunner:
    """Replays a uniform verify step's forward from its captured graph (as `CudaGraphRunner` does
    decode steps). A replayed step returns a view of a static buffer that the next call
    overwrites: consume it (verify) first.

    `forward`: `(input_ids [T], positions [T]) -> logits [T, V]` of every token (the model's
    `decode_logits`), attending through `backend` and never synchronising with the host.
    """

    def __init__(self, forward: ForwardFn, backend: FlashInferAttentionBackend, batch_sizes: Sequence[int],
                 num_draft_tokens: int, *, max_total_pages: int | None = None) -> None:  # fmt: skip
        if not batch_sizes:
            raise ValueError("at least one batch size to capture is needed")
        self.forward = forward
        self.backend = backend
        self.batch_sizes = sorted(set(batch_sizes))
        self.num_draft_tokens = num_draft_tokens
        self._max_total_pages = max_total_pages
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._input_ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def release(self) -> None:
        """Frees the captured graphs (later verify steps run eagerly); see `CudaGraphRunner.release`."""
        torch.cuda.synchronize()
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()

    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Captures one graph per batch size, largest first, in `pool` (the decode graphs', so that
        the two sets share their scratch memory: they never run at once) or a pool of their own.
        Raises NotCapturableError, before capturing anything, when the forward synchronises with
        the host."""
        backend, device, q = self.backend, self.backend.device, self.num_draft_tokens + 1
        backend.init_verify_graphs(self.batch_sizes, self.num_draft_tokens, self._max_total_pages)
        max_tokens = self.batch_sizes[-1] * q
        # Padding requests keep whatever ids/positions an earlier step left: any valid value will do.
        self._input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        empty = BatchLayout(backend.page_size, [0], [0], [], [], [])
        checked = False
        with torch.inference_mode(), collector_paused():
            for bs in reversed(self.batch_sizes):
                ids, pos = self._input_ids[: bs * q], self._positions[: bs * q]
                backend.plan_verify_graph(empty, bs)
                side = torch.cuda.Stream(device)  # eager warm-up off the capture, as in CudaGraphRunner
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    out = self.forward(ids, pos)
                    if not checked:
                        check_no_host_sync(self.forward, ids, pos)
                        checked = True
                torch.cuda.current_stream(device).wait_stream(side)
                if self._out is None:
                    self._out = torch.empty((max_tokens, *out.shape[1:]), dtype=out.dtype, device=device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._out[: bs * q].copy_(self.forward(ids, pos))
                pool = graph.pool()
                self._graphs[bs] = graph
        torch.cuda.synchronize(device)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor | None:
        """The logits of every token of the verify step `layout` describes (input_ids/positions
        [T]), replayed from a graph; None when no graph takes the step (the caller runs it eagerly)."""
        size = self.backend.verify_graph_batch_size(layout) if self._graphs else None
        graph = self._graphs.get(size) if size is not None else None
        if graph is None:
            return None
        assert self._input_ids is not None and self._positions is not None and self._out is not None
        n = layout.num_tokens
        self._input_ids[:n].copy_(input_ids, non_blocking=True)
        self._positions[:n].copy_(positions, non_blocking=True)
        self.backend.plan_verify_graph(layout, size)  # type: ignore[arg-type]
        graph.replay()
        return self._out[:n]
