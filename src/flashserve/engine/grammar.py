"""What the engine knows of structured output: a grammar hands out matchers, a matcher tracks one
request's output and says which tokens may come next, as a packed bitmask.

The API layer builds and compiles grammars (JSON schemas, regexes, choices, EBNF, tool calls; see
`flashserve.api.structured`) and passes one in `SamplingParams.grammar`. The engine creates a
matcher per request, advances it with every sampled token, stops the request when the matcher
has terminated, and fills each step's token bitmask for the sampler. It never sees what the
grammar means.

A bitmask row is int32 [ceil(vocab_size / 32)]: bit j of word i set allows token 32 * i + j. The
step's bitmask is a numpy array (no torch in the engine); the runner uploads and applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np


class GrammarMatcher(Protocol):
    def accept_token(self, token_id: int) -> bool:
        """Advances past `token_id`; False (state unchanged) if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The output is complete: the grammar accepted its end (a stop token)."""
        ...

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any:
        """Writes the tokens allowed next into row `index` of an int32 [N, words] CPU array."""
        ...


class Grammar(Protocol):
    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of the output."""
        ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class TokenBitmask:
    """The sampling rows of one step that follow a grammar, and their allowed tokens.

    `rows[j]` indexes the step's sampling requests (those with `sample=True`, in schedule order);
    `bitmask[j]` is that row's packed mask.
    """

    rows: list[int]
    bitmask: np.ndarray = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.bitmask is None or len(self.rows) != self.bitmask.shape[0]:
            raise ValueError("one bitmask row per grammar row is needed")


def step_bitmask(matchers: Sequence[GrammarMatcher | None], vocab_size: int) -> TokenBitmask | None:
    """The bitmask of one step's sampling rows (`matchers[i]` is row i's matcher, or None for a row
    without a grammar); None when no row has one, so plain batches pay nothing."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = np.full((len(rows), bitmask_words(vocab_size)), -1, dtype=np.int32)
    for j, i in enumerate(rows):
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_next_token_bitmask(bitmask, j)
    return TokenBitmask(rows, bitmask)
