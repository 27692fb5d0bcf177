"""The adapters' delta of a decode-sized step on a GPU: two Triton kernels, Punica's shrink and expand.

`LoRAStack`'s masked path runs every slot's shrink GEMM, a mask multiply and every slot's expand
GEMM: three launches, about 11 us a projection on an H200 under a CUDA graph whatever the rows
(1..128), where the bytes take under 2. Here each row reads its own slot's weights only:

    shrink  grid (slot x block of rank columns, K split, row block): for the rows t of slot s,
            u_part[k, t] = x[t, K_k] @ A_s[:, K_k].T in float32, A_s the slot's n*R rows of A
            (every fused module's shrink), one partial a K split: the A reads spread over many
            SMs, and no atomics (deterministic, nothing to zero between steps).
    expand  grid (block of output columns, row block): y[t, c] += (sum_k u_part[k, t, jR : jR+R])
            @ B[c, s nR + jR : s nR + jR + R] for each row t of slot s, j the fused module that
            column c belongs to (q, k or v; gate or up): a module's rows of B hold only its own R
            columns of the slot. One product covers a group of slots (4 of rank 16): each row's
            u sits in its own slot's columns, zeros in the others'.

Slots no row of a block uses are not read (a step over one adapter reads one slot of A and B),
rows of the base model (slot index 0) are neither read nor written. The slot index is read on
the device from `LoRAStack`'s persistent buffer, so there is no host sync and a CUDA graph replays
with any step's slots. The shrink's product runs in the model dtype with a float32 accumulator,
the expand's in TF32 (u keeps 10 mantissa bits where the masked path rounds it to bfloat16's 7);
y is read and written once, in its dtype.

Both kernels launch with PDL on Hopper (`layers/pdl.py`) and read the slot index and their first
tile of weights (A's, B's) before waiting for the kernel before them (which writes x, y or the
partials). Block sizes: compiled for sm_90 (no GPU needed: `triton.compile` with a `GPUTarget`)
none spills registers up to rank 256; their speed is lora_bench's kernel table to measure.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from flashserve.layers.pdl import triton_pdl

Tensor = torch.Tensor

# The shrink's K splits (at most; fewer when the input is narrow): with 4 slots, 64 programs of
# 256 (4096 inputs) to 896 (14336) columns each. The expand sums the splits' partials per row.
SPLIT_K = 16
BLOCK_K = 64
# The shrink's largest tile of rank columns, and the largest row blocks.
MAX_BLOCK_NR = 64
MAX_BLOCK_M = 64
# The expand's register tiles: its slots' rank columns a product (a group of slots: 4 of rank 16),
# and the elements of its B tile and of its load of partials.
EXPAND_GROUP_COLUMNS = 64
TILE_ELEMENTS = 8192


def available() -> bool:
    """Whether Triton is installed (the kernels build on first use)."""
    return _kernels() is not None


def partials_numel(max_tokens: int, max_width: int) -> int:
    """float32 elements of the scratch the shrink writes for up to `max_tokens` rows and
    `max_width` (n * R) rank columns a slot."""
    return SPLIT_K * max_tokens * max_width


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@functools.cache
def _kernels() -> Any:
    try:
        import triton.language as tl
        from triton import jit
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        return None

    @jit
    def lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, u_ptr, num_tokens, in_features, width, k_per_split, x_stride,
               NR_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NR: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL: tl.constexpr):  # fmt: skip
        s = tl.program_id(0) // NR_BLOCKS  # the slot
        rc = (tl.program_id(0) % NR_BLOCKS) * BLOCK_NR + tl.arange(0, BLOCK_NR)  # its rank columns
        split = tl.program_id(1)
        rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_in = rm < num_tokens
        # The slot index is written before the step (not by the kernel before): read before the wait.
        mine = (tl.load(slots_ptr + rm, mask=m_in, other=0) == s + 1) & m_in
        used = tl.sum(mine.to(tl.int32), axis=0) > 0
        c_in = rc < width
        k_lo = split * k_per_split
        k_hi = tl.where(used, tl.minimum(k_lo + k_per_split, in_features), k_lo)  # nothing to read: unused
        a_rows = a_ptr + (s * width + rc)[:, None].to(tl.int64) * in_features
        a = tl.load(a_rows + k_lo + rk[None, :], mask=c_in[:, None] & (k_lo + rk < k_hi)[None, :], other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        if used:
            x_rows = x_ptr + rm[:, None].to(tl.int64) * x_stride
            acc = tl.zeros((BLOCK_M, BLOCK_NR), tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k_in = k0 + rk < k_hi
                if k0 > k_lo:
                    a = tl.load(a_rows + k0 + rk[None, :], mask=c_in[:, None] & k_in[None, :], other=0.0)
                x = tl.load(x_rows + k0 + rk[None, :], mask=mine[:, None] & k_in[None, :], other=0.0)
                acc += tl.dot(x, tl.trans(a))
            u = u_ptr + (split * num_tokens + rm)[:, None].to(tl.int64) * width + rc[None, :]
            tl.store(u, acc, mask=mine[:, None] & c_in[None, :])

    @jit
    def lora_expand_kernel(u_ptr, b_ptr, slots_ptr, y_ptr, num_tokens, out_features, end0, end1, rank, width,
               num_splits, y_stride, NUM_SLOTS: tl.constexpr, GROUP: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        n0 = tl.program_id(0) * BLOCK_N
        rn = n0 + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rr = tl.arange(0, BLOCK_R)
        rsplit = tl.arange(0, SPLIT_CHUNK)
        # The rank columns of a group of GROUP slots, slot by slot: one product for the group.
        rk = tl.arange(0, GROUP * BLOCK_R)
        k_slot, k_r = rk // BLOCK_R, rk % BLOCK_R
        m_in = rm < num_tokens
        n_in = rn < out_features
        slots = tl.load(slots_ptr + rm, mask=m_in, other=0)
        adapted = (slots > 0) & (slots <= NUM_SLOTS) & m_in
        # The fused modules (q, k, v; gate, up) the block's columns fall in: end0 and end1 are
        # where the first and second end (the output's end when there are fewer).
        last = tl.minimum(n0 + BLOCK_N, out_features) - 1
        j_lo = (n0 >= end0).to(tl.int32) + (n0 >= end1).to(tl.int32)
        j_hi = (last >= end0).to(tl.int32) + (last >= end1).to(tl.int32)
        # B's first tile (module j_lo, the first group of slots: usually the only one) does not
        # depend on the kernels before: loaded before the wait. Of a tile of B the expand reads
        # module j's output columns [start, stop) and the rank columns of slots some row uses.
        b_rows = b_ptr + rn[:, None].to(tl.int64) * (NUM_SLOTS * width) + k_slot[None, :] * width + k_r[None, :]
        start = tl.where(j_lo == 0, 0, tl.where(j_lo == 1, end0, end1))
        stop = tl.where(j_lo == 0, end0, tl.where(j_lo == 1, end1, out_features))
        used = tl.max((slots[:, None] == (k_slot + 1)[None, :]).to(tl.int32), axis=0) > 0
        k_in = used & (k_r < rank) & (k_slot < NUM_SLOTS)
        b_first = tl.load(b_rows + j_lo * rank, mask=((rn >= start) & (rn < stop))[:, None] & k_in[None, :], other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        if tl.sum(adapted.to(tl.int32), axis=0) > 0:
            y = y_ptr + rm[:, None].to(tl.int64) * y_stride + rn[None, :]
            y_in = adapted[:, None] & n_in[None, :]
            y_old = tl.load(y, mask=y_in, other=0.0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for j in range(j_lo, j_hi + 1):
                start = tl.where(j == 0, 0, tl.where(j == 1, end0, end1))
                stop = tl.where(j == 0, end0, tl.where(j == 1, end1, out_features))
                cols = (rn >= start) & (rn < stop)
                # Module j's R columns of each row's u: the shrink's K splits summed, SPLIT_CHUNK
                # of them a load.
                u_rows = u_ptr + rm[None, :, None].to(tl.int64) * width + j * rank + rr[None, None, :]
                u_in = adapted[None, :, None] & (rr < rank)[None, None, :]
                u = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
                for s0 in range(0, num_splits, SPLIT_CHUNK):
                    sp = s0 + rsplit
                    part = tl.load(u_rows + (sp * num_tokens * width)[:, None, None],
                                   mask=u_in & (sp < num_splits)[:, None, None], other=0.0)  # fmt: skip
                    u += tl.sum(part, axis=0)
                # Each row's u repeated for every slot of a group; `mine` keeps its own slot's.
                u_group = tl.reshape(tl.broadcast_to(u[:, None, :], (BLOCK_M, GROUP, BLOCK_R)),
                                     (BLOCK_M, GROUP * BLOCK_R))  # fmt: skip
                for g0 in range(0, NUM_SLOTS, GROUP):
                    mine = slots[:, None] == (g0 + k_slot + 1)[None, :]  # [BLOCK_M, GROUP * BLOCK_R]
                    used = tl.max(mine.to(tl.int32), axis=0) > 0
                    if tl.sum(used.to(tl.int32), axis=0) > 0:
                        if (j == j_lo) & (g0 == 0):
                            b = b_first
                        else:
                            k_in = used & (k_r < rank) & (g0 + k_slot < NUM_SLOTS)
                            b = tl.load(b_rows + g0 * width + j * rank, mask=cols[:, None] & k_in[None, :], other=0.0)
                        acc += tl.dot(tl.where(mine, u_group, 0.0), tl.trans(b.to(tl.float32)), input_precision="tf32")
            tl.store(y, (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_in)

    return lora_shrink_kernel, lora_expand_kernel


def add_lora(x: Tensor, y: Tensor, a: Tensor, b: Tensor, token_slots: Tensor, num_slots: int, rank: int,
             outs: tuple[int, ...], partials: Tensor) -> Tensor:  # fmt: skip
    """`y` [T, out] += each row's adapter delta, in place; returns `y`.

    x [T, in]; a [S * n * R, in] and b [out, S * n * R] (`LoRAStack`'s layout: slot s's module j
    holds A's rows and B's columns s n R + j R .. + R, B's for module j's output rows);
    token_slots int64 [T] (0: base model, s + 1: slot s); outs: the n fused modules' output rows;
    partials: float32 scratch of at least `partials_numel(T, n * R)` elements (one buffer for
    every call: the kernels of one call run before the next's)."""
    shrink, expand = _kernels()
    t, in_f = x.shape
    out_f, width = y.shape[1], len(outs) * rank
    if x.stride(1) != 1 or y.stride(1) != 1 or not a.is_contiguous() or not b.is_contiguous() or len(outs) > 3:
        raise ValueError(f"add_lora: x {tuple(x.shape)} {x.stride()}, y {tuple(y.shape)} {y.stride()}, "
                         f"{len(outs)} fused modules")  # fmt: skip
    if t == 0:
        return y
    pdl = triton_pdl(x.device)
    block_m = min(MAX_BLOCK_M, _pow2(t))
    m_blocks = _cdiv(t, block_m)
    block_nr = min(MAX_BLOCK_NR, _pow2(width))
    nr_blocks = _cdiv(width, block_nr)
    k_per_split = _cdiv(_cdiv(in_f, SPLIT_K), BLOCK_K) * BLOCK_K
    splits = _cdiv(in_f, k_per_split)
    shrink[(num_slots * nr_blocks, splits, m_blocks)](
        x, a, token_slots, partials, t, in_f, width, k_per_split, x.stride(0), NR_BLOCKS=nr_blocks,
        BLOCK_M=block_m, BLOCK_NR=block_nr, BLOCK_K=BLOCK_K, num_warps=8 if block_m > 32 else 4, **pdl,
    )  # fmt: skip
    ends = [sum(outs[: j + 1]) for j in range(len(outs))][:-1] + [out_f] * (4 - len(outs))
    # Register tiles of at most TILE_ELEMENTS (B's, the partials'), rows a block fewer for larger
    # ranks (64 up to rank 32, 32 at rank 64, 16 above): compiled for sm_90 they spill nothing.
    block_r = _pow2(rank)
    group = min(_pow2(num_slots, 1), max(1, EXPAND_GROUP_COLUMNS // block_r))
    block_m = max(16, min(block_m, TILE_ELEMENTS // block_r // 4))
    m_blocks = _cdiv(t, block_m)
    # 64 output columns a block, 128 where that would make more than two blocks an SM.
    block_n = 64 if _cdiv(out_f, 64) * m_blocks <= 2 * _sm_count(x.device) else 128
    block_n = max(16, min(block_n, TILE_ELEMENTS // (group * block_r)))
    chunk = min(_pow2(splits, 1), _floor_pow2(max(1, TILE_ELEMENTS // (block_m * block_r))))
    expand[(_cdiv(out_f, block_n), m_blocks)](
        partials, b, token_slots, y, t, out_f, ends[0], ends[1], rank, width, splits, y.stride(0),
        NUM_SLOTS=num_slots, GROUP=group, SPLIT_CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        num_warps=8, num_stages=1, **pdl,
    )  # fmt: skip
    return y
