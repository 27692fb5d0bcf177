"""The attention backend interface and the batch layout every backend plans from.

A step's batch is packed as one sequence of new tokens (prefill chunks and decode tokens mixed);
`BatchLayout` says which tokens belong to which request and where each request's K/V pages are,
in FlashInfer's CSR vocabulary. It is built on the CPU once per step and shared by all layers.

With a cascade policy it may also carry a prefix level (`cascade.PrefixLevel`): groups of requests
that share cached pages, for backends that attend a shared prefix once per group. The flat
fields mean the same with or without it, so a backend may ignore it and attend flat (exact).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from flashserve.attention.cascade import CascadePolicy, PrefixLevel, build_prefix_level
from flashserve.attention.layout_row import LayoutRow

if TYPE_CHECKING:
    import torch


def last_page_len(kv_len: int, page_size: int) -> int:
    """Tokens in the last page, in [1, page_size]: a page-aligned length fills its last page."""
    if kv_len <= 0:
        raise ValueError(f"a request in a batch holds at least one token, got kv_len={kv_len}")
    return (kv_len - 1) % page_size + 1


@dataclass(frozen=True)
class BatchLayout:
    page_size: int
    qo_indptr: list[int]  # [B+1] new tokens per request (a prefill chunk, or 1 for decode)
    kv_indptr: list[int]  # [B+1] pages per request, after this step's append
    kv_indices: Sequence[int]  # page ids of all requests, concatenated (an int32 array from build)
    kv_last_page_len: list[int]  # [B] always in [1, page_size]
    positions: list[int]  # [T] absolute position of every new token (RoPE and the append)
    prefix: PrefixLevel | None = None  # groups sharing cached pages; None: attend flat

    @property
    def batch_size(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def num_tokens(self) -> int:
        return self.qo_indptr[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.batch_size

    def kv_len(self, i: int) -> int:
        """Tokens in the cache for request `i` after the append."""
        return (self.kv_indptr[i + 1] - self.kv_indptr[i] - 1) * self.page_size + self.kv_last_page_len[i]

    def cached_len(self, i: int) -> int:
        """Tokens request `i` had in the cache before this step."""
        return self.kv_len(i) - (self.qo_indptr[i + 1] - self.qo_indptr[i])

    def kv_lens(self) -> list[int]:
        """Tokens in the cache per request after the append."""
        return [self.kv_len(i) for i in range(self.batch_size)]

    def fresh_rows_from(self) -> int:
        """The first request of the step's trailing run of fresh prompts: requests whose new tokens
        are all their tokens (a prompt's first chunk with nothing cached), so that they attend only
        K/V computed in this step. `batch_size` when the last request is not one. (The scheduler
        puts running requests first and newly admitted ones last, so a step's fresh prompts are
        its last rows.)"""
        first = self.batch_size
        while first > 0 and self.cached_len(first - 1) == 0:
            first -= 1
        return first

    def continued_rows_from(self, fresh: int, min_tokens: int) -> int:
        """The first request of the run of continued prompts just before row `fresh` (the trailing
        fresh prompts, `fresh_rows_from`): requests of at least `min_tokens` (and 2) new tokens over
        tokens cached before this step, as a prompt's later chunk is. `fresh` when the row before it
        is not one. Each attends its own new tokens causally and its cached tokens (`prefix_pages`)
        in full, which a backend may compute apart and merge."""
        first = fresh
        while first > 0:
            i = first - 1
            if self.qo_indptr[i + 1] - self.qo_indptr[i] < max(2, min_tokens) or self.cached_len(i) == 0:
                break
            first = i
        return first

    def prefix_pages(self, rows: range) -> tuple[list[int], list[int], list[int]]:
        """The pages of the tokens that `rows` had cached before this step, as (kv_indptr,
        kv_indices, kv_last_page_len) over those rows alone; each row must have some."""
        indptr, indices, last = [0], [], []
        for i in rows:
            cached = self.cached_len(i)
            if cached <= 0:
                raise ValueError(f"row {i} has no cached tokens")
            n = -(-cached // self.page_size)
            indices.extend(self.kv_indices[self.kv_indptr[i] : self.kv_indptr[i] + n])
            indptr.append(indptr[-1] + n)
            last.append(last_page_len(cached, self.page_size))
        return indptr, indices, last

    def saved_kv_reads(self) -> int:
        """KV tokens the prefix level reads once per group instead of once per member (0 without it)."""
        return 0 if self.prefix is None else self.prefix.saved_page_reads() * self.page_size

    @classmethod
    def build(
        cls,
        requests: Sequence[LayoutRow],
        page_size: int,
        cascade: CascadePolicy | None = None,
    ) -> BatchLayout:
        """The step's flat layout; with a `cascade` policy, also its prefix level when a group
        forms: >= `min_group` consecutive requests sharing >= `min_pages` whole pages of computed
        tokens (`cascade.find_groups`), in a step whose groups save >= `min_saved_tokens` reads.
        """
        qo_indptr, kv_indptr, last, positions = [0], [0], [], []
        kv_indices = array("i")  # extended from the page tables (int32 arrays too) by memcpy
        for r in requests:
            kv_len = r.kv_len
            n_pages = (kv_len + page_size - 1) // page_size
            if len(r.page_ids) < n_pages:
                raise ValueError(f"request {r.request_id}: {kv_len} tokens need {n_pages} pages, has {len(r.page_ids)}")
            qo_indptr.append(qo_indptr[-1] + r.num_new_tokens)
            kv_indices.extend(r.page_ids[:n_pages])
            kv_indptr.append(len(kv_indices))
            last.append(last_page_len(kv_len, page_size))
            positions.extend(range(r.num_computed_tokens, kv_len))
        prefix = None
        if cascade is not None:
            prefix = build_prefix_level(requests, page_size, qo_indptr, kv_indptr, kv_indices,
                                        cascade.min_group, cascade.min_pages, cascade.min_saved_tokens)
        return cls(page_size, qo_indptr, kv_indptr, kv_indices, last, positions, prefix)


@dataclass(frozen=True)
class AttentionShape:
    """What a model's attention asks of a backend on this rank: its layers, query and KV heads (the
    rank's share under tensor parallelism), head size and softmax scale (None: 1/sqrt(head_dim))."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float | None = None


class AttentionBackend(Protocol):
    """Owns the paged KV cache of every layer; attends one layer at a time.

    `plan` runs once per step on the CPU index arrays; `forward` runs once per layer and must not
    synchronise with the device. A backend with cascade attention reads `layout.prefix`; any other
    reads only the flat fields and attends flat, with the same result.

    A backend may also have `takes_rope(cos_sin, head_dim) -> bool`: where it says so, a model may
    pass q and k unrotated with `forward(..., rope=paged_append.Rope(positions, cos_sin))`, and the
    backend rotates them on the way into the cache (FlashInfer's, in its append kernel).
    """

    def plan(self, layout: BatchLayout) -> None: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the step's T new tokens (packed as `layout`).

        Appends k/v to the layer's pages at `layout.positions`, then attends causally over each
        request's cached prefix plus its new tokens. Returns [T, Hq, D] in q's dtype; with `out`
        (contiguous [T, Hq, D] in q's dtype), written into it and returned (piecewise CUDA graphs
        read attention's output from a fixed buffer).
        """
        ...
