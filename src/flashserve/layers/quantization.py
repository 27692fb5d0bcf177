"""Which FP8 format a model's projections come in, and how a projection's parts become one layer.

Formats, detected from config.json's `quantization_config` (`fp8_scheme`):
- compressed-tensors (quant_method "compressed-tensors", llm-compressor's "-FP8" / "-FP8-dynamic"
  models): `<module>.weight` float8_e4m3fn [out, in], `<module>.weight_scale` float32/bfloat16,
  one per tensor ([1] or []) or per output channel ([out, 1]); with static activations also
  `<module>.input_scale` (per tensor); dynamic activations are quantized per token at run time.
- fbgemm (quant_method "fbgemm_fp8"): float8 weights, per-channel `weight_scale` [out, 1], dynamic
  per-token activations whose absmax is bounded by `activation_scale_ub`.
- fp8 (quant_method "fp8", a serialized FP8 checkpoint without blocks): per-tensor weight scales,
  static or dynamic activations.
- `--quantization fp8` on a checkpoint without a `quantization_config`: the bfloat16 weights are
  quantized at load, per channel, with dynamic per-token activations (`Fp8Scheme.at_load`).
Anything else (other methods, block-wise scales, weight-only FP8, integer formats) is refused
with `UnsupportedQuantizationError`, never served in another precision.

A fused projection (q/k/v, gate/up) is stored as one float8 [N, K] weight with a float32 scale per
output row, [1, N] (`fuse_projection`): per-tensor scales of the parts expand to their rows (exact,
no requantization); static input scales of the parts become their maximum. Where the model runs
on a CPU, the fused weight is dequantized to the compute dtype instead (`fp8_compute=False`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from flashserve.layers.fp8 import FP8_DTYPE, check_fp8_device, dequantize_weight, quantize_weight_per_channel

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("fp8",)  # --quantization
_CHECKPOINT_METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")
# The checkpoint's module of each projection part (`llama_weights.py`'s keys) within a decoder layer.
HF_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}  # fmt: skip
# Parts split by output rows under tensor parallelism: their per-channel scales split the same way.
_COLUMN_PARALLEL = ("q", "k", "v", "gate", "up")
# KV-cache scales that some FP8 checkpoints carry beside the weights; the FP8 KV cache uses 1.0.
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale", "k_proj.output_scale", "v_proj.output_scale")


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not match the model the config describes."""


class UnsupportedQuantizationError(ValueError):
    """A quantization format or setting flashserve does not serve."""


@dataclass(frozen=True)
class Fp8Scheme:
    method: str  # "compressed-tensors" | "fbgemm_fp8" | "fp8"
    serialized: bool  # the checkpoint holds float8 weights and scales (False: quantized at load)
    weight_per_channel: bool  # serialized scales per output row (else one per tensor)
    static_input: bool  # per-tensor input scales in the checkpoint (else per token at run time)
    input_scale_ub: float | None = None  # fbgemm: bound on a token's absmax
    ignore: tuple[str, ...] = ()  # modules kept unquantized: names, suffixes or "re:" patterns

    def at_load(self) -> Fp8Scheme:
        """The scheme for weights drawn or read in high precision (dummy weights): per-channel,
        dynamic, quantized at load; the modules kept unquantized stay so."""
        return replace(self, serialized=False, weight_per_channel=True, static_input=False)

    def quantizes(self, module: str) -> bool:
        """Whether the HF module `module` ("model.layers.0.self_attn.q_proj") is FP8."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif module == entry or module.endswith("." + entry):
                return False
        return True

    def quantizes_projection(self, layer: int, keys: tuple[str, ...]) -> bool:
        """Whether a (fused) projection of decoder layer `layer` is FP8; its parts must agree."""
        flags = {self.quantizes(f"model.layers.{layer}.{HF_MODULES[k]}") for k in keys}
        if len(flags) > 1:
            raise UnsupportedQuantizationError(
                f"layer {layer}: parts {keys} of one fused projection are quantized differently")
        return flags.pop()

    def scale_names(self, weight_name: str, key: str) -> dict[str, tuple[str, str]]:
        """For a serialized part: suffix -> (checkpoint name, the kind its tensor-parallel slice
        follows: the part's own for per-channel scales of row-split parts, else replicated)."""
        base = weight_name.removesuffix(".weight")
        split = key if self.weight_per_channel and key in _COLUMN_PARALLEL else "replicated"
        names = {"weight_scale": (base + ".weight_scale", split)}
        if self.static_input:
            names["input_scale"] = (base + ".input_scale", "replicated")
        return names

    def scale_shapes(self, weight_name: str, rows: int) -> dict[str, tuple[int, ...]]:
        """The checkpoint's scale tensors of a serialized part, with their shapes."""
        names = self.scale_names(weight_name, "replicated")
        shapes = {names["weight_scale"][0]: (rows, 1) if self.weight_per_channel else (1,)}
        if self.static_input:
            shapes[names["input_scale"][0]] = (1,)
        return shapes


def _as_dict(config: Any) -> dict[str, Any]:
    return config if isinstance(config, dict) else config.to_dict()


def fp8_scheme(hf_config: Any, quantization: str | None = None) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint (its config's `quantization_config`) or of `--quantization`;
    None: the model is not quantized. Raises UnsupportedQuantizationError for anything else."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization {quantization!r} is not supported; choose {', '.join(QUANTIZATION_METHODS)}")
    raw = getattr(hf_config, "quantization_config", None)
    # transformers dequantizes GGUF weights as it loads them (and says so in the config).
    if raw is not None and _as_dict(raw).get("quant_method") == "gguf":
        raw = None
    if raw is None:
        if quantization is None:
            return None
        return Fp8Scheme("fp8", serialized=False, weight_per_channel=True, static_input=False)
    config = _as_dict(raw)
    method = config.get("quant_method")
    if method == "compressed-tensors":
        scheme = _compressed_tensors(config)
    elif method == "fbgemm_fp8":
        ub = config.get("activation_scale_ub")
        scheme = Fp8Scheme(method, True, True, False, float(ub) if ub is not None else None,
                           tuple(config.get("modules_to_not_convert") or ()))
    elif method == "fp8":
        if config.get("weight_block_size"):
            raise UnsupportedQuantizationError("FP8 with block-wise weight scales (weight_block_size) is not supported")
        static = config.get("activation_scheme", "dynamic") == "static"
        scheme = Fp8Scheme(method, True, False, static, None, tuple(config.get("ignored_layers") or ()))
    else:
        raise UnsupportedQuantizationError(
            f"quantization method {method!r} is not supported; FP8 checkpoints load in the formats "
            f"{', '.join(_CHECKPOINT_METHODS)}")
    if quantization is not None:
        logger.info("the checkpoint is already quantized (%s): --quantization %s uses its format", method, quantization)
    return scheme


def _compressed_tensors(config: Mapping[str, Any]) -> Fp8Scheme:
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors config without config_groups")
    schemes = {_ct_group(g) for g in groups}
    if len(schemes) > 1:
        raise UnsupportedQuantizationError("compressed-tensors groups with different FP8 schemes are not supported")
    per_channel, static = schemes.pop()
    if config.get("kv_cache_scheme"):
        logger.warning("the checkpoint's KV-cache scales are not used: --kv-cache-dtype fp8 runs with scale 1.0")
    return Fp8Scheme("compressed-tensors", True, per_channel, static, None, tuple(config.get("ignore") or ()))


def _ct_group(group: Mapping[str, Any]) -> tuple[bool, bool]:
    """(per-channel weights, static input scales) of a compressed-tensors config group."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations")

    def is_fp8(args: Mapping[str, Any]) -> bool:
        return args.get("type") == "float" and args.get("num_bits") == 8

    if not is_fp8(weights):
        raise UnsupportedQuantizationError(
            f"compressed-tensors weights of type {weights.get('type')!r} with {weights.get('num_bits')} bits: "
            "only FP8 (float, 8 bits) is supported")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or weights.get("block_structure") or weights.get("group_size"):
        raise UnsupportedQuantizationError(
            f"compressed-tensors FP8 weight strategy {strategy!r}: only per-tensor and per-channel scales are supported")
    if not inputs or not is_fp8(inputs):
        raise UnsupportedQuantizationError("compressed-tensors FP8 weights without FP8 activations (W8A16) are not supported")
    if inputs.get("dynamic"):
        if inputs.get("strategy") not in ("token", "tensor", None):
            raise UnsupportedQuantizationError(f"dynamic activation strategy {inputs.get('strategy')!r} is not supported")
        return strategy == "channel", False
    if inputs.get("strategy") != "tensor":
        raise UnsupportedQuantizationError(f"static activation strategy {inputs.get('strategy')!r} is not supported")
    return strategy == "channel", True


@dataclass(frozen=True)
class ProjectionLoader:
    """Reads a projection's parts in `scheme`'s format and fuses them (`fuse_weights`' helper).

    fp8_compute: keep float8 weights and scales (CUDA); else dequantize to `dtype` (CPU).
    """

    scheme: Fp8Scheme
    fp8_compute: bool
    dtype: torch.dtype
    device: torch.device

    def load(self, layer: int, keys: tuple[str, ...], names: Mapping[str, str],
             read: Callable[[str, str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The fused projection's tensors by suffix ("weight", "weight_scale", "input_scale")."""
        if not self.scheme.quantizes_projection(layer, keys):
            return {"weight": torch.cat([read(names[k], k) for k in keys]).to(self.device, self.dtype).contiguous()}
        weights, scales, input_scales = [], [], []
        for k in keys:
            weight = read(names[k], k).to(self.device)
            if not self.scheme.serialized:
                weight, scale = quantize_weight_per_channel(weight)
            else:
                extra = {s: read(name, kind) for s, (name, kind) in self.scheme.scale_names(names[k], k).items()}
                weight, scale = _serialized_part(names[k], weight, extra["weight_scale"].to(self.device))
                if "input_scale" in extra:
                    input_scales.append(extra["input_scale"].float().reshape(()))
            weights.append(weight)
            scales.append(scale)
        return fuse_projection(weights, scales, input_scales, self.fp8_compute, self.dtype)


def _serialized_part(name: str, weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint part's float8 weight and its scale as float32 per row [rows]."""
    if weight.dtype != FP8_DTYPE:
        # A tensor-parallel slice wholly in the padding is read as zeros of another dtype.
        if weight.any():
            raise WeightMismatchError(f"{name}: expected float8_e4m3fn weights, found {weight.dtype}")
        weight = weight.to(FP8_DTYPE)
    scale = scale.float().reshape(-1)
    return weight, scale.expand(weight.shape[0]) if scale.numel() == 1 else scale


def fuse_projection(
    weights: list[torch.Tensor], scales: list[torch.Tensor], input_scales: list[torch.Tensor],
    fp8_compute: bool, dtype: torch.dtype,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Parts' float8 weights [rows_i, K] and float32 row scales [rows_i] -> one layer's tensors:
    float8 weight [N, K], weight_scale [1, N] and the largest static input scale [] (fp8_compute),
    else the dequantized weight [N, K] in `dtype`."""
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]
    scale = torch.cat(scales) if len(scales) > 1 else scales[0]
    if not fp8_compute:
        return {"weight": dequantize_weight(weight, scale, dtype).contiguous()}
    out = {"weight": weight.contiguous(), "weight_scale": scale.reshape(1, -1).contiguous()}
    if input_scales:
        out["input_scale"] = torch.stack(input_scales).max().to(weight.device)
    return out


def projection_loading(
    hf_config: Any, quantization: str | None, dtype: torch.dtype, device: torch.device, compile: bool,
    dense_source: bool,
) -> tuple[Fp8Scheme | None, ProjectionLoader | None]:  # fmt: skip
    """How a model on `device` loads its projections: (the scheme of its FP8 layers, None where it
    computes in `dtype`; the loader of its projections, None for plain dense weights).
    `dense_source`: the weights come in high precision (a transformers model, dummy weights) and
    are quantized at load. Raises UnsupportedQuantizationError, or ValueError for a GPU without
    FP8 GEMMs."""
    scheme = fp8_scheme(hf_config, quantization)
    if scheme is None:
        return None, None
    if dense_source and scheme.serialized:
        scheme = scheme.at_load()
    fp8_compute = device.type == "cuda"
    if fp8_compute:
        check_fp8_device(device)
        if compile:
            raise UnsupportedQuantizationError("--torch-compile with FP8 weights is not supported on CUDA")
    return (scheme if fp8_compute else None), ProjectionLoader(scheme, fp8_compute, dtype, device)
