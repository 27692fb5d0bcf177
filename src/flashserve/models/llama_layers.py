"""The native Llama forward's pieces: one decoder layer's weights, and the pieces of the forward between
two attention calls or all-reduces as functions of tensors only, so that one compiled graph serves every layer
(`--torch-compile`): weights are arguments, never module attributes. `llama.LlamaModel` holds the
layers and runs them."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from flashserve.attention.paged_append import Rope
from flashserve.layers.fp8 import QuantizedRows, UnscaledRows
from flashserve.layers.linear import Linear, LinearArgs, gate_up_silu_for, linear, linear_unscaled
from flashserve.layers.ops import Ops
from flashserve.models.llama_weights import LlamaSpec

Tensor = torch.Tensor


def meta_param(*shape: int) -> nn.Parameter:
    # Built on the meta device by `from_hf`; real tensors arrive with load_state_dict(assign=True).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One decoder layer's weights. `projection(out, in, bias, keys)` builds the layer's
    projection that fuses those checkpoint parts (`llama_weights.py`'s keys), in its weight format."""

    def __init__(self, spec: LlamaSpec, projection: Callable[[int, int, bool, tuple[str, ...]], Linear]) -> None:
        super().__init__()
        h, i_size = spec.hidden_size, spec.intermediate_size
        self.input_layernorm = nn.ParameterDict({"weight": meta_param(h)})
        self.post_attention_layernorm = nn.ParameterDict({"weight": meta_param(h)})
        self.qkv_proj = projection(spec.q_size + 2 * spec.kv_size, h, spec.qkv_bias, ("q", "k", "v"))
        self.o_proj = projection(h, spec.q_size, spec.o_bias, ("o",))
        self.gate_up_proj = projection(2 * i_size, h, spec.mlp_bias, ("gate", "up"))
        self.down_proj = projection(h, i_size, spec.mlp_bias, ("down",))
        if spec.qk_norm:
            self.q_norm = nn.ParameterDict({"weight": meta_param(spec.head_dim)})
            self.k_norm = nn.ParameterDict({"weight": meta_param(spec.head_dim)})


def qkv_rope(
    spec: LlamaSpec, ops: Ops, normed: Tensor | QuantizedRows, positions: Tensor, cos_sin: Tensor,
    qkv: LinearArgs, q_norm_w: Tensor | None, k_norm_w: Tensor | None, rotate: bool = True,
    fused_qkv: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """A layer from its input norm up to attention: fused qkv (or `fused_qkv`, its output computed
    already: the LoRA adapters add theirs), the q/k norms, RoPE (unless not `rotate`: the attention
    backend rotates, see `backend_rope`). Returns q, k, v as [T, heads, head_dim]."""
    eps, d = spec.rms_norm_eps, spec.head_dim
    fused = linear(normed, *qkv) if fused_qkv is None else fused_qkv
    q, k, v = fused.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    t = q.shape[0]
    if q_norm_w is not None and k_norm_w is not None:
        q = ops.rmsnorm(q.view(t, spec.num_heads, d), q_norm_w, eps).view(t, spec.q_size)
        k = ops.rmsnorm(k.view(t, spec.num_kv_heads, d), k_norm_w, eps).view(t, spec.kv_size)
    if rotate:
        q, k = ops.apply_rope(positions, q, k, d, cos_sin)
    return q.view(t, spec.num_heads, d), k.view(t, spec.num_kv_heads, d), v.view(t, spec.num_kv_heads, d)


def takes_rope(backend: Any, cos_sin: Tensor, head_dim: int) -> bool:
    """Whether `backend` applies RoPE itself (`AttentionBackend`: FlashInfer's rotates in the kernel
    that appends K and V)."""
    takes = getattr(backend, "takes_rope", None)
    return takes is not None and takes(cos_sin, head_dim)


def backend_rope(backend: Any, positions: Tensor, cos_sin: Tensor, head_dim: int) -> Rope | None:
    """The step's RoPE for `backend` to apply where it takes it (`takes_rope`), else None: the model
    rotates q and k itself."""
    return Rope(positions, cos_sin) if takes_rope(backend, cos_sin, head_dim) else None


def attend(backend: Any, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope | None,
           out: Tensor | None = None) -> Tensor:  # fmt: skip
    """The layer's attention through `backend` (`AttentionBackend.forward`), into `out` when given."""
    kwargs: dict[str, Any] = {} if rope is None else {"rope": rope}
    if out is not None:
        kwargs["out"] = out
    return backend.forward(layer, q, k, v, **kwargs)


def gated_mlp(
    ops: Ops, normed: Tensor | QuantizedRows, gate_up: LinearArgs, down: LinearArgs, unscaled: bool = False,
) -> Tensor | UnscaledRows:  # fmt: skip
    """The SiLU MLP of a normed hidden state: gate_up, SiLU-and-mul, down. `unscaled`: an FP8
    down_proj may leave its scales to the reader (`linear_unscaled`)."""
    return linear_unscaled(gate_up_silu_for(down, ops, normed, gate_up), *down, defer=unscaled)
