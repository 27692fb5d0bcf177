"""The prefix level of a batch layout: groups of requests that read the same cached pages.

When consecutive requests of a step hold the same page ids for their first pages (a shared
system prompt, the n choices of one prompt: the prefix cache hands them the same pages), a
cascade attends each group's query tokens to the shared pages once (non-causal) and each request
to its own remaining pages (causal), then merges the two results by their log-sum-exps. The
prefix level says which requests form groups and where each level's pages are, in FlashInfer's
CSR vocabulary; the flat fields of `BatchLayout` keep their meaning, so a backend that ignores
the prefix level attends flat, which is exact.

Pure Python (no torch): the layout is built on the host once per step.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from flashserve.attention.layout_row import LayoutRow


@dataclass(frozen=True)
class PrefixLevel:
    """Level 0 of a two-level cascade (G groups) and the per-request offsets of level 1 (B requests).

    A group is a run of consecutive requests, so its query tokens are contiguous in the step: group
    g's tokens are step tokens [token_start[g], token_start[g] + qo_indptr[g+1] - qo_indptr[g]).
    Prefixes are whole pages, so every prefix page is full (`kv_last_page_len` is page_size).
    Level 1 (the suffix) of request i is its flat pages after the first `prefix_pages[i]`; its
    last page is the flat last page, so its last_page_len is the flat `kv_last_page_len[i]`.
    """

    request_start: list[int]  # [G] first request of each group
    request_end: list[int]  # [G] one past its last request
    token_start: list[int]  # [G] step token of each group's first query token
    qo_indptr: list[int]  # [G+1] the groups' query tokens, concatenated in group order
    kv_indptr: list[int]  # [G+1] shared pages per group
    kv_indices: Sequence[int]  # the groups' shared page ids, concatenated (an int32 array)
    kv_last_page_len: list[int]  # [G] always page_size
    prefix_pages: list[int]  # [B] pages each request reads at level 0 (0: in no group)
    suffix_kv_indptr: list[int]  # [B+1] pages per request at level 1
    suffix_kv_indices: Sequence[int]  # each request's own pages after its prefix, concatenated (int32)

    @property
    def num_groups(self) -> int:
        return len(self.request_start)

    def saved_page_reads(self) -> int:
        """Pages read once per group instead of once per member (`saved_page_reads`)."""
        return saved_page_reads(
            (self.request_start[g], self.request_end[g], self.kv_indptr[g + 1] - self.kv_indptr[g])
            for g in range(self.num_groups)
        )

    def row_segments(self, num_tokens: int, scratch_page: int, rows: int | None = None,
                     slots: int | None = None) -> RowSegments | None:
        """Level 0 as one batch over every query row of the step, in step order (`RowSegments`).

        Each group's rows are a segment over its shared pages; every run of rows in no group, and
        the `rows - num_tokens` padding rows of a graph step after them, is a segment over the one
        `scratch_page` (its result is masked out of the merge). With `slots`, empty segments pad
        the count to exactly `slots`; None when the step needs more than that.
        """
        rows = num_tokens if rows is None else rows
        if slots is not None and self.num_row_segments(num_tokens, rows) > slots:
            return None
        qo, kv, last, pages = [0], [0], [], array("i")
        mask = bytearray(rows)

        def segment(end: int, group: int | None) -> None:
            qo.append(end)
            if group is None:
                pages.append(scratch_page)
                last.append(1)
            else:
                pages.extend(self.kv_indices[self.kv_indptr[group] : self.kv_indptr[group + 1]])
                last.append(self.kv_last_page_len[group])
            kv.append(len(pages))

        for g in range(self.num_groups):
            start, end = self.token_start[g], self.token_start[g] + self.qo_indptr[g + 1] - self.qo_indptr[g]
            if start > qo[-1]:
                segment(start, None)
            segment(end, g)
            mask[start:end] = b"\x01" * (end - start)
        if rows > qo[-1]:
            segment(rows, None)
        if slots is not None:
            for _ in range(slots - len(last)):
                segment(rows, None)
        return RowSegments(qo, kv, pages, last, mask)

    def num_row_segments(self, num_tokens: int, rows: int | None = None) -> int:
        """Segments `row_segments` builds before padding: the groups, the runs of rows in no group
        between and around them, and the padding rows."""
        rows = num_tokens if rows is None else rows
        count, cursor = 0, 0
        for g in range(self.num_groups):
            count += 1 + (self.token_start[g] > cursor)
            cursor = self.token_start[g] + self.qo_indptr[g + 1] - self.qo_indptr[g]
        return count + (rows > cursor)


@dataclass(frozen=True)
class RowSegments:
    """Level 0 over all of a step's query rows: S segments in FlashInfer's CSR vocabulary, and
    which rows merge the result (1) or keep their own-pages result (0)."""

    qo_indptr: list[int]  # [S+1]
    kv_indptr: list[int]  # [S+1]
    kv_indices: Sequence[int]  # an int32 array
    kv_last_page_len: list[int]  # [S]
    merge: bytearray  # [rows]

    @property
    def num_segments(self) -> int:
        return len(self.kv_last_page_len)


@dataclass(frozen=True)
class CascadePolicy:
    """Which groups a step attends through a prefix level: >= `min_group` requests sharing >=
    `min_pages` whole pages (`find_groups`), and only in a step whose groups save at least
    `min_saved_tokens` KV token reads (`PrefixLevel.saved_page_reads` times the page size)."""

    min_group: int = 2
    min_pages: int = 1
    min_saved_tokens: int = 0


CASCADE_MODES = ("auto", "on", "off")

# Where cascade decode steps measured faster than flat ones (NVIDIA H100, 1B shape, decode steps
# from CUDA graphs, `benchmark/batchllm_bench.py`): 4 groups x 64 requests behind 4,096-token
# prefixes (1.03M reads saved a step) 10.3 -> 7.3 ms, 4 x 256 behind 4,096 (4.2M) 40.2 -> 27.9 ms;
# slower at 4 x 16 behind 4,096 (246k: 3.84 -> 4.04 ms), 4 x 64 behind 1,024 (258k: 6.2 -> 6.6 ms)
# and every smaller shape (about +0.5 ms a step: the second pass, its plan and the merge). A flat
# step re-reads a shared prefix from L2 while the prefixes of a layer fit there, so the saving
# is real only well past that.
AUTO_MIN_SAVED_TOKENS = 1 << 19


def cascade_policy(mode: str) -> CascadePolicy | None:
    """`--cascade-attention`: "on" forms any group that saves reads, in every step; "off" attends
    flat; "auto" cascades a step whose groups save at least `AUTO_MIN_SAVED_TOKENS` KV reads."""
    if mode == "off":
        return None
    if mode == "on":
        return CascadePolicy()
    if mode == "auto":
        return CascadePolicy(min_saved_tokens=AUTO_MIN_SAVED_TOKENS)
    raise ValueError(f"cascade attention must be one of {', '.join(CASCADE_MODES)}, got {mode!r}")


def saved_page_reads(groups: Iterable[tuple[int, int, int]]) -> int:
    """Pages the groups (first, end, shared pages) read once instead of once per member: sum of
    (members - 1) * pages."""
    return sum((end - first - 1) * pages for first, end, pages in groups)


def shareable_pages(request: LayoutRow, page_size: int) -> int:
    """Leading pages a request may read at the non-causal level: whole pages of computed tokens.

    A page that holds any of this step's new tokens (or that they will write) stays causal.
    """
    return min(request.num_computed_tokens // page_size, len(request.page_ids))


def _common_pages(a: Sequence[int], b: Sequence[int], limit: int, hint: int) -> int:
    """Length of the common prefix of a[:limit] and b[:limit], by slices compared at C speed.

    Members of one group have the same common prefix, so the previous pair's length (`hint`) is
    tried first; otherwise a binary search over prefix lengths (a few slice compares, where a loop
    over the page ids costs milliseconds per step at a thousand requests of long prompts).
    """
    if limit == 0 or a[0] != b[0]:
        return 0
    if 0 < hint < limit and a[hint] != b[hint] and a[:hint] == b[:hint]:
        return hint
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit - 1  # a[:limit] != b[:limit], so the length is below limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Run:
    """An open run of requests whose adjacent members share >= `level` pages (a stack entry)."""

    level: int
    first: int
    saved: int = 0  # page reads saved by the groups chosen inside it so far
    groups: list[tuple[int, int, int]] = field(default_factory=list)


def find_groups(
    requests: Sequence[LayoutRow], page_size: int, min_group: int = 2, min_pages: int = 1
) -> list[tuple[int, int, int]]:
    """Groups of consecutive requests as (first, end, shared pages), chosen to save many reads.

    The pages a run of requests shares is the smallest common prefix of adjacent members (page
    ids equal position by position), capped by each member's `shareable_pages`. The maximal runs
    at each sharing level nest (a system prompt's run holds the runs of each prompt's n choices);
    for every run, from the innermost out, the choice is one group over the whole run or the best
    choices inside it, whichever saves more page reads, (members - 1) * pages summed; a tie goes
    to the whole run (fewer groups). One pass with a stack, O(B), so it can run every step; it
    does not consider groups that cut a run of a deeper level in two.
    """
    if min_group < 2:
        raise ValueError(f"a group has at least 2 requests (a single one saves nothing), got min_group={min_group}")
    if min_pages < 1:
        raise ValueError(f"a group shares at least 1 page, got min_pages={min_pages}")
    if len(requests) < 2:
        return []
    # adjacent[k]: pages requests k and k+1 may share. Neighbours whose first pages differ (most,
    # in most batches) cost one comparison.
    adjacent: list[int] = []
    shareable_b = -1  # shareable_pages of request k + 1, once known: the next pair's first
    for k in range(len(requests) - 1):
        a, b = requests[k].page_ids, requests[k + 1].page_ids
        shareable_a, shareable_b = shareable_b, -1
        if not a or not b or a[0] != b[0]:
            adjacent.append(0)
            continue
        if shareable_a < 0:
            shareable_a = shareable_pages(requests[k], page_size)
        shareable_b = shareable_pages(requests[k + 1], page_size)
        adjacent.append(_common_pages(a, b, min(shareable_a, shareable_b), adjacent[-1] if adjacent else 0))
    if max(adjacent) < min_pages:
        return []
    stack = [_Run(level=-1, first=0)]  # the whole batch, below every sharing level
    for k in range(len(adjacent) + 1):
        level = adjacent[k] if k < len(adjacent) else -1  # -1 closes every run at the end
        first, closed = k, None
        while stack[-1].level > level:
            run = stack.pop()  # it covers requests [run.first, k + 1)
            members = k + 1 - run.first
            whole = (members - 1) * run.level
            if members >= min_group and run.level >= min_pages and whole >= run.saved:
                run.saved, run.groups = whole, [(run.first, k + 1, run.level)]
            first, closed = run.first, run
            if stack[-1].level >= level:  # the closed run lies inside the one below
                stack[-1].saved += run.saved
                stack[-1].groups += run.groups
                closed = None
        if stack[-1].level < level:  # a deeper run starts; a run just closed lies inside it
            stack.append(_Run(level, first, closed.saved, closed.groups) if closed else _Run(level, first))
    return stack[0].groups


def build_prefix_level(
    requests: Sequence[LayoutRow],
    page_size: int,
    qo_indptr: list[int],
    kv_indptr: list[int],
    kv_indices: list[int],
    min_group: int = 2,
    min_pages: int = 1,
    min_saved_tokens: int = 0,
) -> PrefixLevel | None:
    """The prefix level over a flat layout's arrays, or None when no group forms or the groups
    save fewer than `min_saved_tokens` KV token reads."""
    groups = find_groups(requests, page_size, min_group, min_pages)
    if not groups or saved_page_reads(groups) * page_size < min_saved_tokens:
        return None
    token_start: list[int] = []
    qo, kv_ptr, pages_of_groups = [0], [0], array("i")  # int32 arrays: extended by memcpy
    prefix_pages = [0] * len(requests)
    for first, end, pages in groups:
        token_start.append(qo_indptr[first])
        qo.append(qo[-1] + qo_indptr[end] - qo_indptr[first])
        pages_of_groups.extend(requests[first].page_ids[:pages])
        kv_ptr.append(len(pages_of_groups))
        prefix_pages[first:end] = [pages] * (end - first)
    suffix_ptr, suffix_pages = [0], array("i")  # level 1: the flat pages after each prefix
    for i, skip in enumerate(prefix_pages):
        suffix_pages.extend(kv_indices[kv_indptr[i] + skip : kv_indptr[i + 1]])
        suffix_ptr.append(len(suffix_pages))
    return PrefixLevel(
        request_start=[g[0] for g in groups],
        request_end=[g[1] for g in groups],
        token_start=token_start,
        qo_indptr=qo,
        kv_indptr=kv_ptr,
        kv_indices=pages_of_groups,
        kv_last_page_len=[page_size] * len(groups),
        prefix_pages=prefix_pages,
        suffix_kv_indptr=suffix_ptr,
        suffix_kv_indices=suffix_pages,
    )
