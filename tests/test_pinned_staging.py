"""The pinned staging buffer's packing: every array a step uploads starts 16-byte aligned, so
that kernels reading several of them (Triton specialises on pointer alignment) see the same
alignments whatever the step's sizes, and compile once."""

from __future__ import annotations

import itertools

from flashserve.pinned_staging import ALIGN_ELEMENTS, aligned_offsets


def test_every_array_starts_on_a_16_byte_boundary_whatever_the_sizes() -> None:
    for sizes in itertools.product([0, 1, 2, 3, 5, 17], repeat=4):
        offsets, total = aligned_offsets(sizes)
        assert all(o * 4 % 16 == 0 for o in offsets), sizes
        spans = [(o, o + n) for o, n in zip(offsets, sizes)]
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), sizes  # no overlap, in order
        assert total == spans[-1][1]
        assert total - sum(sizes) <= (ALIGN_ELEMENTS - 1) * (len(sizes) - 1)  # padding only
