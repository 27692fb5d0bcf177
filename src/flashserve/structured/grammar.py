"""What the engine knows of structured output: a grammar hands out matchers, a matcher tracks one
request's output and says which tokens may come next, as a packed bitmask.

The API layer builds and compiles grammars (JSON schemas, regexes, choices, EBNF, tool calls; see
`flashserve.structured.compiler`) and passes one in `SamplingParams.grammar`. The engine creates a
matcher per request, advances the step's matchers with their sampled tokens in one call, stops a
request when its grammar has terminated, and fills each step's token bitmask for the sampler. It
never sees what the grammar means.

A bitmask row is int32 [ceil(vocab_size / 32)]: bit j of word i set allows token 32 * i + j. The
step's bitmask is a numpy array (no torch in the engine); the runner uploads and applies it.

Filling a mask costs tens of microseconds per row for a large vocabulary (more inside some
strings), so a step's masks are filled late and together: the scheduler names the rows, and the
runner asks for the array only after it has launched the step's forward pass, so the host fills
while the device computes, and the grammar fills its rows in one batched call (on several
threads). A worker thread started at schedule time gained nothing: it needs the GIL that the
engine thread holds while it launches the forward, so it started no earlier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np


class GrammarMatcher(Protocol):
    def accept_token(self, token_id: int) -> bool:
        """Advances past `token_id`; False (state unchanged) if the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The output is complete: the grammar accepted its end (a stop token)."""
        ...

    def rollback(self, num_tokens: int = 1) -> None:
        """Undoes the last `num_tokens` accepted tokens (draft tokens of speculative decoding)."""
        ...

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any:
        """Writes the tokens allowed next into row `index` of an int32 [N, words] CPU array."""
        ...


class Grammar(Protocol):
    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of the output."""
        ...

    def advance(self, matchers: Sequence[GrammarMatcher], token_ids: Sequence[int]) -> list[tuple[bool, bool]]:
        """Matcher j takes `token_ids[j]`, all in one call: (accepted, terminated) for each; a
        rejected token leaves its matcher unchanged. One call per step rather than one per row:
        the grammar library releases the GIL in each call, and while another thread (the
        server's event loop) is busy, every call waits to take it back (~5 ms, the switch
        interval: 64 single calls measured 85-125 ms beside a busy Python thread, one batched
        call 17 ms)."""
        ...

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: Any) -> None:
        """Row j of `bitmask` gets the tokens `matchers[j]` allows next (every word of it is
        written), for matchers of grammars of this kind (the same library); may use several
        threads."""
        ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(eq=False)
class TokenBitmask:
    """The sampling rows of one step that follow a grammar, and their allowed tokens.

    `rows[j]` indexes the step's sampling requests (those with `sample=True`, in schedule order);
    row j of `array()` is that row's packed mask. A mask made by `step_bitmask` is filled on the
    first call to `array()`.
    """

    rows: list[int]
    bitmask: np.ndarray
    fill: Callable[[np.ndarray], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.rows) != self.bitmask.shape[0]:
            raise ValueError("one bitmask row per grammar row is needed")

    def array(self) -> np.ndarray:
        if self.fill is not None:
            fill, self.fill = self.fill, None
            fill(self.bitmask)
        return self.bitmask


def step_bitmask(
    matchers: Sequence[GrammarMatcher | None], grammars: Sequence[Grammar | None], vocab_size: int
) -> TokenBitmask | None:
    """The bitmask of one step's sampling rows (`matchers[i]` is row i's matcher and `grammars[i]`
    the grammar it came from, or None for a row without one), to be filled when first read; None
    when no row has a grammar, so plain batches pay nothing."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = np.empty((len(rows), bitmask_words(vocab_size)), dtype=np.int32)  # the fill writes it all
    grammar = grammars[rows[0]]
    assert grammar is not None
    active = [matchers[i] for i in rows]
    return TokenBitmask(rows, bitmask, lambda array: grammar.fill_bitmasks(active, array))  # type: ignore[arg-type]
