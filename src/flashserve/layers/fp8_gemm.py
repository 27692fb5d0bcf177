"""An FP8 projection's product, by the number of rows: `x @ dequant(w).T` without dequantizing.

On CUDA the product is `torch._scaled_mm` with row-wise scales (cuBLASLt / CUTLASS):
`out[m, n] = sum_k x_q[m, k] w_q[n, k] * x_scale[m] * w_scale[n]`, the scales applied in the GEMM's
epilogue, no host sync, so a CUDA graph can hold it. Up to `SMALL_M` rows (decode) cuBLASLt's
row-wise kernels are no faster than bfloat16 on an H100 (8B o projection at 1 row: 15 us against
10.5), so there FlashInfer's `bmm_fp8` (per-tensor scales, 6.4 us) runs with unit scales and one
Triton kernel applies both scales (and the bias) to its bfloat16 output in place; at any size where
the kernel that reads the output can apply the scales as it reads (`UnscaledRows`), bmm_fp8 runs
too, since it is faster than the row-wise kernels there as well. Only under CUDA-graph
capture, though: `bmm_fp8`'s Python layers (backend checks, its autotuner's lookups) cost about
0.5 ms of host time a call, which a replayed graph never pays but an eager step does on every
projection. An eager step of 128 prefill tokens of the 8B took 65 ms with it (kernels 3.7 ms, the
rest host time; H200, `benchmark.tp_prefill --quantization fp8 --profile-len 128`): eager steps
take `_scaled_mm` at every size.

One bfloat16 row (a decode step of one sequence) takes neither: `fp8_weight_gemv` multiplies the
row as it is by the FP8 weights widened in registers, the channel scales after its loop, so no
kernel quantizes before it or scales after it; for gate_up it writes silu(gate) * up. At one row a
GEMM is a weight read, and the GEMV takes 1.06-1.58x the weight read at the copy rate (H100, the
8B's and the 70B's per-rank shapes at TP 2 and 4; fp8_bench's gemv table) where quantize + bmm_fp8
+ scale took 1.10-2.26x.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from flashserve.layers.fp8 import QuantizedRows, UnscaledRows, quantize_rows, quantize_static, scale_rows_cols
from flashserve.layers.fp8_fused import fused_kernels, triton_module
from flashserve.layers.pdl import triton_pdl

Tensor = torch.Tensor


# Rows up to which bmm_fp8 + the scaling kernel runs (H100, fp8_bench's gemm table: bmm_fp8 alone is
# faster than row-wise _scaled_mm on every 8B projection up to 512 rows, but the scaling kernel's
# pass over [M, N] grows with M; by memory traffic it eats the gain on gate_up and qkv at 256 rows
# and about matches it on gate_up at 128. The bench's epilogue_us column measures it). Beyond it
# bmm_fp8 runs where the reader applies the scales (`defer_scales`: o and down on one rank, gate_up
# up to `linear.SILU_DEFER_MAX_ROWS`), which costs no pass of its own: on an H200 the 8B's o,
# gate_up and down took 5-13% less time there than row-wise `_scaled_mm` at 1,024 and 2,048 rows
# (down at 2,048: 162 against 185 us).
SMALL_M = 128


@functools.cache
def _bmm_fp8() -> Any:
    """FlashInfer's FP8 GEMM (cuBLASLt, per-tensor scales), or None without FlashInfer."""
    try:
        from flashinfer import bmm_fp8
    except ImportError:
        return None
    return bmm_fp8


@functools.cache
def _unit_scale(device: torch.device) -> Tensor:
    # Made on the first (eager) call; a tensor filled inside a CUDA graph capture would hold
    # nothing until the graph replays.
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("FP8 GEMM: run the layer eagerly once before capturing a CUDA graph")
    return torch.ones((), dtype=torch.float32, device=device)


@functools.cache
def _weight_gemv_kernel() -> Any:
    """y = x @ (w * w_scale).T (+ bias) for one row x: the fp8 weights widened to float32 tile by
    tile and multiplied on the CUDA cores (at one row a tensor-core tile would be 15/16 padding).
    GATED: w holds gate | up rows (2 N of them); the program takes the same N-block of both and
    writes silu(gate) * up.

    PDL (programmatic dependent launch, `layers/pdl.py`): the kernel may start while the one
    before it still runs. Its first weight tile does not depend on that kernel, so it is loaded
    first; `gdc_wait` then waits for the kernel before (and its writes) before x is read, and
    `gdc_launch_dependents` lets the next kernel start the same way."""
    import triton.language as tl
    from triton import jit
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @jit
    def fp8_weight_gemv_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, n_out, k_cols, GATED: tl.constexpr,
               HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_in = rn < n_out
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * k_cols + rk[None, :]
        up_ptrs = w_ptrs + n_out.to(tl.int64) * k_cols
        k_in = rk < k_cols
        w_in = n_in[:, None] & k_in[None, :]
        w = tl.load(w_ptrs, mask=w_in, other=0.0)
        if GATED:
            up = tl.load(up_ptrs, mask=w_in, other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        x = tl.load(x_ptr + rk, mask=k_in, other=0.0).to(tl.float32)[None, :]
        acc = w.to(tl.float32) * x
        if GATED:
            acc_up = up.to(tl.float32) * x
        for k0 in range(BLOCK_K, k_cols, BLOCK_K):
            k_in = k0 + rk < k_cols
            w_in = n_in[:, None] & k_in[None, :]
            x = tl.load(x_ptr + k0 + rk, mask=k_in, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_ptrs + k0, mask=w_in, other=0.0).to(tl.float32) * x
            if GATED:
                acc_up += tl.load(up_ptrs + k0, mask=w_in, other=0.0).to(tl.float32) * x
        y = tl.sum(acc, axis=1) * tl.load(ws_ptr + rn, mask=n_in, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_in, other=0.0).to(tl.float32)
        if GATED:
            gate_up = tl.sum(acc_up, axis=1) * tl.load(ws_ptr + n_out + rn, mask=n_in, other=0.0)
            if HAS_BIAS:
                gate_up += tl.load(b_ptr + n_out + rn, mask=n_in, other=0.0).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * gate_up
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_in)

    return fp8_weight_gemv_kernel


WeightGemvConfig = tuple[int, int, int]


# (N, K, gated) -> (BLOCK_N, BLOCK_K, warps): the fastest configuration of `fp8_bench
# --sweep` on NVIDIA H100 80GB HBM3 for each per-rank decode shape of Llama-3.1-8B and -70B (TP 1, 2, 4).
_GEMV_TUNED: dict[tuple[int, int, bool], WeightGemvConfig] = {
    (2560, 8192, False): (4, 1024, 4),
    (4096, 4096, False): (8, 1024, 4),
    (4096, 14336, False): (4, 2048, 4),
    (5120, 8192, False): (4, 2048, 4),
    (6144, 4096, False): (4, 512, 2),
    (8192, 2048, False): (4, 512, 2),
    (8192, 4096, False): (16, 512, 4),
    (8192, 7168, False): (4, 1024, 4),
    (8192, 14336, False): (4, 2048, 4),
    (14336, 8192, False): (4, 1024, 4),
    (14336, 8192, True): (4, 1024, 4),
    (28672, 4096, False): (4, 512, 2),
    (28672, 4096, True): (8, 256, 4),
    (28672, 8192, False): (4, 1024, 4),
    (28672, 8192, True): (4, 1024, 4),
}
_GEMV_DEFAULT: WeightGemvConfig = (4, 1024, 4)


def weight_gemv_config(n: int, k: int, gated: bool) -> WeightGemvConfig:
    """(BLOCK_N, BLOCK_K, warps) of `fp8_weight_gemv` for weight [n, k]: the tuned one for
    the shape, else one that was near the best on every tuned shape."""
    return _GEMV_TUNED.get((n, k, gated), _GEMV_DEFAULT)


def takes_weight_gemv(x: Tensor) -> bool:
    """Whether an FP8 projection reads `x` [..., K] unquantized through `fp8_weight_gemv`: one row
    of bfloat16 on a GPU with Triton (a decode step of one sequence; the dtype the other fused
    kernels take and the GPU tests cover)."""
    return x.dtype == torch.bfloat16 and x.numel() == x.shape[-1] > 0 and x.stride(-1) == 1 and fused_kernels(x)


def fp8_weight_gemv(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, gated: bool = False,
    config: WeightGemvConfig | None = None,
) -> Tensor:  # fmt: skip
    """One row x [..., K] @ (weight [N, K] float8 * weight_scale [1, N]).T (+ bias [N]), in x's dtype
    (bfloat16 where a model calls it; float32 runs too, as the interpreter tests do): one Triton
    kernel. The activation is not quantized: the product is the dequantized weights' up to float32
    accumulation order. `gated`: weight holds a gate_up projection's gate | up rows, and the result
    is silu(gate) * up [..., N / 2], computed in float32. `config`: see `weight_gemv_config`."""
    k, n = x.shape[-1], weight.shape[0]
    n_out = n // 2 if gated else n
    if x.numel() != k or weight.shape[1] != k or x.stride(-1) != 1 or (gated and n % 2):
        raise ValueError(f"fp8_weight_gemv: one row of {k} values, not {tuple(x.shape)}, against weight "
                         f"{tuple(weight.shape)} (gated: {gated})")
    y = torch.empty((*x.shape[:-1], n_out), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or weight_gemv_config(n, k, gated)
    _weight_gemv_kernel()[(triton_module().cdiv(n_out, block_n),)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, y, n_out, k, GATED=gated,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **triton_pdl(x.device),
    )  # fmt: skip
    return y


def _bmm_fp8_unscaled(xq: Tensor, weight: Tensor) -> Tensor:
    """`bmm_fp8` with unit scales (weight.t() is the column-major B it asks for): bfloat16 [M, N].
    Both operands must be contiguous: its kernel takes leading dimensions from the sizes."""
    one = _unit_scale(xq.device)
    return _bmm_fp8()(xq[None], weight.t()[None], one, one, torch.bfloat16)[0]


def fp8_gemm_small_m(xq: Tensor, xs: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """xq [M, K] float8 @ weight [N, K] float8 .T with row and channel scales, bfloat16 [M, N]:
    `bmm_fp8` with unit scales, then the scales (and bias) in one kernel."""
    return scale_rows_cols(_bmm_fp8_unscaled(xq, weight), xs, weight_scale, bias)


def fp8_linear(
    x: Tensor | QuantizedRows, weight: Tensor, bias: Tensor | None, weight_scale: Tensor,
    input_scale: Tensor | None, input_scale_ub: float | None = None, defer_scales: bool = False,
) -> Tensor | UnscaledRows:  # fmt: skip
    """x [..., K] @ dequant(weight [N, K] float8, weight_scale [1, N] float32).T + bias.

    One row of a bfloat16 model on a GPU (`takes_weight_gemv`) goes through `fp8_weight_gemv`, which
    multiplies the activation as it is (neither `input_scale` nor `input_scale_ub` applies: no
    activation is quantized). Otherwise activations are quantized per token, or with `input_scale`
    (static, per tensor) when given; `QuantizedRows` [M, K] arrive quantized already (from a
    bfloat16 model's kernels: the output is bfloat16). Under CUDA-graph capture FlashInfer's bmm_fp8
    with unit scales: up to SMALL_M rows always (then the scaling kernel), at any size when the
    scales can be deferred; otherwise row-wise `_scaled_mm`. Both write bfloat16, and another
    activation dtype is cast back. `defer_scales`: under capture, return bmm_fp8's product as
    `UnscaledRows` for a fused kernel to scale as it reads it (a bfloat16 activation only).
    """
    if isinstance(x, Tensor) and takes_weight_gemv(x):
        return fp8_weight_gemv(x, weight, weight_scale, bias)
    if isinstance(x, QuantizedRows):
        xq, xs = x
        shape, dtype = xq.shape, torch.bfloat16
    else:
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_static(x2, input_scale) if input_scale is not None else quantize_rows(x2, input_scale_ub)
    out: Tensor | UnscaledRows
    rows = xq.shape[0]
    deferred = defer_scales and dtype == torch.bfloat16 and len(shape) == 2
    bmm = 0 < rows and (rows <= SMALL_M or deferred) and xq.is_cuda and _bmm_fp8() is not None
    if bmm and not torch.cuda.is_current_stream_capturing():
        _unit_scale(xq.device)  # made by the eager warm-up, for the graphs captured after it
        bmm = False
    if bmm:
        unscaled = UnscaledRows(_bmm_fp8_unscaled(xq, weight), xs, weight_scale, bias)
        if deferred:
            return unscaled
        out = unscaled.scaled()
    else:
        out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale, out_dtype=torch.bfloat16)
        if bias is not None:
            out = out + bias
    if out.dtype != dtype:
        out = out.to(dtype)
    return out.view(*shape[:-1], weight.shape[0])
