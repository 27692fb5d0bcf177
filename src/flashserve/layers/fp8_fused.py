"""The small kernels around FP8 GEMMs, one Triton kernel each where a layer would run several.

Where Triton is installed and the tensors are on a GPU (`fused_kernels`), (add +) RMSNorm writes
its rows already quantized for the FP8 projection after it (`add_rmsnorm_quant`), SiLU-and-mul
likewise (`silu_and_mul_quant`), and an FP8 projection in a CUDA graph may leave its scales to
the kernel that reads its output (`UnscaledRows`): o_proj's and down_proj's go into the next add +
RMSNorm, gate_up's into SiLU-and-mul. Above one row that is 6 kernels fewer a Llama layer.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from flashserve.layers.fp8 import FP8_DTYPE, QuantizedRows, UnscaledRows

Tensor = torch.Tensor


# Widest row the fused kernels hold in registers at once (one program a row, one pass over it).
FUSED_MAX_COLS = 32768


@functools.cache
def triton_module() -> Any:
    """Triton, or None where it is not installed."""
    try:
        import triton
    except ImportError:
        return None
    return triton


def fused_kernels(x: Tensor) -> bool:
    """Whether the fused norm / activation kernels run for `x` (CUDA, Triton installed)."""
    return x.is_cuda and triton_module() is not None


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
        block = triton_module().next_power_of_2(n)
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
        block = triton_module().next_power_of_2(inter)
        xs, ws, bias = (x.row_scale, x.col_scale, x.bias) if isinstance(x, UnscaledRows) else (None, None, None)
        _silu_mul_quant_kernel()[(m,)](
            raw, xs if xs is not None else s, ws if ws is not None else s, bias if bias is not None else raw, q, s,
            input_scale if input_scale is not None else s, inter, input_scale_ub or 0.0,
            X_SCALED=isinstance(x, UnscaledRows), HAS_BIAS=bias is not None, STATIC=input_scale is not None,
            HAS_UB=input_scale_ub is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return QuantizedRows(q, s)
