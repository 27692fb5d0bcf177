"""Prefix-sharing groups of an offline batch: which prompts share a prefix, and in what order to
submit them.

An offline batch is known in full before it starts, so its shared prefixes can be found globally
(as BatchLLM does) instead of hoping that requests with a common prefix happen to run close
together: sort the prompts, and the prefix shared by any set of them is the smallest common
prefix of neighbours in the sorted order between its first and last member. These common prefixes
form a tree of intervals (the LCP-interval tree of a suffix array, here over whole prompts); each
interval can become a group that shares the interval's prefix.

A group's prefix is cut to whole KV pages (only full pages are cached and shared) and never covers
a whole prompt: like `PrefixCache.lookup`, a prompt of n tokens can take at most (n - 1) // page_size
cached pages, since its last token is always computed for its logits. Identical prompts, and a
prompt that is the start of another, therefore share one page less than their length when it is
page-aligned.

Groups are chosen to save many prompt tokens, saved = prefix_len * (members - 1), bottom-up over
the interval tree: at each interval, a child joins the interval's group whole, or keeps its own
groups and hands its ungrouped prompts up, whichever saves more; the interval forms a group when
that beats leaving everything to the children. This is exact for two levels and a close
heuristic beyond.

Order: members of a group contiguously (in sorted order, so prefixes deeper than the group's are
neighbours too and the prefix cache finds them), groups decode-heavy first (more expected output
tokens per prompt token the group computes), so that long decodes start early and short prefill-
heavy work fills the batch around them. Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefixGroup:
    members: tuple[int, ...]  # indices into the prompts, in submission order
    prefix_len: int  # page-aligned tokens every member shares; 0 for a group of one

    @property
    def tokens_saved(self) -> int:
        return self.prefix_len * (len(self.members) - 1)


@dataclass(frozen=True)
class GroupPlan:
    groups: tuple[PrefixGroup, ...]  # in submission order

    @property
    def order(self) -> list[int]:
        """Every prompt index once, in submission order."""
        return [i for group in self.groups for i in group.members]

    @property
    def tokens_saved(self) -> int:
        return sum(group.tokens_saved for group in self.groups)

    @classmethod
    def in_order(cls, num_prompts: int) -> GroupPlan:
        """No grouping: each prompt alone, in input order."""
        return cls(tuple(PrefixGroup((i,), 0) for i in range(num_prompts)))


@dataclass(eq=False)
class _Interval:
    prefix_len: int
    children: list[_Interval | int] = field(default_factory=list)  # int: a prompt (a leaf)
    size: int = 0  # prompts under it
    saved: int = 0  # tokens its best grouping saves
    free: int = 0  # prompts that grouping leaves alone (an ancestor's group may take them)
    grouped: bool = False  # it forms a group of its own prefix
    absorbed: list[bool] = field(default_factory=list)  # per child: joins that group whole


def plan_prefix_groups(
    prompts: Sequence[Sequence[int]],
    page_size: int,
    max_tokens: Sequence[int] | None = None,
    keys: Sequence[Hashable] | None = None,
) -> GroupPlan:
    """Group prompts by shared page-aligned prefixes and order the groups for submission.

    `max_tokens` (per prompt) is the expected output that orders the groups, decode-heavy first;
    without it groups keep sorted order. Prompts with different `keys` (e.g. cache salts, which
    never share cached pages) never share a group.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if max_tokens is not None and len(max_tokens) != len(prompts):
        raise ValueError(f"{len(max_tokens)} max_tokens for {len(prompts)} prompts")
    if keys is not None and len(keys) != len(prompts):
        raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
    seqs = [p if isinstance(p, list) else list(p) for p in prompts]
    buckets: dict[Hashable, list[int]] = {}
    for i in range(len(seqs)):
        buckets.setdefault(None if keys is None else keys[i], []).append(i)
    found: list[tuple[int, list[int]]] = []
    rank: dict[int, int] = {}  # prompt index -> its place in sorted order (ties keep it)
    for bucket in buckets.values():
        bucket.sort(key=seqs.__getitem__)
        rank.update((i, len(rank)) for i in bucket)
        found.extend(_groups(seqs, bucket, page_size))
    groups = [PrefixGroup(tuple(members), prefix_len) for prefix_len, members in found]
    if max_tokens is not None:
        groups.sort(key=lambda g: (-_decode_ratio(g, seqs, max_tokens), rank[g.members[0]]))
    else:
        groups.sort(key=lambda g: rank[g.members[0]])
    return GroupPlan(tuple(groups))


def _decode_ratio(group: PrefixGroup, seqs: list[list[int]], max_tokens: Sequence[int]) -> float:
    """Expected output tokens per prompt token the group computes (its prefix once)."""
    computed = group.prefix_len + sum(len(seqs[i]) - group.prefix_len for i in group.members)
    return sum(max_tokens[i] for i in group.members) / max(computed, 1)


def _shareable(n: int, page_size: int) -> int:
    """Most prompt tokens a prompt of n tokens can take from the cache (its last is computed)."""
    return max(n - 1, 0) // page_size * page_size


def _common_prefix(a: list[int], b: list[int], limit: int, page_size: int) -> int:
    """The longest common prefix of a and b in whole pages, at most `limit` (page-aligned) tokens."""
    pages = limit // page_size
    if a[: pages * page_size] == b[: pages * page_size]:
        return pages * page_size
    lo, hi = 0, pages  # a and b agree on lo pages and differ within hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * page_size : mid * page_size] == b[lo * page_size : mid * page_size]:
            lo = mid
        else:
            hi = mid
    return lo * page_size


def _groups(seqs: list[list[int]], order: list[int], page_size: int) -> list[tuple[int, list[int]]]:
    """(prefix_len, members) for the prompts `order` (sorted by tokens), every prompt once."""
    caps = [_shareable(len(seqs[i]), page_size) for i in order]
    root = _Interval(0)
    stack = [root]
    for k, index in enumerate(order):
        stack[-1].children.append(index)
        if k + 1 < len(order):
            limit = min(caps[k], caps[k + 1])
            edge = _common_prefix(seqs[index], seqs[order[k + 1]], limit, page_size) if limit else 0
        else:
            edge = 0  # closes every open interval
        while edge < stack[-1].prefix_len:
            closed = stack.pop()
            _solve(closed)
            stack[-1].children.append(closed)
        if edge > stack[-1].prefix_len:  # a deeper interval opens with the last child
            stack.append(_Interval(edge, [stack[-1].children.pop()]))
    _solve(root)
    return _collect(root)


def _solve(node: _Interval) -> None:
    """Fill the node's best grouping from its (solved) children."""
    v = node.prefix_len
    apart = joined = members = 0
    node.absorbed = []
    for child in node.children:
        size, saved, free = (1, 0, 1) if isinstance(child, int) else (child.size, child.saved, child.free)
        node.size += size
        apart += saved
        node.free += free
        whole = v * size  # the child joins whole, giving up its own groups
        kept = saved + v * free  # it keeps its groups and hands its lone prompts up
        node.absorbed.append(whole > kept)
        joined += max(whole, kept)
        members += size if whole > kept else free
    node.saved = apart
    if v and members >= 2 and joined - v > apart:
        node.grouped, node.saved, node.free = True, joined - v, 0


def _collect(root: _Interval) -> list[tuple[int, list[int]]]:
    """The groups of a solved tree; prompts left alone become groups of one. Iterative: a tree
    can be as deep as the batch is long."""
    groups: list[tuple[int, list[int]]] = []
    todo: list[tuple[_Interval | int, list[int] | None, bool]] = [(root, None, False)]
    while todo:
        item, sink, whole = todo.pop()
        if isinstance(item, int):
            if sink is not None:
                sink.append(item)
            else:
                groups.append((0, [item]))
            continue
        joins = [whole] * len(item.children)
        if not whole and item.grouped:
            sink = []
            groups.append((item.prefix_len, sink))
            joins = item.absorbed
        for child, join in zip(reversed(item.children), reversed(joins)):
            todo.append((child, sink, join or whole))
    return groups
