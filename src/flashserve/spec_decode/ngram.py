"""Prompt lookup: draft tokens copied from earlier in the request's own prompt and output.

A request that edits, quotes or repeats its input continues runs of tokens it has seen; the
longest of its last `max_n` .. `min_n` tokens that occurred before predicts the tokens that
followed that occurrence (the latest one: the nearest context is the likeliest to continue).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` (the request's prompt and output; an int64
        array is searched as it is); [] when no n-gram of its end occurred before, or k < 1."""
        length = len(token_ids)
        if k < 1 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Starts of earlier occurrences of the last n tokens; the suffix itself is left out.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
