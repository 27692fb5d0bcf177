"""A projection that owns its weight format and its GEMM: dense (the model dtype) or FP8 with scales.

The model calls `linear(x, *proj.args)` (or `proj(x)`) and never asks which format it holds: the
format is the dtype of the weight. The arguments are plain tensors (and one float), so that one
`torch.compile`d function serves every layer (weights are arguments, never module attributes).

- dense: `F.linear`; a float32 weight packed for oneDNN on a CPU (`pack_for_onednn`) goes through
  oneDNN.
- FP8: float8_e4m3fn weight [N, K], float32 `weight_scale` [1, N], an optional static float32
  `input_scale` [] and fbgemm's bound on dynamic activation scales; see `layers/fp8.py` and `layers/fp8_gemm.py`.

The kernel before a projection may write its input in the projection's format: `add_rmsnorm_for`
and `silu_and_mul_for` return `QuantizedRows` for an FP8 projection of a bfloat16 model on a GPU
(one fused kernel each), and `linear_unscaled` may return `UnscaledRows`, which those two scale as
they read them. Everywhere else they are the `Ops` kernels on plain tensors. One row goes to an FP8
projection unquantized (`fp8.fp8_weight_gemv`), and `gate_up_silu_for` makes an FP8 gate_up and
SiLU-and-mul one kernel there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashserve.layers.fp8 import FP8_DTYPE, QuantizedRows, UnscaledRows
from flashserve.layers.fp8_fused import FUSED_MAX_COLS, add_rmsnorm_quant, fused_kernels, silu_and_mul_quant
from flashserve.layers.fp8_gemm import fp8_linear, fp8_weight_gemv, takes_weight_gemv
from flashserve.layers.ops import Ops

Tensor = torch.Tensor
# Rows up to which an FP8 gate_up leaves its scales to SiLU-and-mul (`UnscaledRows`). The fused
# kernel's scaled variant reads two float32 column-scale rows beside each row of the product: on an
# H200 at the 8B's 2 x 14,336 columns it took 38.6 against 33.4 us unscaled at 1,024 rows and 74.5
# against 43.9 at 2,048, where bmm_fp8 saves 17-18 us on gate_up against row-wise `_scaled_mm`.
SILU_DEFER_MAX_ROWS = 1024
LinearArgs = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, float | None]


def linear(
    x: Tensor | QuantizedRows, weight: Tensor, bias: Tensor | None = None, weight_scale: Tensor | None = None,
    input_scale: Tensor | None = None, input_scale_ub: float | None = None,
) -> Tensor:  # fmt: skip
    """x @ weight.T + bias in the weight's format (see the module docstring). `QuantizedRows` go to an
    FP8 weight only."""
    return dense(linear_unscaled(x, weight, bias, weight_scale, input_scale, input_scale_ub, defer=False))


def linear_unscaled(
    x: Tensor | QuantizedRows, weight: Tensor, bias: Tensor | None = None, weight_scale: Tensor | None = None,
    input_scale: Tensor | None = None, input_scale_ub: float | None = None, defer: bool = True,
) -> Tensor | UnscaledRows:  # fmt: skip
    """`linear`, except that an FP8 projection of 2 rows or more under CUDA-graph capture returns
    `UnscaledRows` (bmm_fp8's product, its scales left to the kernel that reads it: `add_rmsnorm_for`,
    `silu_and_mul_for`)."""
    if weight.dtype == FP8_DTYPE:
        assert weight_scale is not None
        return fp8_linear(x, weight, bias, weight_scale, input_scale, input_scale_ub, defer)
    assert isinstance(x, Tensor), "quantized rows go to FP8 projections only"
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def writes_into(weight: Tensor) -> bool:
    """Whether `linear_into` takes this weight: dense, not packed for oneDNN."""
    return weight.dtype != FP8_DTYPE and not weight.is_mkldnn


def linear_into(out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None = None, *_: object) -> Tensor:
    """`linear` of a dense weight (`writes_into`) written into `out`, e.g. some rows of a larger output."""
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def dense(x: Tensor | UnscaledRows) -> Tensor:
    """A projection's output as a plain tensor (scales applied, if any were deferred)."""
    return x.scaled() if isinstance(x, UnscaledRows) else x


def _is_fp8(proj: LinearArgs | None) -> bool:
    return proj is not None and proj[0].dtype == FP8_DTYPE


def _fuses_fp8_input(proj: LinearArgs | None, x: Tensor, cols: int) -> bool:
    """Whether the kernel making `proj`'s input (rows of `cols` values; x has as many rows) should
    quantize it: an FP8 projection of a bfloat16 model on a GPU with the fused kernels
    (`fp8.fused_kernels`), unless it reads them unquantized (one row: `fp8.takes_weight_gemv`)."""
    return (_is_fp8(proj) and x.dtype == torch.bfloat16 and cols <= FUSED_MAX_COLS and fused_kernels(x)
            and not takes_weight_gemv(x))  # fmt: skip


def takes_dynamic_fp8(proj: LinearArgs | None, x: Tensor) -> bool:
    """Whether `proj` reads `x` quantized per token with no bound on the scale: an FP8 projection
    with dynamic activations of a bfloat16 model on a GPU (what FlashInfer's fused all-reduce can
    write)."""
    return _fuses_fp8_input(proj, x, x.shape[-1]) and proj is not None and proj[3] is None and proj[4] is None


def add_rmsnorm_for(
    proj: LinearArgs | None, ops: Ops, x: Tensor | UnscaledRows | None, residual: Tensor, norm_w: Tensor, eps: float,
) -> tuple[Tensor | QuantizedRows, Tensor]:  # fmt: skip
    """(normed, residual): residual += x (None: nothing added), RMSNorm, in the format projection
    `proj` reads (None: the model dtype). The residual is updated in place or replaced, as `Ops`."""
    quantize = _fuses_fp8_input(proj, residual, residual.shape[-1])
    if quantize or (isinstance(x, UnscaledRows) and residual.shape[-1] <= FUSED_MAX_COLS):
        input_scale, ub = (proj[3], proj[4]) if quantize and proj is not None else (None, None)
        return add_rmsnorm_quant(x, residual, norm_w, eps, quantize, input_scale, ub)
    if x is None:
        return ops.rmsnorm(residual, norm_w, eps), residual
    return ops.fused_add_rmsnorm(dense(x), residual, norm_w, eps)


def gate_up_silu_for(
    down: LinearArgs, ops: Ops, normed: Tensor | QuantizedRows, gate_up: LinearArgs
) -> Tensor | QuantizedRows:  # fmt: skip
    """The gated MLP up to down_proj: gate_up, then SiLU-and-mul, in the format `down` reads. An FP8
    gate_up over one unquantized row (`fp8.takes_weight_gemv`) is one kernel that writes
    silu(gate) * up."""
    if _is_fp8(gate_up) and isinstance(normed, Tensor) and takes_weight_gemv(normed):
        weight, bias, weight_scale = gate_up[:3]
        assert weight_scale is not None
        return fp8_weight_gemv(normed, weight, weight_scale, bias, gated=True)
    rows = (normed.q if isinstance(normed, QuantizedRows) else normed).shape[0]
    return silu_and_mul_for(down, ops, linear_unscaled(normed, *gate_up, defer=rows <= SILU_DEFER_MAX_ROWS))


def silu_and_mul_for(proj: LinearArgs, ops: Ops, x: Tensor | UnscaledRows) -> Tensor | QuantizedRows:
    """SiLU-and-mul of a gate_up output, in the format projection `proj` (down) reads."""
    raw = x.y if isinstance(x, UnscaledRows) else x
    if _fuses_fp8_input(proj, raw, raw.shape[-1] // 2) and raw.dim() == 2:
        return silu_and_mul_quant(x, proj[3], proj[4])
    return ops.silu_and_mul(dense(x))


def packs_for_onednn(device: torch.device, dtype: torch.dtype, compile: bool) -> bool:
    """float32 projections on a CPU go through oneDNN with weights packed for it: on a 2-core AMD
    EPYC 2-3x faster than `F.linear`'s BLAS at every row count measured (1 to 2,000). Not under
    torch.compile, which traces dense weights."""
    return device.type == "cpu" and dtype == torch.float32 and not compile and torch.backends.mkldnn.is_available()


def pack_for_onednn(weight: Tensor) -> Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _param(*shape: int) -> nn.Parameter:
    # Built on the meta device; real tensors arrive with load_state_dict(assign=True).
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class Linear(nn.Module):
    """y = x @ W.T + b with W [out_features, in_features], dense or FP8 (`fp8`).

    fp8: the layer holds `weight_scale` (and with `static_input` an `input_scale`);
    input_scale_ub: fbgemm's bound on a token's activation absmax (dynamic activations).
    """

    def __init__(self, out_features: int, in_features: int, *, bias: bool = False, fp8: bool = False,
                 static_input: bool = False, input_scale_ub: float | None = None) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.weight_scale = _param(1, out_features) if fp8 else None
        self.input_scale = _param() if fp8 and static_input else None
        self.input_scale_ub = input_scale_ub if fp8 else None

    @property
    def args(self) -> LinearArgs:
        """The arguments of `linear` after x."""
        return self.weight, self.bias, self.weight_scale, self.input_scale, self.input_scale_ub

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, *self.args)
