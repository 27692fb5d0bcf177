"""Piecewise CUDA graphs for steps of prompt tokens: the model's pieces between attention calls
replayed from graphs, attention run eagerly between them.

A decode step replays one graph of the whole forward (`cuda_graph.py`), but a step with prompt
tokens (a short prompt, a prefill chunk beside decode rows, a verify step of uneven drafts) has an
attention layout of its own every time, so it ran eagerly, and a step of few tokens is then bound
by the host: on an H200 an eager 128-token step of the 8B took 10.8 ms in bfloat16 (3x its weight
read) and 20.7 ms with FP8 projections, whose GEMMs cost cuBLASLt's set-up on every call
(`benchmark/results/NVIDIA_H200/prefill_8b/`). Here the model runs as the generator of its layer
steps (`LlamaModel.layer_steps`: everything from one attention call to the next is a piece),
and each piece is captured once per token count in `capture_token_counts`, in one memory pool. A
step of T tokens replays the pieces of the smallest count >= T with its tokens padded (padding
rows compute rows nobody reads: every piece is row-wise); between two pieces the backend, planned
for the step as an eager step plans it, appends the step's K/V and attends for its T rows,
writing into a fixed buffer that the next piece reads. Any layout (prefixes, cascade groups,
decode rows beside prompt rows) replays the same pieces.

Memory: a piece's outputs that outlive it (the q, k, v that attention reads, the hidden states)
are kept as aliases that do not own their memory (`weak_alias`, as vLLM's piecewise graphs keep
theirs), so the pool reuses it in later pieces and token counts: at replay a piece's outputs are
read before the next piece runs, and only one token count replays a step. The pool holds about
the working set of the largest piece, not every piece's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generator

import numpy as np
import torch

from flashserve.worker.cuda_graph import check_no_host_sync, collector_paused

Tensor = torch.Tensor
# A model's layer steps: yields (layer, q, k, v), is sent that layer's attention output, returns the hidden states.
LayerSteps = Generator[tuple[int, Tensor, Tensor, Tensor], Tensor, Tensor]
Attention = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def capture_token_counts(max_tokens: int) -> list[int]:
    """16, 32, 64, 96, 128, then every 64 up to 256 and every 128 beyond, up to `max_tokens`
    (itself included): steps are padded by at most about a third where GEMMs start to count."""
    counts = [c for c in (16, 32, 64, 96, 128) if c <= max_tokens]
    counts += [c for c in range(192, 257, 64) if c <= max_tokens]
    counts += range(384, max_tokens + 1, 128)
    if max_tokens >= 1 and (not counts or counts[-1] != max_tokens):
        counts.append(max_tokens)
    return counts


# Integer dtypes of each element size: the CUDA array interface has no bfloat16 or float8.
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weak_alias(t: Tensor) -> Tensor:
    """A tensor over `t`'s memory (same shape, strides and dtype) that does not keep it allocated:
    once `t` is freed, its memory may hold other tensors. For a graph's outputs, valid from one
    replay of the graph until the memory's next writer runs. (Through the array interfaces, which
    hand over an address and no owner; integers of the element's size, then viewed as its dtype.)"""
    same_size = _SAME_SIZE[t.element_size()]
    interface = {"shape": tuple(t.shape), "strides": tuple(s * t.element_size() for s in t.stride()),
                 "typestr": torch.empty((), dtype=same_size).numpy().dtype.str, "data": (t.data_ptr(), False),
                 "version": 2 if t.is_cuda else 3}
    if t.is_cuda:
        holder = type("DeviceArray", (), {"__cuda_array_interface__": interface})()
        alias = torch.as_tensor(holder, device=t.device)
    else:
        holder = type("HostArray", (), {"__array_interface__": interface})()
        alias = torch.from_numpy(np.asarray(holder))
    return alias.view(t.dtype)


def run_layer_steps(steps: LayerSteps, attention: Attention) -> Tensor:
    """Drives a model's layer steps to their end, each layer's attention by `attention`: the hidden states."""
    item = next(steps)
    while True:
        try:
            item = steps.send(attention(*item))
        except StopIteration as done:
            return done.value


@dataclass
class LayerPieces:
    """What the piecewise graphs need of a model (`NativeCausalLM.layer_pieces`).

    steps: `(input_ids, positions) -> LayerSteps`, the forward as pieces between attention calls.
    attention: `(positions, out) -> Attention`, the planned step's attention, each layer's written
        into `out` ([T, Hq, D], T the step's tokens).
    logits: `(hidden, logits_indices) -> float32 logits`, as the model's forward returns them.
    heads, head_dim: the shape of one token's attention output on this rank; dtype: its dtype.
    """

    steps: Callable[[Tensor, Tensor], LayerSteps]
    attention: Callable[[Tensor, Tensor], Attention]
    logits: Callable[[Tensor, Tensor | None], Tensor]
    heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass
class _Captured:
    graphs: list[torch.cuda.CUDAGraph]  # one a piece: num_layers + 1
    qkv: list[tuple[Tensor, Tensor, Tensor]]  # each layer's q, k, v as its piece writes them
    hidden: Tensor  # the last piece's output


class PiecewiseGraphRunner:
    """Runs steps of up to `max_tokens` tokens from the pieces' graphs (`covers`, `__call__`)."""

    def __init__(self, pieces: LayerPieces, device: torch.device, token_counts: Sequence[int]) -> None:
        if not token_counts:
            raise ValueError("at least one token count to capture is needed")
        self.pieces = pieces
        self.device = device
        self.token_counts = sorted(set(token_counts))
        self._captured: dict[int, _Captured] = {}
        self._input_ids: Tensor | None = None
        self._positions: Tensor | None = None
        self._attn: Tensor | None = None  # each layer's attention output, the next piece's input

    @property
    def max_tokens(self) -> int:
        return self.token_counts[-1]

    def covers(self, num_tokens: int) -> bool:
        return bool(self._captured) and 0 < num_tokens <= self.max_tokens

    def capture(self, pool: tuple[int, int] | None = None) -> None:
        """Captures every piece at every token count, largest first, in one memory pool (`pool`: one
        to share, the decode graphs'). Run it after the warm-up. Raises NotCapturableError before
        capturing anything when a piece synchronises with the host."""
        device, p = self.device, self.pieces
        top = self.max_tokens
        # Padding rows keep whatever ids/positions an earlier step left: any valid value will do.
        self._input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self._positions = torch.zeros(top, dtype=torch.long, device=device)
        self._attn = torch.zeros(top, p.heads, p.head_dim, dtype=p.dtype, device=device)
        stream = torch.cuda.Stream(device)
        with torch.inference_mode(), collector_paused():
            for n in reversed(self.token_counts):
                ids, pos, attn = self._input_ids[:n], self._positions[:n], self._attn[:n]
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    # Eager warm-up of the pieces alone (attention's output: the buffer as it is), as
                    # torch.cuda.graphs asks: lazy initialisation must not happen under capture.
                    def pieces_alone(ids: Tensor, pos: Tensor) -> Tensor:
                        return run_layer_steps(p.steps(ids, pos), lambda *_: attn)

                    pieces_alone(ids, pos)
                    if not self._captured:
                        check_no_host_sync(pieces_alone, ids, pos)
                    self._captured[n] = self._capture_pieces(p.steps(ids, pos), attn, pool)
                    pool = self._captured[n].graphs[0].pool()
                torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

    @staticmethod
    def _capture_pieces(steps: LayerSteps, attn: Tensor, pool: tuple[int, int] | None) -> _Captured:
        graphs: list[torch.cuda.CUDAGraph] = []
        qkv: list[tuple[Tensor, Tensor, Tensor]] = []
        hidden: Tensor | None = None
        while hidden is None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            try:
                _, q, k, v = next(steps) if not graphs else steps.send(attn)
                qkv.append((weak_alias(q), weak_alias(k), weak_alias(v)))
                del q, k, v
            except StopIteration as done:
                hidden = weak_alias(done.value)
            finally:
                graph.capture_end()
            pool = graph.pool()
            graphs.append(graph)
        return _Captured(graphs, qkv, hidden)

    def release(self) -> None:
        """Frees the graphs (later steps run eagerly); see `CudaGraphRunner.release`."""
        torch.cuda.synchronize(self.device)
        for captured in self._captured.values():
            for graph in captured.graphs:
                graph.reset()
        self._captured.clear()

    def __call__(self, input_ids: Tensor, positions: Tensor, logits_indices: Tensor | None) -> Tensor:
        """The step's logits (as `StepModel.forward`), its backend planned already; `covers` the step's
        token count. The pieces' output rows are overwritten by the next step: the logits are not."""
        assert self._input_ids is not None and self._positions is not None and self._attn is not None
        t = input_ids.shape[0]
        n = next(c for c in self.token_counts if c >= t)
        captured = self._captured[n]
        self._input_ids[:t].copy_(input_ids, non_blocking=True)
        self._positions[:t].copy_(positions, non_blocking=True)
        attention = self.pieces.attention(self._positions[:t], self._attn[:t])
        for i, (graph, (q, k, v)) in enumerate(zip(captured.graphs, captured.qkv)):
            graph.replay()
            attention(i, q[:t], k[:t], v[:t])
        captured.graphs[-1].replay()
        return self.pieces.logits(captured.hidden[:t], logits_indices)
