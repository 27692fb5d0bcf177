"""The copy-engine all-reduce's data movement (`distributed/copy_engine.sum_slices`) sums every
rank's tensor in place, on the CPU: threads stand in for the ranks, per-rank tensors for the
symmetric buffers, a thread barrier for the GPU barrier. (Its streams, the symmetric memory itself
and the copy engines run only on GPUs: tests/gpu/test_tp_gpu.py.)"""

from __future__ import annotations

import threading

import pytest
import torch

from flashserve.distributed.copy_engine import sum_slices


class ThreadBuffers:
    """Rank `rank`'s view of every rank's buffer, as a symmetric memory handle gives it."""

    def __init__(self, buffers: list[torch.Tensor], barrier: threading.Barrier) -> None:
        self.buffers, self._barrier = buffers, barrier

    def get_buffer(self, rank: int, sizes: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        numel = 1
        for s in sizes:
            numel *= s
        assert self.buffers[rank].dtype == dtype and offset + numel <= self.buffers[rank].numel()
        return self.buffers[rank][offset:offset + numel].view(sizes)

    def barrier(self, channel: int = 0) -> None:
        self._barrier.wait(timeout=10)


def sum_on_threads(rounds: list[list[torch.Tensor]], max_numel: int) -> list[list[torch.Tensor]]:
    """`rounds[k][r]`: rank r's tensor of the k-th sum. Every 'rank' runs the sums in order, in place,
    through the same buffers (NaN at first), as `sum_slices` runs on a GPU; returns the results."""
    n = len(rounds[0])
    buffers = [torch.full((max_numel + max_numel // n,), float("nan")) for _ in range(n)]
    barrier = threading.Barrier(n)
    outs = [[t.clone() for t in ts] for ts in rounds]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            for ts in outs:
                sum_slices(ts[rank].view(-1), ThreadBuffers(buffers, barrier), rank, n, max_numel)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return outs


def randn(n: int, rows: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 16, generator=gen) for _ in range(n)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_ends_with_the_sum_of_all_ranks_tensors(world_size: int) -> None:
    inputs = randn(world_size, 24, seed=world_size)
    (outs,) = sum_on_threads([inputs], max_numel=64 * 16)
    for out in outs:
        torch.testing.assert_close(out, torch.stack(inputs).sum(0))


def test_back_to_back_sums_of_different_sizes_reuse_the_buffers_without_mixing_them() -> None:
    """A step's chunks one after another through the same buffers, larger then smaller then larger
    (the last chunk of a step, the next step's first): each sum is its own tensors' alone."""
    rounds = [randn(4, 32, seed=1), randn(4, 4, seed=2), randn(4, 28, seed=3)]
    for ins, outs in zip(rounds, sum_on_threads(rounds, max_numel=32 * 16)):
        for out in outs:
            torch.testing.assert_close(out, torch.stack(ins).sum(0))


def test_the_largest_tensor_the_buffers_hold_is_summed_whole() -> None:
    inputs = randn(4, 32, seed=5)
    (outs,) = sum_on_threads([inputs], max_numel=32 * 16)
    for out in outs:
        torch.testing.assert_close(out, torch.stack(inputs).sum(0))
