"""An all-reduce that the GPUs' copy engines carry, for the overlapped all-reduces of a prefill step.

`--tp-overlap-min-tokens` runs a large step's token-wise part in two chunks so that one chunk's
all-reduce runs beside the other chunk's GEMMs. With NCCL that overlap does not pay on H200s at TP 2:
NCCL's kernels take SMs, and the GEMMs beside them and the all-reduces both slow down
(`benchmark/results/NVIDIA_H200/tensor_parallel_2/README.md`). Here the bytes move by peer copies
(`cudaMemcpyAsync` over NVLink, the copy engines), and the SMs do only a small sum:

1. every rank pushes slice p of its partial into rank p's symmetric buffer, in its own slot
   (a reduce-scatter's all-to-all), then all ranks meet at a barrier;
2. each rank sums the N slots of its slice into a second symmetric buffer (one kernel reading the
   slice N times), then all meet again;
3. each rank pulls every rank's summed slice into its partial, in place.

All of it runs on a side stream, after the stream that made the partial; `PendingSum.wait()` makes
the current stream wait for it. Buffers come from torch's symmetric memory (`rendezvous` over the
model's NCCL group); NVLink multicast stays off. It follows the pattern of PyTorch's low-contention
reduce-scatter and all-gather (`torch.distributed._symmetric_memory`), as one all-reduce with two
barriers instead of three and no SM copy of the rank's own slice. Ranks launch these in the same
order (the same model code on every rank), so the barriers pair up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flashserve.distributed.comm import PendingSum


def sum_slices(flat: Tensor, handle: Any, rank: int, world_size: int, sum_offset: int) -> None:
    """This rank's part of summing `flat` (its numel divisible by `world_size`) over the ranks, in
    place, through `handle`'s symmetric buffers (`get_buffer(rank, sizes, dtype, offset)` and
    `barrier()`): the pushes, the sum of this rank's slice at `sum_offset`, the pulls."""
    n, dtype = world_size, flat.dtype
    size = flat.numel() // n
    order = [(rank + 1 + step) % n for step in range(n)]  # rank r starts with r + 1: peers' links alike
    for p in order:
        handle.get_buffer(p, (size,), dtype, rank * size).copy_(flat[p * size:(p + 1) * size])
    handle.barrier(channel=0)
    mine = handle.get_buffer(rank, (n, size), dtype, 0)  # every rank's slice `rank`
    torch.sum(mine, dim=0, out=handle.get_buffer(rank, (size,), dtype, sum_offset))
    handle.barrier(channel=0)
    for p in order:
        flat[p * size:(p + 1) * size].copy_(handle.get_buffer(p, (size,), dtype, sum_offset))


class StreamDone:
    """The `work` of a `PendingSum` whose sum runs on a side stream: `wait()` makes the current
    stream wait for the event recorded after it (the host does not wait)."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)


class CopyEngineAllReduce:
    """Sums a [tokens, hidden] tensor over the ranks of `process_group` (every rank on its own GPU
    of one node, NVLink between them) for tensors of up to `max_numel` elements of `dtype` whose
    element count the number of ranks divides; `takes(t)` says whether it takes `t`. Collective to
    build: every rank constructs it, in the same order as any other symmetric memory."""

    def __init__(self, process_group: Any, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.dtype = dtype
        n = self.world_size
        self.max_numel = max_numel - max_numel % n
        slice_max = self.max_numel // n
        # Slots 0..N-1: the slices the ranks push here; then this rank's summed slice.
        self._buffer = symm_mem.empty(self.max_numel + slice_max, dtype=dtype, device=device)
        self._handle = symm_mem.rendezvous(self._buffer, process_group)
        self._sum_offset = self.max_numel
        self.stream = torch.cuda.Stream(device=device)

    def takes(self, t: Tensor) -> bool:
        return t.dtype == self.dtype and t.is_contiguous() and t.numel() <= self.max_numel \
            and t.numel() % self.world_size == 0

    def start(self, t: Tensor) -> PendingSum:
        """Starts summing `t` in place; `wait()` on the result returns it summed."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            sum_slices(t.view(-1), self._handle, self.rank, self.world_size, self._sum_offset)
            done = torch.cuda.Event()
            done.record(self.stream)
        return PendingSum(t, StreamDone(done))

    def close(self) -> None:
        """Drops the symmetric buffer (every rank, before the group ends)."""
        self._handle = None
        self._buffer = None
