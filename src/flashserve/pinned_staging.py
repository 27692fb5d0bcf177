"""Host -> device uploads through one reused pinned buffer (no page-locking per step)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


# Each array starts on a 16-byte boundary of the buffer. Triton compiles a kernel once per set of
# its pointer arguments' 16-byte alignments: views at offsets that follow the step's sizes would
# make a kernel that reads several of them (the FP8 cache's `paged_append`) compile again whenever
# a step brings a new set (up to 16 variants, a few hundred ms each, in a server's first seconds
# under load).
ALIGN_ELEMENTS = 4  # int32s


def aligned_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where arrays of `sizes` int32 elements start when packed back to back, each at a multiple
    of `ALIGN_ELEMENTS`; and the elements they span."""
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        offsets.append(start)
        end = start + n
    return offsets, end


class PinnedStaging:
    """A pinned int32 host buffer and its device twin: a step's arrays go up in one copy.

    Copies from pinned memory are asynchronous, so before the host writes the buffer again the
    previous copy must have run: `begin` waits on the event that `end` recorded (FLASHINFER.md §8,
    the pinned staging race; FlashInfer's plan() also copies from pinned memory of its own, so the
    attention backend calls `end` after planning). A fresh `pin_memory()` per step instead costs
    milliseconds for a megabyte (a new page-locked allocation when the cached one is still busy).
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._done: torch.cuda.Event | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device)

    def begin(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def upload(self, arrays: Sequence[Sequence[int] | np.ndarray]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Writes `arrays` back to back (each 16-byte aligned), copies them up once; returns
        (host views, device views)."""
        sizes = [len(a) for a in arrays]
        offsets, total = aligned_offsets(sizes)
        if total > self.host.numel():
            self._allocate(max(total, 2 * self.host.numel()))
        for a, offset, n in zip(arrays, offsets, sizes):
            self.host_np[offset : offset + n] = a
        self.dev[:total].copy_(self.host[:total], non_blocking=True)
        host_views = [self.host[offset : offset + n] for offset, n in zip(offsets, sizes)]
        dev_views = [self.dev[offset : offset + n] for offset, n in zip(offsets, sizes)]
        return host_views, dev_views

    def end(self) -> None:
        if self._done is None:
            self._done = torch.cuda.Event()
        self._done.record()
