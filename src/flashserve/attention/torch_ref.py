"""Reference attention over a paged KV cache in pure PyTorch (CPU and CUDA).

Correctness first: this backend is the oracle that the FlashInfer backend and the fast PyTorch
path (`torch_sdpa.py`, which the engine runs on a CPU) are tested against. `plan` turns the
step's `BatchLayout` into index tensors once; `forward` scatters the new K/V into their slots and
attends with one padded, masked batched computation per group of segments (float32 scores and
softmax), with no Python loop over tokens and no host synchronisation.

A segment is some query tokens and the keys they read. Flat, a segment is a request over all its
pages (causal). When the layout has a prefix level (cascade attention), there are two levels of
segments: each cascade group's query tokens over the group's shared pages (non-causal: the prefix
holds no new token), and each request over its own pages after the prefix (causal). Both levels
return their log-sum-exps and `merge_attention_states` combines them, as FlashInfer's
`merge_state` does on the GPU.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashserve.attention.base import BatchLayout
from flashserve.attention.kv_quant import bits, read_bits, to_cache

# Padded (query, key) pairs per group. Segments are grouped in schedule order so that a long
# prefill does not pad every decode request to its length; a segment larger than this is a
# group on its own.
_MAX_PAIRS_PER_GROUP = 1 << 22


@dataclass(frozen=True)
class _Segment:
    """Plan-time description of query rows and the keys they read (CPU tensors)."""

    token_start: int  # its query rows are step tokens [token_start, token_start + num_q)
    num_q: int
    slots: torch.Tensor  # [L] long: flat cache slots of its keys, in position order
    # Query row n sees keys 0..offset + n: kv_len - q_len for a request's causal mask (bottom-right
    # aligned), less the prefix under a cascade; num_keys - 1 for a non-causal shared prefix.
    offset: int


@dataclass(frozen=True)
class _Group:
    """Consecutive segments attended in one padded computation (tensors on the cache's device)."""

    q_index: torch.Tensor  # [B, N] long: step token of query row n of segment b (0 for padding)
    kv_slots: torch.Tensor  # [B, L] long: flat cache slot of key l of segment b
    allowed: torch.Tensor  # [B, N, L] bool: causal (or all keys, non-causal) and in-range
    out_rows: torch.Tensor  # [R] long: the real query rows of the flattened [B * N] output
    out_tokens: torch.Tensor  # [R] long: their step tokens


@dataclass(frozen=True)
class _Plan:
    write_slots: torch.Tensor  # [T] long: flat cache slot of every new token
    groups: tuple[_Group, ...]  # each request over its pages (after its prefix, under a cascade)
    prefix_groups: tuple[_Group, ...] = ()  # each cascade group over its shared pages; () flat


def page_tensor(ids: Sequence[int]) -> torch.Tensor:
    """Page ids as an int64 CPU tensor: an int32 array (a layout's, a page table's) through its
    buffer, any other sequence element by element."""
    if isinstance(ids, array) and ids.typecode == "i":
        return torch.frombuffer(ids, dtype=torch.int32).long() if len(ids) else torch.zeros(0, dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long)


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's result: (o, lse).

    o_*: [..., D] float32 softmax-weighted values; lse_*: [...] float32 log-sum-exp of the scaled
    scores in NATURAL log (`torch.logsumexp`). FlashInfer's `run(return_lse=True)` and
    `merge_state` use base 2 (lse_2 = lse / ln 2): compare or feed FlashInfer's values after
    multiplying them by ln 2, never as they are.
    A side with no keys (lse -inf) weighs exactly 0, so the result is the other side bit for
    bit; two empty sides give o = 0 and lse = -inf, never NaN.
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # both empty: keep exponents finite
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    o = (o_a * w_a[..., None] + o_b * w_b[..., None]) / torch.where(total > 0, total, 1.0)[..., None]
    return o, m + torch.log(total)


class TorchAttentionBackend:
    """Owns per-layer K/V pages `[num_pages, page_size, Hkv, D]` (NHD, as FlashInfer) and attends.

    `dtype` is the attention dtype; `kv_cache_dtype` the pages' (default: `dtype`). An FP8 cache
    (`attention/kv_quant.py`) quantizes K/V on append and dequantizes them on read, as the
    FlashInfer backend's kernels do, so this backend is the numerics reference of FP8 KV too.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sm_scale: float | None = None,
        *,
        num_qo_heads: int | None = None,  # checked against q when given
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_qo_heads = num_qo_heads
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.cache_dtype = kv_cache_dtype or dtype
        self.device = torch.device(device)
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        cache_dtype = self.cache_dtype
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=cache_dtype, device=self.device),
             torch.zeros(shape, dtype=cache_dtype, device=self.device))
            for _ in range(num_layers)
        ]  # fmt: skip
        self._plan: _Plan | None = None

    def plan(self, layout: BatchLayout) -> None:
        """Builds the step's index tensors on the CPU and moves them to the device once."""
        if layout.page_size != self.page_size:
            raise ValueError(f"layout page_size {layout.page_size} != cache page_size {self.page_size}")
        ps, qo = self.page_size, layout.qo_indptr
        positions = torch.tensor(layout.positions, dtype=torch.long)
        kv_lens = layout.kv_lens()
        # Every slot of every request, in position order: slots[i][p] holds position p.
        slots: list[torch.Tensor] = []
        write: list[torch.Tensor] = []
        for i in range(layout.batch_size):
            pages = page_tensor(layout.kv_indices[layout.kv_indptr[i] : layout.kv_indptr[i + 1]])
            if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
                raise ValueError(f"request {i}: page ids out of range [0, {self.num_pages})")
            req_slots = self._page_slots(pages)[: kv_lens[i]]
            slots.append(req_slots)
            write.append(req_slots[positions[qo[i] : qo[i + 1]]])
        write_slots = torch.cat(write) if write else torch.zeros(0, dtype=torch.long)

        prefix = layout.prefix
        # Under a cascade a request's own keys start after its group's shared pages.
        skip = [0] * layout.batch_size if prefix is None else [p * ps for p in prefix.prefix_pages]
        own = [
            _Segment(qo[i], qo[i + 1] - qo[i], slots[i][skip[i] :], kv_lens[i] - (qo[i + 1] - qo[i]) - skip[i])
            for i in range(layout.batch_size)
        ]  # fmt: skip
        shared: list[_Segment] = []
        if prefix is not None:
            for g in range(prefix.num_groups):
                pages = page_tensor(prefix.kv_indices[prefix.kv_indptr[g] : prefix.kv_indptr[g + 1]])
                keys = self._page_slots(pages)  # whole pages: every slot holds a computed token
                num_q = prefix.qo_indptr[g + 1] - prefix.qo_indptr[g]
                shared.append(_Segment(prefix.token_start[g], num_q, keys, keys.numel() - 1))  # non-causal
        self._plan = _Plan(write_slots.to(self.device), self._groups(own), self._groups(shared))

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """[P] page ids -> [P * page_size] flat cache slots, in position order."""
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()

    def _groups(self, segments: list[_Segment]) -> tuple[_Group, ...]:
        bounds = _group_bounds([s.num_q for s in segments], [s.slots.numel() for s in segments])
        return tuple(self._build_group(segments[a:b]) for a, b in bounds)

    def _build_group(self, segments: list[_Segment]) -> _Group:
        q_len_t = torch.tensor([s.num_q for s in segments], dtype=torch.long)
        kv_len_t = torch.tensor([s.slots.numel() for s in segments], dtype=torch.long)
        n_max, l_max = int(q_len_t.max()), int(kv_len_t.max())
        n = torch.arange(n_max)
        starts = torch.tensor([s.token_start for s in segments], dtype=torch.long)
        q_valid = n[None, :] < q_len_t[:, None]  # [B, N]
        q_index = torch.where(q_valid, starts[:, None] + n[None, :], 0)
        kv_slots = torch.zeros(len(segments), l_max, dtype=torch.long)
        for b, s in enumerate(segments):
            kv_slots[b, : s.slots.numel()] = s.slots
        # Row n sees keys up to offset + n. Padding rows (n >= num_q) see every key, so their
        # softmax stays finite; they are dropped.
        l = torch.arange(l_max)
        last_key = torch.tensor([s.offset for s in segments], dtype=torch.long)[:, None] + n[None, :]  # [B, N]
        allowed = (l[None, None, :] <= last_key[:, :, None]) & (l[None, None, :] < kv_len_t[:, None, None])
        out_rows = q_valid.flatten().nonzero().flatten()
        return _Group(
            q_index=q_index.to(self.device),
            kv_slots=kv_slots.to(self.device),
            allowed=allowed.to(self.device),
            out_rows=out_rows.to(self.device),
            out_tokens=q_index.flatten()[out_rows].to(self.device),
        )

    def _append(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> int:
        """Checks q's heads, writes this step's k/v into their cache slots; returns q heads per kv head."""
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        hkv = self.num_kv_heads
        if self.num_qo_heads is not None and num_q_heads != self.num_qo_heads:
            raise ValueError(f"q has {num_q_heads} heads, the backend was built for {self.num_qo_heads}")
        if num_q_heads % hkv:
            raise ValueError(f"{num_q_heads} query heads are not a multiple of {hkv} kv heads")
        k_cache, v_cache = self.kv_cache[layer]
        bits(k_cache).view(-1, hkv, head_dim).index_copy_(0, slots, bits(to_cache(k, self.cache_dtype)))
        bits(v_cache).view(-1, hkv, head_dim).index_copy_(0, slots, bits(to_cache(v, self.cache_dtype)))
        return num_q_heads // hkv

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D] in q's dtype (into `out` when given). See
        `AttentionBackend`."""
        result = self._forward(layer, q, k, v)
        return result if out is None else out.copy_(result)

    def _forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("plan() must run before forward()")
        plan = self._plan
        self._append(layer, q, k, v, plan.write_slots)
        out, lse = self._attend(layer, q, plan.groups)
        if plan.prefix_groups:
            # Tokens in no cascade group keep o = 0, lse = -inf here and merge to `out` exactly.
            shared_out, shared_lse = self._attend(layer, q, plan.prefix_groups)
            out, lse = merge_attention_states(shared_out, shared_lse, out, lse)
        return out.to(q.dtype)

    def _attend(self, layer: int, q: torch.Tensor, groups: tuple[_Group, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """One level of segments: float32 output [T, Hq, D] and natural-log LSE [T, Hq].

        Rows of tokens in no segment stay o = 0, lse = -inf (attention over no keys).
        """
        num_tokens, num_q_heads, head_dim = q.shape
        hkv = self.num_kv_heads
        group_size = num_q_heads // hkv
        k_cache, v_cache = self.kv_cache[layer]
        k_flat = bits(k_cache).view(-1, hkv, head_dim)
        v_flat = bits(v_cache).view(-1, hkv, head_dim)
        out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
        for g in groups:
            batch, n_max = g.q_index.shape
            # Query head h uses kv head h // group_size, as transformers' repeat_kv does.
            qg = q[g.q_index].float().view(batch, n_max, hkv, group_size, head_dim)
            kg = read_bits(k_flat[g.kv_slots], self.cache_dtype, torch.float32)  # [B, L, Hkv, D]
            vg = read_bits(v_flat[g.kv_slots], self.cache_dtype, torch.float32)
            scores = torch.einsum("bnhgd,blhd->bhgnl", qg, kg) * self.sm_scale
            scores = scores.masked_fill(~g.allowed[:, None, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            og = torch.einsum("bhgnl,blhd->bnhgd", probs, vg).reshape(batch * n_max, num_q_heads, head_dim)
            lg = torch.logsumexp(scores, dim=-1).permute(0, 3, 1, 2).reshape(batch * n_max, num_q_heads)
            out.index_copy_(0, g.out_tokens, og[g.out_rows])
            lse.index_copy_(0, g.out_tokens, lg[g.out_rows])
        return out, lse


def _group_bounds(q_lens: list[int], kv_lens: list[int]) -> list[tuple[int, int]]:
    """Splits segments [0, S) into consecutive runs whose padded size stays under the budget."""
    bounds: list[tuple[int, int]] = []
    first, n_max, l_max = 0, 0, 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        n_new, l_new = max(n_max, q_len), max(l_max, kv_len)
        if i > first and (i - first + 1) * n_new * l_new > _MAX_PAIRS_PER_GROUP:
            bounds.append((first, i))
            first, n_new, l_new = i, q_len, kv_len
        n_max, l_max = n_new, l_new
    if q_lens:
        bounds.append((first, len(q_lens)))
    return bounds
