"""Host -> device uploads through one reused pinned buffer (no page-locking per step)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


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
        """Writes `arrays` back to back, copies them up once; returns (host views, device views)."""
        sizes = [len(a) for a in arrays]
        total = sum(sizes)
        if total > self.host.numel():
            self._allocate(max(total, 2 * self.host.numel()))
        offset = 0
        for a, n in zip(arrays, sizes):
            self.host_np[offset : offset + n] = a
            offset += n
        self.dev[:total].copy_(self.host[:total], non_blocking=True)
        host_views, dev_views, offset = [], [], 0
        for n in sizes:
            host_views.append(self.host[offset : offset + n])
            dev_views.append(self.dev[offset : offset + n])
            offset += n
        return host_views, dev_views

    def end(self) -> None:
        if self._done is None:
            self._done = torch.cuda.Event()
        self._done.record()
