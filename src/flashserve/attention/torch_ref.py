"""Reference attention over a paged KV cache in pure PyTorch (CPU and CUDA).

Correctness first: this backend is the oracle that the FlashInfer backend and the fast PyTorch
path (`torch_sdpa.py`, which the engine runs on a CPU) are tested against. `plan` turns the
step's `BatchLayout` into index tensors once; `forward` scatters the new K/V into their slots and
attends with one padded, masked batched computation per group of requests (float32 scores and
softmax), with no Python loop over tokens and no host synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashserve.attention.base import BatchLayout

# Padded (query, key) pairs per group. Requests are grouped in schedule order so that a long
# prefill does not pad every decode request to its length; a request larger than this is a
# group on its own.
_MAX_PAIRS_PER_GROUP = 1 << 22


@dataclass(frozen=True)
class _Group:
    """Consecutive requests attended in one padded computation (tensors on the cache's device)."""

    token_start: int  # the group's new tokens are tokens [token_start, token_end) of the step
    token_end: int
    q_index: torch.Tensor  # [B, N] long: step token of query row n of request b (0 for padding)
    kv_slots: torch.Tensor  # [B, L] long: flat cache slot of key position l of request b
    allowed: torch.Tensor  # [B, N, L] bool: causal (bottom-right aligned) and in-range
    out_rows: torch.Tensor  # [token_end - token_start] long: rows of the flattened [B * N] output


@dataclass(frozen=True)
class _Plan:
    write_slots: torch.Tensor  # [T] long: flat cache slot of every new token
    groups: tuple[_Group, ...]


class TorchAttentionBackend:
    """Owns per-layer K/V pages `[num_pages, page_size, Hkv, D]` (NHD, as FlashInfer) and attends."""

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
    ) -> None:
        self.num_layers = num_layers
        self.num_qo_heads = num_qo_heads
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(num_layers)
        ]
        self._plan: _Plan | None = None

    def plan(self, layout: BatchLayout) -> None:
        """Builds the step's index tensors on the CPU and moves them to the device once."""
        if layout.page_size != self.page_size:
            raise ValueError(f"layout page_size {layout.page_size} != cache page_size {self.page_size}")
        ps = self.page_size
        offsets = torch.arange(ps)
        positions = torch.tensor(layout.positions, dtype=torch.long)
        kv_lens = layout.kv_lens()
        # Every slot of every request, in position order: slots[i][p] holds position p.
        slots: list[torch.Tensor] = []
        write: list[torch.Tensor] = []
        for i in range(layout.batch_size):
            pages = torch.tensor(layout.kv_indices[layout.kv_indptr[i] : layout.kv_indptr[i + 1]], dtype=torch.long)
            if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self.num_pages):
                raise ValueError(f"request {i}: page ids out of range [0, {self.num_pages})")
            req_slots = (pages[:, None] * ps + offsets).flatten()[: kv_lens[i]]
            slots.append(req_slots)
            q0, q1 = layout.qo_indptr[i], layout.qo_indptr[i + 1]
            write.append(req_slots[positions[q0:q1]])
        write_slots = torch.cat(write) if write else torch.zeros(0, dtype=torch.long)
        groups = tuple(self._build_group(layout, slots, kv_lens, a, b) for a, b in _group_bounds(layout, kv_lens))
        self._plan = _Plan(write_slots.to(self.device), groups)

    def _build_group(
        self, layout: BatchLayout, slots: list[torch.Tensor], kv_lens: list[int], first: int, last: int
    ) -> _Group:
        qo = layout.qo_indptr
        q_lens = [qo[i + 1] - qo[i] for i in range(first, last)]
        lens = kv_lens[first:last]
        n_max, l_max, count = max(q_lens), max(lens), last - first
        q_len_t = torch.tensor(q_lens, dtype=torch.long)
        kv_len_t = torch.tensor(lens, dtype=torch.long)
        n = torch.arange(n_max)
        starts = torch.tensor([qo[i] for i in range(first, last)], dtype=torch.long)
        q_valid = n[None, :] < q_len_t[:, None]  # [B, N]
        q_index = torch.where(q_valid, starts[:, None] + n[None, :], 0)
        kv_slots = torch.zeros(count, l_max, dtype=torch.long)
        for b in range(count):
            kv_slots[b, : lens[b]] = slots[first + b]
        # Query row n of a request sits at position kv_len - q_len + n (bottom-right aligned).
        # Padding rows (n >= q_len) see every key, so their softmax stays finite; they are dropped.
        l = torch.arange(l_max)
        q_pos = (kv_len_t - q_len_t)[:, None] + n[None, :]  # [B, N]
        allowed = (l[None, None, :] <= q_pos[:, :, None]) & (l[None, None, :] < kv_len_t[:, None, None])
        out_rows = q_valid.flatten().nonzero().flatten()
        return _Group(
            token_start=qo[first],
            token_end=qo[last],
            q_index=q_index.to(self.device),
            kv_slots=kv_slots.to(self.device),
            allowed=allowed.to(self.device),
            out_rows=out_rows.to(self.device),
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
        k_cache.view(-1, hkv, head_dim).index_copy_(0, slots, k.to(self.dtype))
        v_cache.view(-1, hkv, head_dim).index_copy_(0, slots, v.to(self.dtype))
        return num_q_heads // hkv

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D] in q's dtype. See `AttentionBackend`."""
        if self._plan is None:
            raise RuntimeError("plan() must run before forward()")
        plan = self._plan
        num_tokens, num_q_heads, head_dim = q.shape
        hkv = self.num_kv_heads
        group_size = self._append(layer, q, k, v, plan.write_slots)
        k_cache, v_cache = self.kv_cache[layer]
        k_flat = k_cache.view(-1, hkv, head_dim)
        v_flat = v_cache.view(-1, hkv, head_dim)

        out = torch.empty_like(q)
        for g in plan.groups:
            batch, n_max = g.q_index.shape
            # Query head h uses kv head h // group_size, as transformers' repeat_kv does.
            qg = q[g.q_index].float().view(batch, n_max, hkv, group_size, head_dim)
            kg = k_flat[g.kv_slots].float()  # [B, L, Hkv, D]
            vg = v_flat[g.kv_slots].float()
            scores = torch.einsum("bnhgd,blhd->bhgnl", qg, kg) * self.sm_scale
            scores = scores.masked_fill(~g.allowed[:, None, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            og = torch.einsum("bhgnl,blhd->bnhgd", probs, vg).reshape(batch * n_max, num_q_heads, head_dim)
            out[g.token_start : g.token_end] = og[g.out_rows].to(q.dtype)
        return out


def _group_bounds(layout: BatchLayout, kv_lens: list[int]) -> list[tuple[int, int]]:
    """Splits requests [0, B) into consecutive runs whose padded size stays under the budget."""
    bounds: list[tuple[int, int]] = []
    first, n_max, l_max = 0, 0, 0
    for i in range(layout.batch_size):
        q_len = layout.qo_indptr[i + 1] - layout.qo_indptr[i]
        n_new, l_new = max(n_max, q_len), max(l_max, kv_lens[i])
        if i > first and (i - first + 1) * n_new * l_new > _MAX_PAIRS_PER_GROUP:
            bounds.append((first, i))
            first, n_new, l_new = i, q_len, kv_lens[i]
        n_max, l_max = n_new, l_new
    if layout.batch_size:
        bounds.append((first, layout.batch_size))
    return bounds
