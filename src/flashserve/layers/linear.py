"""A projection that owns its weight format and its GEMM: dense (the model dtype) or FP8 with scales.

The model calls `linear(x, *proj.args)` (or `proj(x)`) and never asks which format it holds: the
format is the dtype of the weight. The arguments are plain tensors (and one float), so that one
`torch.compile`d function serves every layer (weights are arguments, never module attributes).

- dense: `F.linear`; a float32 weight packed for oneDNN on a CPU (`pack_for_onednn`) goes through
  oneDNN.
- FP8: float8_e4m3fn weight [N, K], float32 `weight_scale` [1, N], an optional static float32
  `input_scale` [] and fbgemm's bound on dynamic activation scales; see `layers/fp8.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashserve.layers.fp8 import FP8_DTYPE, fp8_linear

Tensor = torch.Tensor
LinearArgs = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, float | None]


def linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, weight_scale: Tensor | None = None,
    input_scale: Tensor | None = None, input_scale_ub: float | None = None,
) -> Tensor:  # fmt: skip
    """x @ weight.T + bias in the weight's format (see the module docstring)."""
    if weight.dtype == FP8_DTYPE:
        assert weight_scale is not None
        return fp8_linear(x, weight, bias, weight_scale, input_scale, input_scale_ub)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


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
