"""What a Llama-family checkpoint looks like, and how its HF tensors map onto the native model.

`LlamaSpec.from_hf_config` reads the shape and the per-architecture details (biases, q/k norms,
RoPE) from a transformers config and refuses what the native forward does not implement with
`UnsupportedModelError`, so the caller can fall back to the generic path. `convert_hf_state_dict`
checks an HF CausalLM state dict against the names the spec expects (listing every missing and
unexpected tensor) and fuses q/k/v and gate/up, layer by layer, popping each HF tensor as it is
used so that the source's memory is released while the native weights are built. A
tensor-parallel rank keeps only its slice of each tensor (`distributed/sharding.py`); `fuse_weights`
takes the tensors from any reader, so a rank can also read its slices straight from safetensors
(`model_loader/checkpoint.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, MutableMapping

import torch

from flashserve.distributed.sharding import ShardLayout
from flashserve.layers.ops import SUPPORTED_ROPE_TYPES
from flashserve.layers.quantization import KV_SCALE_SUFFIXES, WeightMismatchError

if TYPE_CHECKING:
    from flashserve.layers.quantization import Fp8Scheme, ProjectionLoader

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class UnsupportedModelError(ValueError):
    """The native forward does not implement this model; `--model-impl hf` runs it."""

    def __init__(self, what: str) -> None:
        super().__init__(f"native model path: unsupported {what}; use --model-impl hf")


@dataclass(frozen=True)
class LlamaSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each q and k head before RoPE
    tie_word_embeddings: bool
    rope: dict[str, Any]  # transformers' rope_parameters: rope_type, rope_theta, the type's keys
    max_position_embeddings: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Any, architecture: str | None = None) -> LlamaSpec:
        arch = architecture or _architecture(cfg)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {arch!r} (native: {', '.join(SUPPORTED_ARCHITECTURES)})")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"activation {act!r}")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedModelError(f"layer types {sorted(set(layer_types))} (sliding-window attention)")
        if arch == "MistralForCausalLM" and getattr(cfg, "sliding_window", None):
            # Like the generic path, the paged backends attend over the whole context.
            logger.warning("sliding_window=%s is not applied: exact for contexts up to that length", cfg.sliding_window)
        rope = _rope_parameters(cfg)
        if rope.get("rope_type") not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {rope.get('rope_type')!r} (native: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1")
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=float(cfg.rms_norm_eps),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 follow attention_bias.
            qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias and arch != "MistralForCausalLM",
            o_bias=attention_bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            rope=rope,
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        )


def _architecture(cfg: Any) -> str:
    archs = getattr(cfg, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(cfg, "model_type", "")
    return _ARCH_BY_MODEL_TYPE.get(model_type, f"model_type={model_type!r}")


def _rope_parameters(cfg: Any) -> dict[str, Any]:
    """transformers 5's `rope_parameters`, or the legacy `rope_scaling` + `rope_theta` pair."""
    params = getattr(cfg, "rope_parameters", None)
    if not params:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type RoPE parameters")
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _layer_names(spec: LlamaSpec, i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "input_layernorm": p + "input_layernorm.weight",
        "post_attention_layernorm": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
        **({"q_bias": p + "self_attn.q_proj.bias", "k_bias": p + "self_attn.k_proj.bias", "v_bias": p + "self_attn.v_proj.bias"} if spec.qkv_bias else {}),
        **({"o_bias": p + "self_attn.o_proj.bias"} if spec.o_bias else {}),
        **({"gate_bias": p + "mlp.gate_proj.bias", "up_bias": p + "mlp.up_proj.bias", "down_bias": p + "mlp.down_proj.bias"} if spec.mlp_bias else {}),
        **({"q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight"} if spec.qk_norm else {}),
    }


def expected_hf_shapes(spec: LlamaSpec, fp8: Fp8Scheme | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the spec needs, with its shape; with a serialized `fp8` scheme, its float8
    projections' scale tensors too."""
    h, i_size, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    per_key = {
        "input_layernorm": (h,), "post_attention_layernorm": (h,),
        "q": (spec.q_size, h), "k": (spec.kv_size, h), "v": (spec.kv_size, h), "o": (h, spec.q_size),
        "gate": (i_size, h), "up": (i_size, h), "down": (h, i_size),
        "q_bias": (spec.q_size,), "k_bias": (spec.kv_size,), "v_bias": (spec.kv_size,), "o_bias": (h,),
        "gate_bias": (i_size,), "up_bias": (i_size,), "down_bias": (h,), "q_norm": (d,), "k_norm": (d,),
    }  # fmt: skip
    for i in range(spec.num_layers):
        for key, name in _layer_names(spec, i).items():
            shapes[name] = per_key[key]
            if fp8 is not None and fp8.serialized and key in _PROJECTION_KEYS and fp8.quantizes(name[: -len(".weight")]):
                shapes.update(fp8.scale_shapes(name, per_key[key][0]))
    return shapes


_PROJECTION_KEYS = ("q", "k", "v", "o", "gate", "up", "down")
# Native projection -> the checkpoint parts it fuses, in order.
_PROJECTIONS = {"qkv_proj": ("q", "k", "v"), "o_proj": ("o",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}


def _is_ignorable(name: str, spec: LlamaSpec, fp8: Fp8Scheme | None) -> bool:
    # A tied model's state dict repeats the embedding as lm_head.weight; older transformers
    # versions saved RoPE's inv_freq buffer. Neither is a weight of its own. FP8 checkpoints may
    # carry KV-cache scales, which the FP8 KV cache does not use (its scale is 1.0).
    return ((spec.tie_word_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")
            or (fp8 is not None and name.endswith(KV_SCALE_SUFFIXES)))


def check_hf_state_dict(state: Mapping[str, torch.Tensor], spec: LlamaSpec) -> None:
    """Raises WeightMismatchError listing every missing, unexpected and misshapen tensor."""
    check_hf_shapes({name: tuple(t.shape) for name, t in state.items()}, spec)


def _same_shape(name: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    # Scales are saved as [1] or [] per tensor, [rows, 1] or [rows] per channel.
    if name.endswith("_scale"):
        return tuple(d for d in actual if d != 1) == tuple(d for d in expected if d != 1)
    return actual == expected


def check_hf_shapes(shapes: Mapping[str, tuple[int, ...]], spec: LlamaSpec, fp8: Fp8Scheme | None = None) -> None:
    """`check_hf_state_dict` over names and shapes alone (a safetensors header has no more)."""
    expected = expected_hf_shapes(spec, fp8)
    missing = sorted(n for n in expected if n not in shapes)
    unexpected = sorted(n for n in shapes if n not in expected and not _is_ignorable(n, spec, fp8))
    misshapen = sorted(
        f"{n}: {tuple(shapes[n])} != {shape}"
        for n, shape in expected.items() if n in shapes and not _same_shape(n, tuple(shapes[n]), shape)
    )  # fmt: skip
    problems = [
        f"{label} ({len(names)}): {', '.join(names)}"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
        if names
    ]
    if problems:
        raise WeightMismatchError(f"{spec.architecture} checkpoint does not match its config: " + "; ".join(problems))


def expected_hf_names(spec: LlamaSpec) -> list[str]:
    """The checkpoint tensors the native model reads (not a tied model's lm_head, which is the embedding)."""
    return list(expected_hf_shapes(spec))


def convert_hf_state_dict(
    state: MutableMapping[str, torch.Tensor],
    spec: LlamaSpec,
    dtype: torch.dtype,
    device: torch.device,
    shard: ShardLayout | None = None,
    projections: ProjectionLoader | None = None,
) -> dict[str, torch.Tensor]:
    """HF CausalLM names -> native names (fused qkv and gate_up), in `dtype` on `device`.

    shard: a tensor-parallel rank's layout: the result holds only that rank's slices.
    Pops every tensor it uses from `state`: once the caller holds no other reference, each HF
    layer's memory is freed as soon as its fused copy exists (peak: the source plus one layer).
    """
    check_hf_state_dict(state, spec)
    if shard is None or shard.is_whole:
        return fuse_weights(lambda name, kind: state.pop(name), spec, dtype, device, None, projections)

    def take_slice(name: str, kind: str) -> torch.Tensor:
        where = shard.slice_for(kind)
        full = state.pop(name)
        return full if where is None else where.take(full)

    return fuse_weights(take_slice, spec, dtype, device, shard, projections)


def fuse_weights(
    read: Callable[[str, str], torch.Tensor],
    spec: LlamaSpec,
    dtype: torch.dtype,
    device: torch.device,
    shard: ShardLayout | None = None,
    projections: ProjectionLoader | None = None,
) -> dict[str, torch.Tensor]:
    """The native model's weights from `read(hf_name, kind) -> tensor`, called once per tensor in
    layer order (`kind`: the key of `_layer_names`, or "embed_tokens", "norm", "lm_head").

    `read` returns the rank's slice when `shard` splits the model; a tied LM head is then the
    rank's rows of the embedding, the same tensor. `projections`: reads and fuses the projections
    in a quantized format (`layers/quantization.py`); None: dense, in `dtype`.
    """

    def put(*tensors: torch.Tensor) -> torch.Tensor:
        fused = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        return fused.to(device=device, dtype=dtype).contiguous()

    def take(names: dict[str, str], key: str) -> torch.Tensor:
        return read(names[key], key)

    out: dict[str, torch.Tensor] = {"embed_tokens.weight": put(read("model.embed_tokens.weight", "embed_tokens"))}
    for i in range(spec.num_layers):
        names, p = _layer_names(spec, i), f"layers.{i}."
        out[p + "input_layernorm.weight"] = put(take(names, "input_layernorm"))
        out[p + "post_attention_layernorm.weight"] = put(take(names, "post_attention_layernorm"))
        for proj, keys in _PROJECTIONS.items():
            if projections is None:
                out[p + proj + ".weight"] = put(*(take(names, k) for k in keys))
            else:
                out.update({f"{p}{proj}.{suffix}": t for suffix, t in projections.load(i, keys, names, read).items()})
        if spec.qkv_bias:
            out[p + "qkv_proj.bias"] = put(take(names, "q_bias"), take(names, "k_bias"), take(names, "v_bias"))
        if spec.o_bias:
            out[p + "o_proj.bias"] = put(take(names, "o_bias"))
        if spec.mlp_bias:
            out[p + "gate_up_proj.bias"] = put(take(names, "gate_bias"), take(names, "up_bias"))
            out[p + "down_proj.bias"] = put(take(names, "down_bias"))
        if spec.qk_norm:
            out[p + "q_norm.weight"] = put(take(names, "q_norm"))
            out[p + "k_norm.weight"] = put(take(names, "k_norm"))
    out["norm.weight"] = put(read("model.norm.weight", "norm"))
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = put(read("lm_head.weight", "lm_head"))
    elif shard is not None and not shard.is_whole:
        out["lm_head.weight"] = out["embed_tokens.weight"]  # the rank's rows of both: one tensor
    return out
