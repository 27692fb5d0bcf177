"""Native forward for the Llama family: Llama 2/3.x, SmolLM, Mistral, Qwen2/2.5, Qwen3.

A step's tokens arrive packed as one sequence (`input_ids`, `positions` [T]); attention goes
through the step's planned `AttentionBackend`. Per layer: add + RMSNorm, one fused qkv matmul,
RoPE in place on the qkv slices, paged attention, o_proj, add + RMSNorm, one fused gate_up
matmul, SiLU-and-mul, down_proj. The residual stream stays in the model dtype, as in HF. With FP8
projections on a GPU, each norm and the SiLU-and-mul write their rows quantized for the projection
after them, and small projections leave their scales to the kernel after them (`layers/linear.py`).

Weights come from the HF model the loader built (safetensors, GGUF or dummy alike), mapped by
name in `weights.py`. The runner's seam:

    model = LlamaModel.from_hf(loaded.model, loaded.hf_config, loaded.dtype, loaded.device)
    hidden = model(input_ids, positions, backend)        # backend.plan(layout) already ran
    logits = model.compute_logits(hidden[sample_rows])   # float32 [N, V]

Tensor parallelism: built with a `TPGroup` of N ranks (`from_hf(..., group=g)` or
`from_checkpoint`), a model holds its rank's shard (`model.shard`, see `distributed/sharding.py`)
and every rank runs the same step with the same inputs. The rank's attention backend has
`model.shard.num_heads` query and `model.shard.num_kv_heads` KV heads; o_proj and down_proj are
followed by an all-reduce (NCCL, then the add + RMSNorm after it; or one FlashInfer kernel that
does all three, `use_fused_allreduce`), and `compute_logits` gathers the vocabulary so that every
rank returns the full [N, V] row. On one rank none of this runs: the forward is the single-process one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashserve.attention.paged_append import Rope
from flashserve.distributed.comm import FlashInferAllReduceNorm, FusedAllReduceNorm, SingleRankGroup, TPGroup
from flashserve.distributed.sharding import ShardLayout
from flashserve.layers.fp8 import QuantizedRows, UnscaledRows
from flashserve.layers.linear import (
    Linear, LinearArgs, add_rmsnorm_for, dense, gate_up_silu_for, linear, linear_unscaled, pack_for_onednn,
    packs_for_onednn, takes_dynamic_fp8,
)  # fmt: skip
from flashserve.layers.ops import Ops, rope_cos_sin_cache, rope_inv_freq, select_ops, torch_ops
from flashserve.layers.quantization import Fp8Scheme, projection_loading
from flashserve.model_loader.weights import (
    SUPPORTED_ARCHITECTURES,
    LlamaSpec,
    UnsupportedModelError,
    WeightMismatchError,
    convert_hf_state_dict,
)

if TYPE_CHECKING:
    from flashserve.model_loader.checkpoint import DummyCheckpoint

Tensor = torch.Tensor

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaModel", "LlamaSpec", "UnsupportedModelError", "WeightMismatchError"]

# Positions covered by the RoPE table when neither the caller nor the config bounds them.
_DEFAULT_MAX_POSITIONS = 8192
# Compiled variants of one piece a process may hold (about 6 per model: several models fit).
_RECOMPILE_LIMIT = 64


def _param(*shape: int) -> nn.Parameter:
    # Built on the meta device by `from_hf`; real tensors arrive with load_state_dict(assign=True).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One decoder layer's weights. `projection(out, in, bias, keys)` builds the layer's
    projection that fuses those checkpoint parts (weights.py's keys), in its weight format."""

    def __init__(self, spec: LlamaSpec, projection: Callable[[int, int, bool, tuple[str, ...]], Linear]) -> None:
        super().__init__()
        h, i_size = spec.hidden_size, spec.intermediate_size
        self.input_layernorm = nn.ParameterDict({"weight": _param(h)})
        self.post_attention_layernorm = nn.ParameterDict({"weight": _param(h)})
        self.qkv_proj = projection(spec.q_size + 2 * spec.kv_size, h, spec.qkv_bias, ("q", "k", "v"))
        self.o_proj = projection(h, spec.q_size, spec.o_bias, ("o",))
        self.gate_up_proj = projection(2 * i_size, h, spec.mlp_bias, ("gate", "up"))
        self.down_proj = projection(h, i_size, spec.mlp_bias, ("down",))
        if spec.qk_norm:
            self.q_norm = nn.ParameterDict({"weight": _param(spec.head_dim)})
            self.k_norm = nn.ParameterDict({"weight": _param(spec.head_dim)})


# The forward between two attention calls, as functions of tensors only, so that one compiled
# graph serves every layer (`--torch-compile`): weights are arguments, never module attributes.


def attention_input(
    spec: LlamaSpec, ops: Ops, hidden: Tensor | UnscaledRows | None, residual: Tensor, positions: Tensor,
    cos_sin: Tensor, norm_w: Tensor, qkv: LinearArgs, q_norm_w: Tensor | None, k_norm_w: Tensor | None,
    rotate: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """A layer up to attention: (add +) RMSNorm, fused qkv, the q/k norms, RoPE (unless not
    `rotate`: the attention backend rotates, see `backend_rope`).

    `hidden` is the previous layer's output, added into `residual` (None for the first layer,
    whose `residual` is the embedding). Returns q, k, v as [T, heads, head_dim] and the residual.
    """
    normed, residual = add_rmsnorm_for(qkv, ops, hidden, residual, norm_w, spec.rms_norm_eps)
    q, k, v = qkv_rope(spec, ops, normed, positions, cos_sin, qkv, q_norm_w, k_norm_w, rotate)
    return q, k, v, residual


def qkv_rope(
    spec: LlamaSpec, ops: Ops, normed: Tensor | QuantizedRows, positions: Tensor, cos_sin: Tensor,
    qkv: LinearArgs, q_norm_w: Tensor | None, k_norm_w: Tensor | None, rotate: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """`attention_input` after the layer's input norm: fused qkv, the q/k norms, RoPE (if `rotate`)."""
    eps, d = spec.rms_norm_eps, spec.head_dim
    q, k, v = linear(normed, *qkv).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
    t = q.shape[0]
    if q_norm_w is not None and k_norm_w is not None:
        q = ops.rmsnorm(q.view(t, spec.num_heads, d), q_norm_w, eps).view(t, spec.q_size)
        k = ops.rmsnorm(k.view(t, spec.num_kv_heads, d), k_norm_w, eps).view(t, spec.kv_size)
    if rotate:
        q, k = ops.apply_rope(positions, q, k, d, cos_sin)
    return q.view(t, spec.num_heads, d), k.view(t, spec.num_kv_heads, d), v.view(t, spec.num_kv_heads, d)


def backend_rope(backend: Any, positions: Tensor, cos_sin: Tensor, head_dim: int) -> Rope | None:
    """The step's RoPE for `backend` to apply where it takes it (`AttentionBackend`: FlashInfer's
    rotates in the kernel that appends K and V), else None: the model rotates q and k itself."""
    takes = getattr(backend, "takes_rope", None)
    return Rope(positions, cos_sin) if takes is not None and takes(cos_sin, head_dim) else None


def attend(backend: Any, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: Rope | None) -> Tensor:
    return backend.forward(layer, q, k, v) if rope is None else backend.forward(layer, q, k, v, rope=rope)


def attention_output(
    spec: LlamaSpec, ops: Ops, attn: Tensor, residual: Tensor, o: LinearArgs, norm_w: Tensor,
    gate_up: LinearArgs, down: LinearArgs,
) -> tuple[Tensor | UnscaledRows, Tensor]:  # fmt: skip
    """A layer from attention on: o_proj, add + RMSNorm, the SiLU MLP. Returns it and the residual;
    an FP8 down_proj's output may come with its scales still to apply (`UnscaledRows`), which the
    next layer's add + RMSNorm (or `final_norm`) applies."""
    hidden = linear_unscaled(attn.reshape(attn.shape[0], spec.q_size), *o)
    return mlp(spec, ops, hidden, residual, norm_w, gate_up, down)


def mlp(
    spec: LlamaSpec, ops: Ops, hidden: Tensor | UnscaledRows, residual: Tensor, norm_w: Tensor,
    gate_up: LinearArgs, down: LinearArgs,
) -> tuple[Tensor | UnscaledRows, Tensor]:  # fmt: skip
    """`attention_output` after o_proj: add + RMSNorm, the SiLU MLP."""
    normed, residual = add_rmsnorm_for(gate_up, ops, hidden, residual, norm_w, spec.rms_norm_eps)
    return gated_mlp(ops, normed, gate_up, down, unscaled=True), residual


def gated_mlp(
    ops: Ops, normed: Tensor | QuantizedRows, gate_up: LinearArgs, down: LinearArgs, unscaled: bool = False,
) -> Tensor | UnscaledRows:  # fmt: skip
    """The SiLU MLP of a normed hidden state: gate_up, SiLU-and-mul, down. `unscaled`: an FP8
    down_proj may leave its scales to the reader (`linear_unscaled`)."""
    return linear_unscaled(gate_up_silu_for(down, ops, normed, gate_up), *down, defer=unscaled)


def final_norm(
    spec: LlamaSpec, ops: Ops, hidden: Tensor | UnscaledRows | None, residual: Tensor, norm_w: Tensor
) -> Tensor:
    normed = add_rmsnorm_for(None, ops, hidden, residual, norm_w, spec.rms_norm_eps)[0]
    assert not isinstance(normed, QuantizedRows)
    return normed


class LlamaModel(nn.Module):
    """The decoder and its LM head, with fused weights. See the module docstring for the seam.

    spec: the whole model's. group: the tensor-parallel ranks (default: one); the model holds
    the shard of `group.rank`, and `rank_spec` is the spec of its layers (its heads and columns).
    fp8: the scheme of projections held in FP8 (None: every projection in the model dtype).
    """

    def __init__(self, spec: LlamaSpec, ops: Ops, *, compile: bool = False, group: TPGroup | None = None,
                 fp8: Fp8Scheme | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.ops = ops
        self.compiled = compile
        self.group: TPGroup = group if group is not None else SingleRankGroup()
        self.shard = ShardLayout.for_spec(spec, self.group.rank, self.group.world_size)
        self.sharded = not self.shard.is_whole
        self.rank_spec: LlamaSpec = self.shard.rank_spec(spec)
        pieces: list[Any] = [attention_input, attention_output, final_norm, qkv_rope, gated_mlp]
        if compile:
            # Shapes start static and turn dynamic in the token dimension when it first changes;
            # one token is a graph of its own. Run every step size class once before capturing
            # CUDA graphs, so that no compilation happens under capture. Each (spec, size class,
            # first layer or not) is a cache entry of the function's code, shared process-wide.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
            pieces = [torch.compile(p, fullgraph=True) for p in pieces]
        self._attention_input, self._attention_output, self._final_norm, self._qkv_rope, self._gated_mlp = pieces
        # The all-reduce of a row-parallel projection fused with the residual add and RMSNorm after
        # it, for steps of up to its `max_tokens` (`use_fused_allreduce`); None: NCCL, then the norm.
        self.fused_allreduce: FusedAllReduceNorm | None = None
        # A rank of several holds its (padded) rows of the vocabulary, as of the LM head.
        embed_rows = self.shard.vocab_size if self.sharded else spec.vocab_size
        self.embed_tokens = nn.ParameterDict({"weight": _param(embed_rows, spec.hidden_size)})
        self.fp8 = fp8
        self.layers = nn.ModuleList(LlamaDecoderLayer(self.rank_spec, self._projection_builder(i))
                                    for i in range(spec.num_layers))
        self.norm = nn.ParameterDict({"weight": _param(spec.hidden_size)})
        if not spec.tie_word_embeddings or self.sharded:
            # A rank's LM head is its (padded) rows of the vocabulary, tied or not.
            self.lm_head = nn.ParameterDict({"weight": _param(self.shard.vocab_size, spec.hidden_size)})
        # float32 [max_positions, head_dim], set by from_hf; a buffer so that .to(device) moves it.
        self.cos_sin_cache: torch.Tensor | None
        self.register_buffer("cos_sin_cache", None, persistent=False)
        # A tied LM head packed for oneDNN on a CPU (`packs_for_onednn`), beside the embedding.
        self.packed_lm_head: torch.Tensor | None
        self.register_buffer("packed_lm_head", None, persistent=False)

    def _projection_builder(self, layer: int) -> Callable[[int, int, bool, tuple[str, ...]], Linear]:
        fp8 = self.fp8

        def build(out_features: int, in_features: int, bias: bool, keys: tuple[str, ...]) -> Linear:
            if fp8 is None or not fp8.quantizes_projection(layer, keys):
                return Linear(out_features, in_features, bias=bias)
            return Linear(out_features, in_features, bias=bias, fp8=True, static_input=fp8.static_input,
                          input_scale_ub=fp8.input_scale_ub)

        return build

    @classmethod
    def from_hf(
        cls,
        source: nn.Module | Mapping[str, torch.Tensor],
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        max_positions: int | None = None,
        consume: bool = True,
        ops: Ops | str = "auto",
        compile: bool = False,
        group: TPGroup | None = None,
        quantization: str | None = None,
    ) -> LlamaModel:
        """Builds the native model from an HF CausalLM module or its state dict.

        consume: when `source` is a module, its parameters move to the meta device as they are
            converted, so its memory is freed instead of doubled (pass False to keep it usable).
        max_positions: rows of the RoPE table (default: the config's max_position_embeddings).
        ops: an `Ops` set, or "auto" | "flashinfer" | "torch" for `select_ops`.
        compile: run the pieces between attention calls through `torch.compile` (Inductor), over
            the PyTorch ops, which it fuses; attention stays with the backend.
        group: the tensor-parallel ranks; the model keeps only `group.rank`'s shard of `source`.
        quantization: "fp8" quantizes the projections at load (`layers/quantization.py`); FP8
            GEMMs on CUDA, the FP8-rounded weights dequantized on a CPU.
        Raises UnsupportedModelError (fall back to the generic path) or WeightMismatchError, and
        ValueError when the heads do not split over the group or the quantization is unsupported.
        """
        device = torch.device(device)
        architecture = type(source).__name__ if isinstance(source, nn.Module) else None
        spec = LlamaSpec.from_hf_config(hf_config, architecture)
        group = group if group is not None else SingleRankGroup()
        shard = ShardLayout.for_spec(spec, group.rank, group.world_size)
        if isinstance(source, nn.Module):
            state: dict[str, torch.Tensor] = dict(source.state_dict())
            if consume:
                # The state dict's tensors keep the storage alive; the module lets go of it, and
                # conversion pops each tensor as it goes.
                source.to("meta")
        else:
            state = dict(source)
        scheme, loader = projection_loading(hf_config, quantization, dtype, device, compile, dense_source=True)
        weights = convert_hf_state_dict(state, spec, dtype, device, shard, loader)
        del state
        return cls._assemble(spec, weights, dtype, device, max_positions, ops, compile, group, scheme)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | DummyCheckpoint,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        max_positions: int | None = None,
        ops: Ops | str = "auto",
        compile: bool = False,
        group: TPGroup | None = None,
        quantization: str | None = None,
    ) -> LlamaModel:
        """Builds the rank's shard straight from a checkpoint's safetensors files, reading only
        the rank's slice of each tensor, or from a `DummyCheckpoint`'s random weights, drawn a
        tensor at a time. path: a checkpoint directory, its .safetensors files, or a
        DummyCheckpoint. The other arguments and errors are `from_hf`'s; the architecture is the
        config's. An FP8 checkpoint (its config's `quantization_config`) loads in its format; dummy
        weights of such a config are drawn in high precision and quantized at load.
        """
        from flashserve.model_loader.checkpoint import DummyCheckpoint, read_llama_shard

        device = torch.device(device)
        spec = LlamaSpec.from_hf_config(hf_config)
        group = group if group is not None else SingleRankGroup()
        shard = ShardLayout.for_spec(spec, group.rank, group.world_size)
        dummy = isinstance(path, DummyCheckpoint)
        scheme, loader = projection_loading(hf_config, quantization, dtype, device, compile, dense_source=dummy)
        if isinstance(path, DummyCheckpoint):
            weights = path.read_llama_shard(spec, dtype, device, shard, loader)
        else:
            weights = read_llama_shard(path, spec, dtype, device, shard, loader)
        return cls._assemble(spec, weights, dtype, device, max_positions, ops, compile, group, scheme)

    @classmethod
    def _assemble(
        cls, spec: LlamaSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
        max_positions: int | None, ops: Ops | str, compile: bool, group: TPGroup, fp8: Fp8Scheme | None,
    ) -> LlamaModel:  # fmt: skip
        if compile:
            if ops not in ("auto", "torch") and not (isinstance(ops, Ops) and ops.name == "torch"):
                raise ValueError("torch.compile traces the PyTorch ops; the FlashInfer ones are opaque to it")
            ops = torch_ops()
        ops = ops if isinstance(ops, Ops) else select_ops(device, ops, dtype)
        with torch.device("meta"):
            model = cls(spec, ops, compile=compile, group=group, fp8=fp8)
        model.load_state_dict(weights, strict=True, assign=True)
        model.eval()
        if packs_for_onednn(device, dtype, compile):
            for layer in model.layers:
                for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                    proj.weight = nn.Parameter(pack_for_onednn(proj.weight), requires_grad=False)
            if hasattr(model, "lm_head"):
                model.lm_head["weight"] = nn.Parameter(pack_for_onednn(model.lm_head["weight"]), requires_grad=False)
            else:  # tied: the embedding stays dense for lookups, and the head gets a packed copy
                model.packed_lm_head = pack_for_onednn(model.embed_tokens["weight"])
        positions = max_positions or spec.max_position_embeddings or _DEFAULT_MAX_POSITIONS
        model.cos_sin_cache = rope_cos_sin_cache(rope_inv_freq(spec.rope, spec.head_dim), positions, device)
        return model

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, hidden] on one rank; a sharded model's rows of the vocabulary (padded) on each rank."""
        tied = self.spec.tie_word_embeddings and not self.sharded
        if not tied:
            return self.lm_head["weight"]
        return self.packed_lm_head if self.packed_lm_head is not None else self.embed_tokens["weight"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: Any) -> torch.Tensor:
        """input_ids, positions: int64 [T] (the step's packed tokens; `backend.plan` already ran).

        Returns the final-normed hidden states [T, hidden_size] in the model dtype. No host sync,
        so the whole call can be captured in a CUDA graph.
        """
        cos_sin = self.cos_sin_cache
        if cos_sin is None:
            raise RuntimeError("LlamaModel has no RoPE table: build it with LlamaModel.from_hf")
        if self.sharded:
            return self._forward_sharded(input_ids, positions, backend, cos_sin)
        spec, ops = self.spec, self.ops
        rope = backend_rope(backend, positions, cos_sin, spec.head_dim)
        residual = F.embedding(input_ids, self.embed_tokens["weight"])
        hidden: Tensor | UnscaledRows | None = None
        for i, layer in enumerate(self.layers):
            q, k, v, residual = self._attention_input(
                spec, ops, hidden, residual, positions, cos_sin, layer.input_layernorm["weight"], layer.qkv_proj.args,
                layer.q_norm["weight"] if spec.qk_norm else None, layer.k_norm["weight"] if spec.qk_norm else None,
                rope is None,
            )  # fmt: skip
            hidden, residual = self._attention_output(
                spec, ops, attend(backend, i, q, k, v, rope), residual, layer.o_proj.args,
                layer.post_attention_layernorm["weight"], layer.gate_up_proj.args, layer.down_proj.args,
            )  # fmt: skip
        return self._final_norm(spec, ops, hidden, residual, self.norm["weight"])

    def use_fused_allreduce(self, max_tokens: int) -> None:
        """Runs each all-reduce with the add + RMSNorm after it as one FlashInfer kernel for steps
        of up to `max_tokens` tokens; larger steps keep NCCL. Collective: every rank calls it."""
        if not self.sharded:
            raise ValueError("the fused all-reduce is for a model over several ranks")
        self.close_fused_allreduce()
        dtype = self.embed_tokens["weight"].dtype
        self.fused_allreduce = FlashInferAllReduceNorm(self.group, max_tokens, self.spec.hidden_size, dtype)

    def close_fused_allreduce(self) -> None:
        """Frees the fused all-reduce's buffers, if any (every rank, before the group ends)."""
        if self.fused_allreduce is not None:
            self.fused_allreduce.close()
            self.fused_allreduce = None

    def _embed_sharded(self, input_ids: Tensor) -> Tensor:
        """The embedding rows of `input_ids` from the ranks' vocabulary shards: each rank looks up
        the ids in its rows and zeros the others, and the all-reduce adds one row to zeros (exact)."""
        local = input_ids - self.shard.vocab_start
        mine = (local >= 0) & (local < self.shard.vocab_stop - self.shard.vocab_start)
        rows = F.embedding(torch.where(mine, local, 0), self.embed_tokens["weight"])
        return self.group.all_reduce(rows.masked_fill_(~mine.unsqueeze(-1), 0))

    def _forward_sharded(self, input_ids: Tensor, positions: Tensor, backend: Any, cos_sin: Tensor) -> Tensor:
        """`forward` on one rank of several: the rank's heads and MLP columns. A row-parallel
        projection (o_proj, down_proj) leaves partial sums, which `_reduce_add_norm` all-reduces
        into the residual before the norm that follows, so that every rank holds the full state."""
        spec, ops = self.rank_spec, self.ops
        rope = backend_rope(backend, positions, cos_sin, spec.head_dim)
        residual = self._embed_sharded(input_ids)
        if not self.layers:
            return ops.rmsnorm(residual, self.norm["weight"], spec.rms_norm_eps)
        partial: Tensor | None = None
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv_proj.args
            if partial is None:
                normed, residual = add_rmsnorm_for(qkv, ops, None, residual, layer.input_layernorm["weight"],
                                                   spec.rms_norm_eps)  # fmt: skip
            else:
                normed, residual = self._reduce_add_norm(partial, residual, layer.input_layernorm["weight"], qkv)
            q, k, v = self._qkv_rope(
                spec, ops, normed, positions, cos_sin, qkv,
                layer.q_norm["weight"] if spec.qk_norm else None, layer.k_norm["weight"] if spec.qk_norm else None,
                rope is None,
            )  # fmt: skip
            attn = attend(backend, i, q, k, v, rope).reshape(q.shape[0], spec.q_size)
            partial = layer.o_proj(attn)
            gate_up = layer.gate_up_proj.args
            normed, residual = self._reduce_add_norm(partial, residual, layer.post_attention_layernorm["weight"],
                                                     gate_up)  # fmt: skip
            partial = dense(self._gated_mlp(ops, normed, gate_up, layer.down_proj.args))
        assert partial is not None
        final, _ = self._reduce_add_norm(partial, residual, self.norm["weight"], None)
        assert not isinstance(final, QuantizedRows)
        return final

    def _reduce_add_norm(
        self, partial: Tensor, residual: Tensor, norm_w: Tensor, proj: LinearArgs | None
    ) -> tuple[Tensor | QuantizedRows, Tensor]:
        """Sums a row-parallel projection's `partial` over the ranks, adds it into `residual` and
        RMSNorms that, for projection `proj` (None: the final norm): (normed, residual), normed
        quantized for an FP8 `proj`. One fused kernel for steps the fused all-reduce takes (the
        token count is the same on every rank, so all ranks choose alike), which quantizes for an
        FP8 `proj` with dynamic activations too, else NCCL's all-reduce and then the add + RMSNorm
        (`add_rmsnorm_for`). A partial's FP8 scales differ between ranks (each
        quantized its own slice of the activation), so they are applied before the sum."""
        fused = self.fused_allreduce
        if fused is not None and partial.shape[0] <= fused.max_tokens:
            return fused(partial, residual, norm_w, self.spec.rms_norm_eps, takes_dynamic_fp8(proj, residual))
        return add_rmsnorm_for(proj, self.ops, self.group.all_reduce(partial), residual, norm_w, self.spec.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (the rows to sample) -> float32 logits [N, vocab_size].

        On a sharded model every rank calls it with the same rows and gets the full logits: each
        computes its rows of the vocabulary, and they are gathered (the padding cut off).
        """
        if not self.sharded:
            return linear(hidden, self.lm_head_weight).float()
        logits = self.group.all_gather(linear(hidden, self.lm_head_weight), dim=-1)
        if logits.shape[-1] != self.spec.vocab_size:
            logits = logits[..., : self.spec.vocab_size]
        return logits.float().contiguous()

