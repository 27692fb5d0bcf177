"""The fused operations of a Llama-family forward: RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul.

Each has a FlashInfer implementation (CUDA, float16 and bfloat16) and a PyTorch one with the same
semantics (CPU, a float32 model, or a GPU without flashinfer). A model picks one set once, at
construction, with `select_ops`, so the forward pass never asks again and `flashinfer` is imported
only here and only when chosen.

Semantics, shared by both sets:
- `rmsnorm(x, w, eps) -> y`: x [T, H] or [T, heads, D], normalised over the last dimension.
- `fused_add_rmsnorm(x, residual, w, eps) -> (rmsnorm(residual + x), residual + x)`.
- `apply_rope(positions, q, k, head_dim, cos_sin_cache) -> (q, k)` rotated, neox style (HF's
  `rotate_half`); q [T, Hq * D] and k [T, Hkv * D] may be column slices of a fused qkv output.

The FlashInfer set works in place and returns its (updated) inputs; the PyTorch set allocates
and leaves its inputs alone, so `torch.compile` sees pure functions. Callers use the returned
tensors and do not read the inputs again.
- `silu_and_mul(x) -> silu(x[..., :I]) * x[..., I:]` for x [..., 2I].
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass(frozen=True)
class Ops:
    name: str  # "flashinfer" or "torch"
    rmsnorm: Callable[[Tensor, Tensor, float], Tensor]
    fused_add_rmsnorm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    apply_rope: Callable[[Tensor, Tensor, Tensor, int, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]


# --- PyTorch ---------------------------------------------------------------------------------


def rmsnorm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same computation as below, with no cast in it, in one fused kernel: on a CPU the
        # unfused ops cost 8x as much at prefill sizes (2,000 x 576: 5.6 vs 0.7 ms).
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    # HF's order: normalise in float32, cast back, then scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rmsnorm_torch(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    residual = residual + x
    return rmsnorm_torch(residual, weight, eps), residual


def apply_rope_torch(positions: Tensor, q: Tensor, k: Tensor, head_dim: int, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, rot/2] float32 each
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = cos.shape[-1]

    def rotate(x: Tensor) -> Tensor:
        heads = x.view(x.shape[0], -1, head_dim)  # a view, also of a column slice of qkv
        x1 = heads[..., :half].float()
        x2 = heads[..., half : 2 * half].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        if 2 * half < head_dim:  # partial rotary: the tail passes through
            rotated = torch.cat([rotated, heads[..., 2 * half :]], dim=-1)
        return rotated.view(x.shape[0], -1)

    return rotate(q), rotate(k)


def silu_and_mul_torch(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]).mul_(x[..., half:])  # in place on silu's fresh output: one buffer


def torch_ops() -> Ops:
    return Ops("torch", rmsnorm_torch, fused_add_rmsnorm_torch, apply_rope_torch, silu_and_mul_torch)


# --- FlashInfer ------------------------------------------------------------------------------


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_ops() -> Ops:
    """The FlashInfer kernels; raises ImportError when flashinfer is not installed."""
    fi: Any = importlib.import_module("flashinfer")

    def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dim() == 3:
            # Per-head norm (Qwen3): the heads may be a strided slice of qkv; rows of D suffice.
            return fi.rmsnorm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        return fi.rmsnorm(x, weight, eps)

    def fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        fi.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def apply_rope(positions: Tensor, q: Tensor, k: Tensor, head_dim: int, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
        fi.apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, cos_sin_cache, is_neox=True)
        return q, k

    def silu_and_mul(x: Tensor) -> Tensor:
        return fi.silu_and_mul(x)

    return Ops("flashinfer", rmsnorm, fused_add_rmsnorm, apply_rope, silu_and_mul)


def select_ops(device: torch.device | str, impl: str = "auto", dtype: torch.dtype | None = None) -> Ops:
    """`impl`: "auto" (FlashInfer on CUDA when importable and the model is float16 or bfloat16,
    else PyTorch), "flashinfer" or "torch". `dtype`: the model's (None: not known, taken as half
    precision). FlashInfer's norm, RoPE and activation kernels take float16 and bfloat16 only."""
    device = torch.device(device)
    half = dtype is None or dtype in FLASHINFER_DTYPES
    if impl == "torch":
        return torch_ops()
    if impl == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"the FlashInfer ops need a CUDA device, got {device}")
        if not half:
            raise ValueError(f"the FlashInfer ops take float16 or bfloat16 models, not {dtype}")
        return flashinfer_ops()
    if impl != "auto":
        raise ValueError(f"unknown ops implementation {impl!r}; choose auto, flashinfer or torch")
    if device.type == "cuda" and half:
        try:
            return flashinfer_ops()
        except ImportError:
            pass
    return torch_ops()


# --- RoPE frequencies ------------------------------------------------------------------------

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(rope: dict[str, Any], head_dim: int) -> Tensor:
    """float32 [head_dim / 2] inverse frequencies, computed on the CPU exactly as transformers does.

    `rope` is transformers' `rope_parameters` dict (rope_type, rope_theta and the type's keys).
    """
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r}")
    base = float(rope["rope_theta"])
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope_type == "linear":
        return inv_freq / rope["factor"]
    if rope_type == "llama3":
        factor = rope["factor"]
        low_freq_factor = rope["low_freq_factor"]
        high_freq_factor = rope["high_freq_factor"]
        old_context_len = rope["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed, inv_freq_llama)
    return inv_freq


def rope_cos_sin_cache(inv_freq: Tensor, max_positions: int, device: torch.device | str) -> Tensor:
    """float32 [max_positions, rotary_dim] = cat(cos(p * f), sin(p * f)), as FlashInfer expects.

    Built on the target device, where transformers also evaluates cos/sin, from one float32
    product per entry (transformers' K=1 matmul rounds the same way).
    """
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
