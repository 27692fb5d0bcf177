"""An all-reduce that the GPUs' copy engines carry, for the overlapped all-reduces of a prefill step.

`--tp-overlap-min-tokens` runs a large step's token-wise part in two chunks so that one chunk's
all-reduce runs beside the other chunk's GEMMs. With NCCL that overlap does not pay on H200s at TP 2:
NCCL's kernels take SMs, and the GEMMs beside them and the all-reduces both slow down
(`benchmark/results/NVIDIA_H200/tensor_parallel_2/README.md`). Here the bytes move by peer copies
(`cudaMemcpyAsync` over NVLink, the copy engines), and the SMs do only a small sum:

1. every rank pushes slice p of its partial into rank p's symmetric buffer, in its own slot
   (a reduce-scatter's all-to-all), then all ranks meet at a barrier;
2. each rank sums the N slots of its slice into a second symmetric buffer (N - 1 elementwise adds),
   then all meet again;
3. each rank pulls every rank's summed slice into its partial, in place.

All of it runs on a side stream, after the stream that made the partial (over more than two ranks
the copies to the peers fan out to a stream each, so that several copy engines move them at once);
`PendingSum.wait()` makes the current stream wait for it. Buffers come from torch's symmetric memory (`rendezvous` over the
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


def sum_slices(flat: Tensor, handle: Any, rank: int, world_size: int, sum_offset: int,
               peer_streams: list[Any] | None = None) -> None:
    """This rank's part of summing `flat` (its numel divisible by `world_size`) over the ranks, in
    place, through `handle`'s symmetric buffers (`get_buffer(rank, sizes, dtype, offset)` and
    `barrier()`): the pushes, the sum of this rank's slice at `sum_offset`, the pulls. With
    `peer_streams` (one CUDA stream a peer) the copies to and from the peers run side by side, each
    on its own copy engine, and the current stream waits for them all before each barrier."""
    n, dtype = world_size, flat.dtype
    size = flat.numel() // n
    peers = [(rank + 1 + step) % n for step in range(n - 1)]  # rank r starts with r + 1: peers' links alike

    def push(p: int) -> None:
        handle.get_buffer(p, (size,), dtype, rank * size).copy_(flat[p * size:(p + 1) * size])

    def pull(p: int) -> None:
        flat[p * size:(p + 1) * size].copy_(handle.get_buffer(p, (size,), dtype, sum_offset))

    push(rank)  # this rank's own slot (a local copy), beside the peers'
    _each_peer(peers, push, peer_streams)
    handle.barrier(channel=0)
    slots = handle.get_buffer(rank, (n, size), dtype, 0)  # every rank's slice `rank`
    total = handle.get_buffer(rank, (size,), dtype, sum_offset)
    # Elementwise adds (one pass each, in the dtype, as NCCL's ring sums): a reduction over the
    # slots' dimension (`torch.sum(dim=0)`) ran 3-4x slower beside the GEMMs it overlaps.
    torch.add(slots[0], slots[1], out=total)
    for i in range(2, n):
        total.add_(slots[i])
    handle.barrier(channel=0)
    _each_peer(peers, pull, peer_streams)
    pull(rank)


def _each_peer(peers: list[int], copy: Any, streams: list[Any] | None) -> None:
    """`copy(p)` for every peer: in order on the current stream, or each on its own stream of
    `streams`, forked from the current stream and joined back into it."""
    if streams is None:
        for p in peers:
            copy(p)
        return
    current = torch.cuda.current_stream()
    for stream, p in zip(streams, peers):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            copy(p)
    for stream in streams:
        current.wait_stream(stream)


# Whether this process has made a symmetric-memory rendezvous: torch's CUDA symmetric memory
# numbers its store exchanges with one counter for the whole process and keeps each group name's
# store, so a process that made one cannot meet peers that are new processes (rank 0 of a second
# model in one process would wait forever on keys they never write). `copy_engine_blocker` refuses
# such a start instead.
_RENDEZVOUS_MADE = False


def rendezvous_made_here() -> bool:
    """Whether this process has built a `CopyEngineAllReduce` (a symmetric-memory rendezvous) before."""
    return _RENDEZVOUS_MADE


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
        global _RENDEZVOUS_MADE
        _RENDEZVOUS_MADE = True  # from its start: a rendezvous that failed half-way leaves the counter moved too
        self._handle = symm_mem.rendezvous(self._buffer, process_group)
        self._sum_offset = self.max_numel
        self.stream = torch.cuda.Stream(device=device)
        # Over more than one peer, each peer's copies on a stream of their own, so that the copy
        # engines move them at once (one stream runs its copies one after another).
        self.peer_streams = [torch.cuda.Stream(device=device) for _ in range(n - 1)] if n > 2 else None

    def takes(self, t: Tensor) -> bool:
        return t.dtype == self.dtype and t.is_contiguous() and t.numel() <= self.max_numel \
            and t.numel() % self.world_size == 0

    def start(self, t: Tensor) -> PendingSum:
        """Starts summing `t` in place; `wait()` on the result returns it summed."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            sum_slices(t.view(-1), self._handle, self.rank, self.world_size, self._sum_offset, self.peer_streams)
            done = torch.cuda.Event()
            done.record(self.stream)
        return PendingSum(t, StreamDone(done))

    def close(self) -> None:
        """Drops the symmetric buffer (every rank, before the group ends)."""
        self._handle = None
        self._buffer = None
