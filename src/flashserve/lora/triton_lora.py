"""The adapters' delta of a decode-sized step on a GPU: Triton kernels after Punica's shrink and expand.

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

Where the shrink is part of the projection's GEMM (`LoRAStack.fuse_shrink`: dense weights), that
GEMM's output y_ext [T, out + S nR (+ padding)] holds y and every slot's u, and one kernel is left:
`add_lora_fused`, the expand reading row t's slot's u columns of y_ext (one "split", a slot
stride) and writing y + delta for every row into a fresh tensor (base rows: y's values), or, for
gate_up, `add_lora_fused_silu`: the columns c of gate and c + inter of up each with its delta,
written as silu(gate) * up, the model's SiLU-and-mul in the same kernel. H200, 8B, 1..32 rows,
one adapter of rank 16, from CUDA graphs: that expand 2-3 us (qkv, o, down), the SiLU one
4.4-5.4 us for gate_up, where the expand alone and the model's SiLU-and-mul took 8.2-11.

Slots no row of a block uses are not read (a step over one adapter reads one slot of A and B),
rows of the base model (slot index 0) are neither read nor written in place (`add_lora`). The
slot index is read on the device from `LoRAStack`'s persistent buffer, so there is no host sync
and a CUDA graph replays with any step's slots. The shrink's product runs in the model dtype
with a float32 accumulator, the expand's in TF32 (the shrink's u keeps 10 mantissa bits where the
masked path and the GEMM's u round it to bfloat16's 7); y is read and written once, in its dtype.

The kernels launch with PDL on Hopper (`layers/pdl.py`) and read the slot index and their first
tile of weights (A's, B's) before waiting for the kernel before them (which writes x, y or the
partials). The expand's tiles: 64 output columns a block (128 where that makes more than two
blocks an SM) and 4 warps up to rank 32, 8 above; on an H200 at rank 16 this was the fastest of
32-256 columns and 2-8 warps, within 0.3 us, except gate_up (28,672 columns), where 8 warps took
6.4 us against 4.6.
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
    def lora_expand_kernel(u_ptr, b_ptr, slots_ptr, y_ptr, o_ptr, num_tokens, out_features, end0, end1, rank, width,
               num_splits, u_split_stride, u_row_stride, u_slot_stride, y_stride, o_stride, NUM_SLOTS: tl.constexpr,
               GROUP: tl.constexpr, SPLIT_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_R: tl.constexpr, EVERY_ROW: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
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
        # The rows written: the adapted ones (in place), or every row (y into the fresh output o).
        y_in = (m_in if EVERY_ROW else adapted)[:, None] & n_in[None, :]
        y_old = tl.load(y_ptr + rm[:, None].to(tl.int64) * y_stride + rn[None, :], mask=y_in, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if tl.sum(adapted.to(tl.int32), axis=0) > 0:
            for j in range(j_lo, j_hi + 1):
                start = tl.where(j == 0, 0, tl.where(j == 1, end0, end1))
                stop = tl.where(j == 0, end0, tl.where(j == 1, end1, out_features))
                cols = (rn >= start) & (rn < stop)
                # Module j's R columns of each row's u (of its slot's columns where u holds every
                # slot's): the shrink's K splits summed, SPLIT_CHUNK of them a load.
                own = tl.where(adapted, slots - 1, 0).to(tl.int64) * u_slot_stride
                u_rows = u_ptr + (rm.to(tl.int64) * u_row_stride + own)[None, :, None] + j * rank + rr[None, None, :]
                u_in = adapted[None, :, None] & (rr < rank)[None, None, :]
                u = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
                for s0 in range(0, num_splits, SPLIT_CHUNK):
                    sp = s0 + rsplit
                    part = tl.load(u_rows + (sp.to(tl.int64) * u_split_stride)[:, None, None],
                                   mask=u_in & (sp < num_splits)[:, None, None], other=0.0)  # fmt: skip
                    u += tl.sum(part.to(tl.float32), axis=0)
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
        o = o_ptr + rm[:, None].to(tl.int64) * o_stride + rn[None, :]
        tl.store(o, (y_old.to(tl.float32) + acc).to(o_ptr.dtype.element_ty), mask=y_in)

    @jit
    def lora_expand_silu_kernel(y_ptr, b_ptr, slots_ptr, o_ptr, num_tokens, inter, rank, width, y_stride, o_stride,
               NUM_SLOTS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_R: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        # Columns rn of gate and rn + inter of up, each with its row's delta, into silu(gate) * up.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rr = tl.arange(0, BLOCK_R)
        rk = tl.arange(0, GROUP * BLOCK_R)
        k_slot, k_r = rk // BLOCK_R, rk % BLOCK_R
        m_in = rm < num_tokens
        n_in = rn < inter
        slots = tl.load(slots_ptr + rm, mask=m_in, other=0)
        adapted = (slots > 0) & (slots <= NUM_SLOTS) & m_in
        # B's rows of gate (rn) and up (rn + inter), the first group of slots, before the wait.
        b_gate = b_ptr + rn[:, None].to(tl.int64) * (NUM_SLOTS * width) + k_slot[None, :] * width + k_r[None, :]
        b_up = b_gate + inter.to(tl.int64) * (NUM_SLOTS * width) + rank
        used = tl.max((slots[:, None] == (k_slot + 1)[None, :]).to(tl.int32), axis=0) > 0
        b_in = n_in[:, None] & (used & (k_r < rank) & (k_slot < NUM_SLOTS))[None, :]
        bg_first = tl.load(b_gate, mask=b_in, other=0.0)
        bu_first = tl.load(b_up, mask=b_in, other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        io = m_in[:, None] & n_in[None, :]
        rows = y_ptr + rm[:, None].to(tl.int64) * y_stride
        gate = tl.load(rows + rn[None, :], mask=io, other=0.0).to(tl.float32)
        up = tl.load(rows + inter + rn[None, :], mask=io, other=0.0).to(tl.float32)
        if tl.sum(adapted.to(tl.int32), axis=0) > 0:
            # Each row's slot's shrink columns, after the 2 inter outputs: gate's R, then up's R.
            u_row = y_ptr + rm.to(tl.int64) * y_stride + 2 * inter + tl.where(adapted, slots - 1, 0).to(tl.int64) * width
            u_in = adapted[:, None] & (rr < rank)[None, :]
            u_gate = tl.load(u_row[:, None] + rr[None, :], mask=u_in, other=0.0).to(tl.float32)
            u_up = tl.load(u_row[:, None] + rank + rr[None, :], mask=u_in, other=0.0).to(tl.float32)
            ug = tl.reshape(tl.broadcast_to(u_gate[:, None, :], (BLOCK_M, GROUP, BLOCK_R)), (BLOCK_M, GROUP * BLOCK_R))
            uu = tl.reshape(tl.broadcast_to(u_up[:, None, :], (BLOCK_M, GROUP, BLOCK_R)), (BLOCK_M, GROUP * BLOCK_R))
            for g0 in range(0, NUM_SLOTS, GROUP):
                mine = slots[:, None] == (g0 + k_slot + 1)[None, :]
                used = tl.max(mine.to(tl.int32), axis=0) > 0
                if tl.sum(used.to(tl.int32), axis=0) > 0:
                    if g0 == 0:
                        bg, bu = bg_first, bu_first
                    else:
                        b_in = n_in[:, None] & (used & (k_r < rank) & (g0 + k_slot < NUM_SLOTS))[None, :]
                        bg = tl.load(b_gate + g0 * width, mask=b_in, other=0.0)
                        bu = tl.load(b_up + g0 * width, mask=b_in, other=0.0)
                    gate += tl.dot(tl.where(mine, ug, 0.0), tl.trans(bg.to(tl.float32)), input_precision="tf32")
                    up += tl.dot(tl.where(mine, uu, 0.0), tl.trans(bu.to(tl.float32)), input_precision="tf32")
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(o_ptr + rm[:, None].to(tl.int64) * o_stride + rn[None, :], act.to(o_ptr.dtype.element_ty), mask=io)

    return lora_shrink_kernel, lora_expand_kernel, lora_expand_silu_kernel


def add_lora(x: Tensor, y: Tensor, a: Tensor, b: Tensor, token_slots: Tensor, num_slots: int, rank: int,
             outs: tuple[int, ...], partials: Tensor) -> Tensor:  # fmt: skip
    """`y` [T, out] += each row's adapter delta, in place; returns `y`.

    x [T, in]; a [S * n * R, in] and b [out, S * n * R] (`LoRAStack`'s layout: slot s's module j
    holds A's rows and B's columns s n R + j R .. + R, B's for module j's output rows);
    token_slots int64 [T] (0: base model, s + 1: slot s); outs: the n fused modules' output rows;
    partials: float32 scratch of at least `partials_numel(T, n * R)` elements (one buffer for
    every call: the kernels of one call run before the next's)."""
    shrink = _kernels()[0]
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
    _expand(partials, splits, t * width, width, 0, b, token_slots, y, y, num_slots, rank, outs, every_row=False)
    return y


def add_lora_fused(y_ext: Tensor, out_features: int, b: Tensor, token_slots: Tensor, num_slots: int, rank: int,
                   outs: tuple[int, ...], tiles: tuple[int, int] | None = None) -> Tensor:  # fmt: skip
    """The projection's output plus each row's adapter delta, a fresh [T, out] tensor, from `y_ext`
    [T, out + S * n * R]: the product of x with the projection's weight and every slot's A stacked
    under it (`LoRAStack.fuse_shrink`), so that its last S n R columns are every slot's shrink. One
    kernel: the expand of each row's own slot's columns, added to the first `out_features`. `tiles`:
    (output columns a block, warps) in place of `_expand`'s choice (lora_bench's search)."""
    t = y_ext.shape[0]
    width = len(outs) * rank
    if y_ext.stride(1) != 1 or not b.is_contiguous() or len(outs) > 3 or y_ext.shape[1] < out_features + num_slots * width:
        raise ValueError(f"add_lora_fused: y_ext {tuple(y_ext.shape)} {y_ext.stride()}, {out_features} outputs, "
                         f"{num_slots} slots of {len(outs)} x {rank}")  # fmt: skip
    out = y_ext.new_empty(t, out_features)
    if t:
        u = y_ext[:, out_features:]
        _expand(u, 1, 0, y_ext.stride(0), width, b, token_slots, y_ext, out, num_slots, rank, outs, every_row=True,
                tiles=tiles)  # fmt: skip
    return out


def add_lora_fused_silu(y_ext: Tensor, inter: int, b: Tensor, token_slots: Tensor, num_slots: int, rank: int,
                        tiles: tuple[int, int] | None = None) -> Tensor:  # fmt: skip
    """`add_lora_fused` of a gate_up projection followed by SiLU-and-mul, in one kernel: from
    `y_ext` [T, 2 inter + S * 2R] (gate's outputs, up's, every slot's shrink of gate then up),
    silu(gate + its delta) * (up + its delta), a fresh [T, inter] tensor."""
    t = y_ext.shape[0]
    width = 2 * rank
    if y_ext.stride(1) != 1 or not b.is_contiguous() or y_ext.shape[1] < 2 * inter + num_slots * width:
        raise ValueError(f"add_lora_fused_silu: y_ext {tuple(y_ext.shape)} {y_ext.stride()}, {inter} x 2 outputs, "
                         f"{num_slots} slots of 2 x {rank}")  # fmt: skip
    out = y_ext.new_empty(t, inter)
    if t == 0:
        return out
    block_r, group, block_m, warps = _expand_tiles(t, rank, num_slots)
    block_n, warps = tiles or (max(16, min(64, TILE_ELEMENTS // (group * block_r))), warps)
    _kernels()[2][(_cdiv(inter, block_n), _cdiv(t, block_m))](
        y_ext, b, token_slots, out, t, inter, rank, width, y_ext.stride(0), out.stride(0), NUM_SLOTS=num_slots,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=warps, num_stages=1,
        **triton_pdl(out.device),
    )  # fmt: skip
    return out


def _expand_tiles(t: int, rank: int, num_slots: int) -> tuple[int, int, int, int]:
    """An expand kernel's (BLOCK_R, GROUP, BLOCK_M, warps) for `t` rows: register tiles of at most
    TILE_ELEMENTS (B's, u's), rows a block fewer for larger ranks (64 up to rank 32, 32 at rank 64,
    16 above); 4 warps a block (faster than 8 for rank 16 on an H200: lora_bench's search), 8 above
    rank 32."""
    block_r = _pow2(rank)
    group = min(_pow2(num_slots, 1), max(1, EXPAND_GROUP_COLUMNS // block_r))
    block_m = max(16, min(MAX_BLOCK_M, _pow2(t), TILE_ELEMENTS // block_r // 4))
    return block_r, group, block_m, 4 if block_r <= 32 else 8


def _expand(u: Tensor, splits: int, split_stride: int, row_stride: int, slot_stride: int, b: Tensor,
            token_slots: Tensor, y: Tensor, out: Tensor, num_slots: int, rank: int, outs: tuple[int, ...],
            every_row: bool, tiles: tuple[int, int] | None = None) -> None:  # fmt: skip
    """out[t, :] = y[t, :out] + u's rank columns of row t's slot @ B's (module by module); u's
    row t, split k, slot s start at t row_stride + k split_stride + s slot_stride."""
    expand = _kernels()[1]
    t, out_f = out.shape
    ends = [sum(outs[: j + 1]) for j in range(len(outs))][:-1] + [out_f] * (4 - len(outs))
    block_r, group, block_m, warps = _expand_tiles(t, rank, num_slots)
    m_blocks = _cdiv(t, block_m)
    # 64 output columns a block, 128 where that would make more than two blocks an SM.
    block_n = 64 if _cdiv(out_f, 64) * m_blocks <= 2 * _sm_count(out.device) else 128
    block_n = max(16, min(block_n, TILE_ELEMENTS // (group * block_r)))
    if tiles is not None:
        block_n, warps = tiles
    chunk = min(_pow2(splits, 1), _floor_pow2(max(1, TILE_ELEMENTS // (block_m * block_r))))
    expand[(_cdiv(out_f, block_n), m_blocks)](
        u, b, token_slots, y, out, t, out_f, ends[0], ends[1], rank, len(outs) * rank, splits, split_stride,
        row_stride, slot_stride, y.stride(0), out.stride(0), NUM_SLOTS=num_slots, GROUP=group, SPLIT_CHUNK=chunk,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, EVERY_ROW=every_row, num_warps=warps, num_stages=1,
        **triton_pdl(out.device),
    )  # fmt: skip
