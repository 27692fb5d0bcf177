"""FP8 (e4m3) numerics: weight quantization, per-token activation quantization, the scaled GEMM.

Weights are float8_e4m3fn [N, K] with one float32 scale per output row (`w ~= w_q * scale[:, None]`):
per-tensor checkpoint scales are expanded to rows at load, which is exact, so one GEMM serves
every format. Activations are quantized per token (row) at run time, unless the checkpoint gives
a static per-tensor input scale. On CUDA the product is `torch._scaled_mm` with row-wise scales
(cuBLASLt / CUTLASS): `out[m, n] = sum_k x_q[m, k] w_q[n, k] * x_scale[m] * w_scale[n]`, the
scales applied in the GEMM's epilogue, no host sync, so a CUDA graph can hold it. Up to
`SMALL_M` rows (decode) cuBLASLt's row-wise kernels are no faster than bfloat16 on an H100 (8B o
projection at 1 row: 15 us against 10.5), so there FlashInfer's `bmm_fp8` (per-tensor scales, 6.4
us) runs with unit scales and one Triton kernel applies both scales (and the bias) to its bfloat16
output in place.

One bfloat16 row (a decode step of one sequence) takes neither: `fp8_weight_gemv` multiplies the
row as it is by the FP8 weights widened in registers, the channel scales after its loop, so no
kernel quantizes before it or scales after it; for gate_up it writes silu(gate) * up. At one row a
GEMM is a weight read, and the GEMV takes 1.06-1.58x the weight read at the copy rate (H100, the
8B's and the 70B's per-rank shapes at TP 2 and 4; fp8_bench's gemv table) where quantize + bmm_fp8
+ scale took 1.10-2.26x.

Around the GEMMs, where Triton is installed (`fused_kernels`), the small kernels a layer would
run one after another on a GPU are one each: (add +) RMSNorm writes its rows already quantized for
the FP8 projection after it (`add_rmsnorm_quant`), SiLU-and-mul likewise (`silu_and_mul_quant`),
and an FP8 projection up to `SMALL_M` rows may leave its scales to the kernel that reads its output
(`UnscaledRows`): o_proj's and down_proj's go into the next add + RMSNorm, gate_up's into
SiLU-and-mul. Above one row that is 6 kernels fewer a Llama layer.

On a CPU nothing here runs at inference: FP8 weights are dequantized to the compute dtype at load.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from flashserve.layers.pdl import triton_pdl

Tensor = torch.Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Smallest scale: an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# Compute capability of the first GPUs with FP8 tensor cores (Ada, then Hopper).
MIN_FP8_CAPABILITY = (8, 9)


def to_fp8(x: Tensor) -> Tensor:
    """Saturating cast: torch's cast turns values beyond +-448 into NaN (e4m3fn has no inf)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] (any float dtype) -> (float8 [N, K], float32 scale [N]): each row's absmax
    maps to 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(w / scale[:, None]), scale


def dequantize_weight(weight: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """float8 [N, K] and float32 scale [N] -> [N, K] in `dtype` (multiplied in float32)."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def quantize_rows_torch(x: Tensor, scale_ub: float | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scale [M, 1]), one scale per row (token). `scale_ub`:
    an upper bound on a row's absmax (fbgemm's activation_scale_ub), beyond which values saturate."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return to_fp8(xf / scale), scale


def quantize_static(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] with a static per-tensor scale (float32 []) -> (float8 [M, K], scale [M, 1])."""
    return to_fp8(x.float() / scale), scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


@functools.cache
def _triton_quantize_rows() -> Any:
    """One fused kernel for per-token quantization (absmax, scale, cast), or None without Triton.
    The eager torch version is five kernels a projection: 600 launches a step for an 8B model."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, ub, HAS_UB: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        if HAS_UB:
            amax = tl.minimum(amax, ub)
        scale = tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * n_cols + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)

    def run(x: Tensor, scale_ub: float | None) -> tuple[Tensor, Tensor]:
        m, k = x.shape
        q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        if m:
            block = triton.next_power_of_2(k)
            warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
            quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), scale_ub or 0.0, HAS_UB=scale_ub is not None,
                                       BLOCK=block, num_warps=warps)
        return q, s

    return run


def quantize_rows(x: Tensor, scale_ub: float | None = None) -> tuple[Tensor, Tensor]:
    """`quantize_rows_torch`, as one Triton kernel on CUDA where Triton is installed."""
    fused = _triton_quantize_rows() if x.is_cuda and x.stride(-1) == 1 else None
    return fused(x, scale_ub) if fused is not None else quantize_rows_torch(x, scale_ub)


# Rows up to which bmm_fp8 + the scaling kernel runs (H100, fp8_bench's gemm table: bmm_fp8 alone is
# faster than row-wise _scaled_mm on every 8B projection up to 512 rows, but the scaling kernel's
# pass over [M, N] grows with M; by memory traffic it eats the gain on gate_up and qkv at 256 rows
# and about matches it on gate_up at 128. The bench's epilogue_us column measures it).
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
def _triton_scale_rows_cols() -> Any:
    """One kernel: y[m, n] = y[m, n] * x_scale[m] * w_scale[n] (+ bias[n]) in place, or None."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def scale_rows_cols_kernel(y_ptr, xs_ptr, ws_ptr, b_ptr, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * tl.load(xs_ptr + row) * tl.load(ws_ptr + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    def run(y: Tensor, xs: Tensor, ws: Tensor, bias: Tensor | None) -> Tensor:
        m, n = y.shape
        if m:
            block = 1024
            scale_rows_cols_kernel[(m, triton.cdiv(n, block))](y, xs, ws, bias if bias is not None else y, n,
                                               HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
        return y

    return run


def scale_rows_cols(y: Tensor, xs: Tensor, ws: Tensor, bias: Tensor | None) -> Tensor:
    """y [M, N] (contiguous) * xs [M, 1] * ws [1, N] (+ bias [N]), multiplied in float32, in y's dtype."""
    fused = _triton_scale_rows_cols() if y.is_cuda else None
    if fused is not None:
        return fused(y, xs, ws.reshape(-1), bias)
    out = y.float() * xs * ws.reshape(1, -1)
    return (out + bias.float() if bias is not None else out).to(y.dtype)


class QuantizedRows(NamedTuple):
    """An activation quantized for an FP8 projection: float8 `q` [M, K], float32 `scale` [M, 1]
    (`q * scale` ~ the activation), as `quantize_rows` or a fused kernel wrote it."""

    q: Tensor
    scale: Tensor


class UnscaledRows(NamedTuple):
    """An FP8 projection's output before its scales: `y * row_scale * col_scale (+ bias)`, y
    bfloat16 [M, N] (bmm_fp8's unit-scale product), row_scale [M, 1], col_scale [1, N], bias [N]."""

    y: Tensor
    row_scale: Tensor
    col_scale: Tensor
    bias: Tensor | None

    def scaled(self) -> Tensor:
        """The output, scaled in place of `y`."""
        return scale_rows_cols(self.y, self.row_scale, self.col_scale, self.bias)


# Widest row the fused kernels hold in registers at once (one program a row, one pass over it).
FUSED_MAX_COLS = 32768


@functools.cache
def _triton() -> Any:
    try:
        import triton
    except ImportError:
        return None
    return triton


def fused_kernels(x: Tensor) -> bool:
    """Whether the fused norm / activation kernels run for `x` (CUDA, Triton installed)."""
    return x.is_cuda and _triton() is not None


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16 if block <= 16384 else 32


@functools.cache
def _norm_quant_kernel() -> Any:
    """y = RMSNorm(residual (+= x)) * w, written quantized (per-token or static scale) or in the
    residual's dtype; x may come with an FP8 GEMM's scales (and bias) still to apply."""
    import triton.language as tl
    from triton import jit

    @jit
    def norm_quant_kernel(x_ptr, xs_ptr, ws_ptr, b_ptr, res_ptr, w_ptr, out_ptr, s_ptr, static_ptr, n_cols, eps, ub,
               HAS_X: tl.constexpr, X_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT: tl.constexpr,
               STATIC: tl.constexpr, HAS_UB: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        r = tl.load(res_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_X:
            x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
            if X_SCALED:
                x = x * tl.load(xs_ptr + row) * tl.load(ws_ptr + offs, mask=mask, other=0.0)
                if HAS_BIAS:
                    x += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # The residual stream stays in the model dtype: the norm reads what is stored.
            r16 = (r + x).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * n_cols + offs, r16, mask=mask)
            r = r16.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / n_cols + eps)
        y = r * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if QUANT:
            if STATIC:
                scale = tl.load(static_ptr)
            else:
                amax = tl.max(tl.abs(y), axis=0)
                if HAS_UB:
                    amax = tl.minimum(amax, ub)
                scale = tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))
            q = tl.clamp(y / scale, -448.0, 448.0)
            tl.store(out_ptr + row * n_cols + offs, q.to(tl.float8e4nv), mask=mask)
            tl.store(s_ptr + row, scale)
        else:
            tl.store(out_ptr + row * n_cols + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    return norm_quant_kernel


def add_rmsnorm_quant(
    x: Tensor | UnscaledRows | None, residual: Tensor, weight: Tensor, eps: float, quantize: bool = True,
    input_scale: Tensor | None = None, input_scale_ub: float | None = None,
) -> tuple[Tensor | QuantizedRows, Tensor]:  # fmt: skip
    """One kernel (CUDA, `fused_kernels`): residual += x (x's FP8 scales applied first when it is
    `UnscaledRows`; None: nothing added, residual untouched), then RMSNorm(residual) * weight in
    float32, returned as `QuantizedRows` for an FP8 projection (per token, bounded by
    `input_scale_ub`, or with the static `input_scale`), or with `quantize=False` in the residual's
    dtype. Returns (that, residual); residual [M, H] contiguous, updated in place."""
    m, n = residual.shape
    if n > FUSED_MAX_COLS:
        raise ValueError(f"add_rmsnorm_quant takes rows of up to {FUSED_MAX_COLS} values, not {n}")
    scaled = isinstance(x, UnscaledRows)
    raw = x.y if isinstance(x, UnscaledRows) else x
    if raw is not None and (raw.shape != residual.shape or not raw.is_contiguous()):
        raise ValueError(f"add_rmsnorm_quant: x {tuple(raw.shape)} must be contiguous, like the residual {(m, n)}")
    if quantize:
        out = torch.empty((m, n), dtype=FP8_DTYPE, device=residual.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=residual.device)
    else:
        out, s = torch.empty_like(residual), residual
    if m:
        block = _triton().next_power_of_2(n)
        xs, ws, bias = (x.row_scale, x.col_scale, x.bias) if isinstance(x, UnscaledRows) else (None, None, None)
        _norm_quant_kernel()[(m,)](
            raw if raw is not None else residual, xs if xs is not None else residual,
            ws if ws is not None else residual, bias if bias is not None else residual, residual, weight, out, s,
            input_scale if input_scale is not None else s, n, eps, input_scale_ub or 0.0,
            HAS_X=raw is not None, X_SCALED=scaled, HAS_BIAS=bias is not None, QUANT=quantize,
            STATIC=input_scale is not None, HAS_UB=input_scale_ub is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return (QuantizedRows(out, s) if quantize else out), residual


@functools.cache
def _silu_mul_quant_kernel() -> Any:
    """q = quantize(silu(gate) * up) per token (or with a static scale), gate|up one row of x, which
    may come with an FP8 GEMM's scales (and bias) still to apply."""
    import triton.language as tl
    from triton import jit

    @jit
    def silu_mul_quant_kernel(x_ptr, xs_ptr, ws_ptr, b_ptr, q_ptr, s_ptr, static_ptr, inter, ub, X_SCALED: tl.constexpr,
               HAS_BIAS: tl.constexpr, STATIC: tl.constexpr, HAS_UB: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < inter
        g = tl.load(x_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
        if X_SCALED:
            xs = tl.load(xs_ptr + row)
            g = g * xs * tl.load(ws_ptr + offs, mask=mask, other=0.0)
            u = u * xs * tl.load(ws_ptr + inter + offs, mask=mask, other=0.0)
            if HAS_BIAS:
                g += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                u += tl.load(b_ptr + inter + offs, mask=mask, other=0.0).to(tl.float32)
        h = g / (1.0 + tl.exp(-g)) * u
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.max(tl.abs(h), axis=0)
            if HAS_UB:
                amax = tl.minimum(amax, ub)
            scale = tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))
        q = tl.clamp(h / scale, -448.0, 448.0)
        tl.store(q_ptr + row * inter + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + row, scale)

    return silu_mul_quant_kernel


def silu_and_mul_quant(
    x: Tensor | UnscaledRows, input_scale: Tensor | None = None, input_scale_ub: float | None = None
) -> QuantizedRows:
    """One kernel (CUDA, `fused_kernels`): silu(x[:, :I]) * x[:, I:] in float32, quantized for an FP8
    projection (per token, bounded by `input_scale_ub`, or with the static `input_scale`). x [M, 2I]
    contiguous, or `UnscaledRows` whose scales (and bias) are applied first."""
    raw = x.y if isinstance(x, UnscaledRows) else x
    m, two_i = raw.shape
    inter = two_i // 2
    if inter > FUSED_MAX_COLS or not raw.is_contiguous():
        raise ValueError(f"silu_and_mul_quant takes contiguous rows of up to 2 x {FUSED_MAX_COLS} values")
    q = torch.empty((m, inter), dtype=FP8_DTYPE, device=raw.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=raw.device)
    if m:
        block = _triton().next_power_of_2(inter)
        xs, ws, bias = (x.row_scale, x.col_scale, x.bias) if isinstance(x, UnscaledRows) else (None, None, None)
        _silu_mul_quant_kernel()[(m,)](
            raw, xs if xs is not None else s, ws if ws is not None else s, bias if bias is not None else raw, q, s,
            input_scale if input_scale is not None else s, inter, input_scale_ub or 0.0,
            X_SCALED=isinstance(x, UnscaledRows), HAS_BIAS=bias is not None, STATIC=input_scale is not None,
            HAS_UB=input_scale_ub is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return QuantizedRows(q, s)


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
    _weight_gemv_kernel()[(_triton().cdiv(n_out, block_n),)](
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
    bfloat16 model's kernels: the output is bfloat16). Up to SMALL_M rows FlashInfer's bmm_fp8 and
    the scaling kernel, above it row-wise `_scaled_mm`; both write bfloat16, and another activation
    dtype is cast back. `defer_scales`: up to SMALL_M rows, return bmm_fp8's product as
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
    if 0 < xq.shape[0] <= SMALL_M and xq.is_cuda and _bmm_fp8() is not None:
        unscaled = UnscaledRows(_bmm_fp8_unscaled(xq, weight), xs, weight_scale, bias)
        if defer_scales and dtype == torch.bfloat16 and len(shape) == 2:
            return unscaled
        out = unscaled.scaled()
    else:
        out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale, out_dtype=torch.bfloat16)
        if bias is not None:
            out = out + bias
    if out.dtype != dtype:
        out = out.to(dtype)
    return out.view(*shape[:-1], weight.shape[0])


def check_fp8_device(device: torch.device) -> None:
    """Raises ValueError where FP8 GEMMs cannot run: a GPU before compute capability 8.9."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper) for FP8 "
                         f"GEMMs; {name} is {capability[0]}.{capability[1]}: serve a bfloat16 checkpoint")
