"""FP8 (e4m3) numerics: weight quantization, per-token activation quantization, the scales.

Weights are float8_e4m3fn [N, K] with one float32 scale per output row (`w ~= w_q * scale[:, None]`):
per-tensor checkpoint scales are expanded to rows at load, which is exact, so one GEMM serves
every format. Activations are quantized per token (row) at run time, unless the checkpoint gives
a static per-tensor input scale. An activation quantized for a projection travels as
`QuantizedRows`; a projection's output whose scales are still to apply as `UnscaledRows`. How a
projection multiplies is `layers/fp8_gemm.py`; the kernels around it that quantize or scale as they
go are `layers/fp8_fused.py`.

On a CPU nothing here runs at inference: FP8 weights are dequantized to the compute dtype at load.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

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


def check_fp8_device(device: torch.device) -> None:
    """Raises ValueError where FP8 GEMMs cannot run: a GPU before compute capability 8.9."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"FP8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper) for FP8 "
                         f"GEMMs; {name} is {capability[0]}.{capability[1]}: serve a bfloat16 checkpoint")
