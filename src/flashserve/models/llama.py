"""Native forward for the Llama family: Llama 2/3.x, SmolLM, Mistral, Qwen2/2.5, Qwen3.

A step's tokens arrive packed as one sequence (`input_ids`, `positions` [T]); attention goes
through the step's planned `AttentionBackend`. Per layer: add + RMSNorm, one fused qkv matmul,
RoPE in place on the qkv slices, paged attention, o_proj, add + RMSNorm, one fused gate_up
matmul, SiLU-and-mul, down_proj. The residual stream stays in the model dtype, as in HF. With FP8
projections on a GPU, each norm and the SiLU-and-mul write their rows quantized for the projection
after them, and small projections leave their scales to the kernel after them (`layers/linear.py`).

Weights come from an HF model (`from_hf`: GGUF through transformers, an HF id) or straight from a
checkpoint's files or dummy weights (`model_loader.checkpoint.load_llama`), mapped by name in
`models/llama_weights.py` and assembled by `from_weights`. The runner's seam is `NativeCausalLM`:

    hidden = model(input_ids, positions, backend)        # backend.plan(layout) already ran
    logits = model.compute_logits(hidden[sample_rows])   # float32 [N, V]

Tensor parallelism: built with a `TPGroup` of N ranks (`from_hf(..., group=g)` or
`load_llama`), a model holds its rank's shard (`model.shard`, see `distributed/sharding.py`)
and every rank runs the same step with the same inputs through the same loop. The rank's
attention backend has `model.shard.num_heads` query and `model.shard.num_kv_heads` KV heads; the
outputs of o_proj and down_proj go through `reduce_add_norm`: the all-reduce (`all_reduce`, NCCL;
the identity on one rank), then the add + RMSNorm after it, or one FlashInfer kernel that does all
three (`use_fused_allreduce`). `compute_logits` gathers the vocabulary so that every rank returns
the full [N, V] row.

LoRA adapters (`--enable-lora`): `model.lora` holds the adapters' device slots (`lora/layers.py`)
and runs the fused projections (qkv, o, gate_up with SiLU-and-mul, down) with their deltas
(`LoRAStack.project`), the per-token slot index of the step set by the runner. None (LoRA off), or a step of base rows only, runs the
forward above unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from flashserve.attention.base import AttentionBackend
from flashserve.distributed.comm import (FlashInferAllReduceNorm, FusedAllReduceNorm, PendingSum, SingleRankGroup,
                                         TorchDistGroup, TPGroup)
from flashserve.distributed.copy_engine import CopyEngineAllReduce
from flashserve.distributed.sharding import ShardLayout
from flashserve.layers.fp8 import QuantizedRows, UnscaledRows
from flashserve.layers.linear import (
    Linear, LinearArgs, add_rmsnorm_for, dense, linear, linear_into, linear_unscaled, pack_for_onednn,
    packs_for_onednn, takes_dynamic_fp8, writes_into,
)  # fmt: skip
from flashserve.layers.ops import Ops, rope_cos_sin_cache, rope_inv_freq, select_ops, torch_ops
from flashserve.layers.quantization import Fp8Scheme, projection_loading
from flashserve.lora.layers import LoRAStack
from flashserve.models.llama_weights import (
    SUPPORTED_ARCHITECTURES,
    LlamaSpec,
    UnsupportedModelError,
    WeightMismatchError,
    convert_hf_state_dict,
)
from flashserve.models.llama_layers import (
    LlamaDecoderLayer, attend, backend_rope, gated_mlp, meta_param, qkv_rope, takes_rope,
)  # fmt: skip
from flashserve.worker.piecewise_graph import Attention, LayerSteps, run_layer_steps

Tensor = torch.Tensor

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaModel", "LlamaSpec", "NativeCausalLM", "UnsupportedModelError",
           "WeightMismatchError"]

# Positions covered by the RoPE table when neither the caller nor the config bounds them.
_DEFAULT_MAX_POSITIONS = 8192
# Chunks of a large step's tokens over several ranks (`LlamaModel.token_chunks`).
OVERLAP_CHUNKS = 2
# Compiled variants of one piece a process may hold (about 6 per model: several models fit).
_RECOMPILE_LIMIT = 64


def in_rows_of(whole: Tensor, rows: slice, q_size: int, qkv: tuple[Tensor, Tensor, Tensor]) -> bool:
    """Whether a chunk's q, k, v are its `rows` of `whole` (q's columns first, then k's, then v's)."""
    q, k, v = qkv
    start = whole[rows.start]
    kv = k.shape[-2] * k.shape[-1]
    return q.data_ptr() == start.data_ptr() and k.data_ptr() == start[q_size:].data_ptr() \
        and v.data_ptr() == start[q_size + kv:].data_ptr()


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
        pieces: list[Any] = [add_rmsnorm_for, qkv_rope, gated_mlp]
        if compile:
            # Shapes start static and turn dynamic in the token dimension when it first changes;
            # one token is a graph of its own. Run every step size class once before capturing
            # CUDA graphs, so that no compilation happens under capture. Each (spec, size class,
            # first layer or not) is a cache entry of the function's code, shared process-wide.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
            pieces = [torch.compile(p, fullgraph=True) for p in pieces]
        self._add_norm, self._qkv_rope, self._gated_mlp = pieces
        # The all-reduce of a row-parallel projection fused with the residual add and RMSNorm after
        # it, for steps of up to its `max_tokens` (`use_fused_allreduce`); None: NCCL, then the norm.
        self.fused_allreduce: FusedAllReduceNorm | None = None
        # Steps of at least this many tokens over several ranks run their token-wise parts in
        # chunks whose all-reduces overlap the next chunk's GEMMs (`token_chunks`); None: never.
        self.overlap_min_tokens: int | None = None
        # What carries those overlapped all-reduces where it takes the tensor (`use_copy_engine_sums`:
        # `distributed/copy_engine.py`); None: the group's (NCCL).
        self.overlap_sums: CopyEngineAllReduce | None = None
        # A rank of several holds its (padded) rows of the vocabulary, as of the LM head.
        embed_rows = self.shard.vocab_size if self.sharded else spec.vocab_size
        self.embed_tokens = nn.ParameterDict({"weight": meta_param(embed_rows, spec.hidden_size)})
        self.fp8 = fp8
        self.layers = nn.ModuleList(LlamaDecoderLayer(self.rank_spec, self._projection_builder(i))
                                    for i in range(spec.num_layers))
        self.norm = nn.ParameterDict({"weight": meta_param(spec.hidden_size)})
        if not spec.tie_word_embeddings or self.sharded:
            # A rank's LM head is its (padded) rows of the vocabulary, tied or not.
            self.lm_head = nn.ParameterDict({"weight": meta_param(self.shard.vocab_size, spec.hidden_size)})
        # float32 [max_positions, head_dim], set by from_hf; a buffer so that .to(device) moves it.
        self.cos_sin_cache: torch.Tensor | None
        self.register_buffer("cos_sin_cache", None, persistent=False)
        # The LoRA adapters' device slots (`lora/layers.py`), when LoRA is enabled; None: the
        # forward is the base model's alone.
        self.lora: LoRAStack | None = None
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
        spec: LlamaSpec | None = None,
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
        spec: `hf_config`'s, when the caller has it already.
        Raises UnsupportedModelError (fall back to the generic path) or WeightMismatchError, and
        ValueError when the heads do not split over the group or the quantization is unsupported.
        """
        device = torch.device(device)
        if spec is None:
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
        return cls.from_weights(spec, weights, dtype, device, max_positions, ops, compile, group, scheme)

    @classmethod
    def from_weights(
        cls, spec: LlamaSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
        max_positions: int | None, ops: Ops | str, compile: bool, group: TPGroup, fp8: Fp8Scheme | None,
    ) -> LlamaModel:  # fmt: skip
        """The model of `spec` over `weights` (`llama_weights.fuse_weights` names, the rank's shard
        of `group`, projections in the format of `fp8`), on `device` with its RoPE table."""
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
        so the whole call can be captured in a CUDA graph. One loop for one rank or several: a
        row-parallel projection's output (o_proj, down_proj) goes through `reduce_add_norm`, whose
        all-reduce is the identity on one rank. The loop is `layer_steps`, each layer's attention
        through `backend`.
        """
        return run_layer_steps(self.layer_steps(input_ids, positions, self.rotates(backend)),
                               self.attention(backend, positions))

    def rotates(self, backend: Any) -> bool:
        """Whether the model applies RoPE to q and k itself: False where `backend` rotates them as it
        appends K and V (`backend_rope`)."""
        if self.cos_sin_cache is None:
            raise RuntimeError("LlamaModel has no RoPE table: build it with LlamaModel.from_weights")
        return not takes_rope(backend, self.cos_sin_cache, self.rank_spec.head_dim)

    def attention(self, backend: Any, positions: Tensor, out: Tensor | None = None) -> Attention:
        """A step's attention call for `layer_steps`: `(layer, q, k, v) -> [T, Hq, D]` through `backend`
        (planned for the step), with RoPE where the backend applies it. `out`: a contiguous buffer
        [T, Hq, D] every layer's output is written into."""
        assert self.cos_sin_cache is not None
        rope = backend_rope(backend, positions, self.cos_sin_cache, self.rank_spec.head_dim)
        return lambda i, q, k, v: attend(backend, i, q, k, v, rope, out)

    def layer_steps(self, input_ids: Tensor, positions: Tensor, rotate: bool) -> LayerSteps:
        """The forward as the pieces between its attention calls: a generator that yields `(layer, q,
        k, v)` before each layer's attention and is sent that attention's output [T, Hq, D]; it returns
        the final-normed hidden states [T, hidden_size] (`run_layer_steps` drives it). A piece is
        everything between two attention calls (the layer's o_proj and MLP, the next layer's norm,
        qkv and RoPE), so that `worker/piecewise_graph.py` can capture each piece in a CUDA graph of
        its own and attend eagerly between them. `rotate`: see `rotates`."""
        if self.cos_sin_cache is None:
            raise RuntimeError("LlamaModel has no RoPE table: build it with LlamaModel.from_weights")
        spec = self.rank_spec
        # One rank leaves an FP8 projection's scales to the norm that reads its output; over several
        # ranks the output is summed first, so its scales are applied before the all-reduce.
        defer = not self.sharded
        num_tokens = input_ids.shape[0]
        lora = self.lora if self.lora is not None and self.lora.active else None
        if lora is not None:
            lora.begin(num_tokens)
        chunks = self.token_chunks(num_tokens) if lora is None else [slice(0, num_tokens)]
        residual = self.embed(input_ids)
        # Per chunk of tokens: its residual stream and the row-parallel output that joins it next.
        residuals = [residual[c] for c in chunks] if len(chunks) > 1 else [residual]
        partials: list[Tensor | UnscaledRows | PendingSum | None] = [None] * len(chunks)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, layer, chunks, partials, residuals, positions, rotate, lora)
            attn = (yield i, q, k, v).reshape(num_tokens, spec.q_size)
            self._o_and_mlp(i, layer, chunks, attn, partials, residuals, defer, lora)
        finals = [self.reduce_add_norm(partials[j], residuals[j], self.norm["weight"], None)[0] for j in range(len(chunks))]
        final = finals[0] if len(chunks) == 1 else torch.cat(finals)  # type: ignore[arg-type]
        assert not isinstance(final, QuantizedRows)
        return final

    def _qkv(self, i: int, layer: LlamaDecoderLayer, chunks: list[slice], partials: list[Any], residuals: list[Tensor],
             positions: Tensor, rotate: bool, lora: LoRAStack | None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """Layer `i` up to attention, chunk by chunk: the row-parallel output of the layer before
        joins the residual (`reduce_add_norm`), then the input norm, qkv and RoPE. q, k, v of the
        whole step."""
        spec, qkv = self.rank_spec, layer.qkv_proj.args
        q_norm = layer.q_norm["weight"] if spec.qk_norm else None
        k_norm = layer.k_norm["weight"] if spec.qk_norm else None
        # Over several chunks a plain projection writes each chunk's rows of one [T, q + 2 kv]
        # output, so that the step's q, k, v are views of it, as of one chunk's (no copy to join them).
        weight = qkv[0]
        whole = None
        if len(chunks) > 1 and lora is None and writes_into(weight):
            whole = torch.empty(positions.shape[0], weight.shape[0], dtype=weight.dtype, device=weight.device)
        parts = []
        for j, c in enumerate(chunks):
            # With adapters the norms write plain rows (the adapters read them; an FP8 projection
            # quantizes them itself).
            normed, residuals[j] = self.reduce_add_norm(partials[j], residuals[j], layer.input_layernorm["weight"],
                                                        qkv if lora is None else None)  # fmt: skip
            if lora is not None:
                fused = lora.project(i, "qkv", normed, qkv)
            elif whole is not None:
                fused = linear_into(whole[c], normed, *qkv)
            else:
                fused = None
            parts.append(self._qkv_rope(
                spec, self.ops, normed, positions[c] if len(chunks) > 1 else positions, self.cos_sin_cache, qkv,
                q_norm, k_norm, rotate, fused,
            ))  # fmt: skip
        if len(parts) == 1:
            return parts[0]
        if whole is not None and all(in_rows_of(whole, c, spec.q_size, part) for c, part in zip(chunks, parts)):
            # The q/k norms and RoPE ran in place (FlashInfer's): the chunks' q, k, v are rows of `whole`.
            q, k, v = whole.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
            t, d = whole.shape[0], spec.head_dim
            return q.view(t, spec.num_heads, d), k.view(t, spec.num_kv_heads, d), v.view(t, spec.num_kv_heads, d)
        return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]

    def _o_and_mlp(self, i: int, layer: LlamaDecoderLayer, chunks: list[slice], attn: Tensor, partials: list[Any],
                   residuals: list[Tensor], defer: bool, lora: LoRAStack | None) -> None:  # fmt: skip
        """Layer `i` after attention, chunk by chunk: o_proj, its all-reduce into the residual and
        the post-attention norm, the MLP; each chunk's down_proj output is left in `partials` for
        the next layer. Over several chunks each all-reduce starts as soon as its GEMM is enqueued
        (`all_reduce_start`), so that it runs beside the next chunk's GEMMs."""
        overlap = len(chunks) > 1
        for j, c in enumerate(chunks):
            if lora is None:
                partial = linear_unscaled(attn[c] if overlap else attn, *layer.o_proj.args, defer=defer)
            else:  # a row-parallel partial delta joins the partial output before the all-reduce
                partial = lora.project(i, "o", attn, layer.o_proj.args)
            partials[j] = self.all_reduce_start(partial) if overlap else partial
        gate_up, post_norm = layer.gate_up_proj.args, layer.post_attention_layernorm["weight"]
        for j in range(len(chunks)):
            normed, residuals[j] = self.reduce_add_norm(partials[j], residuals[j], post_norm,
                                                        gate_up if lora is None else None)  # fmt: skip
            if lora is None:
                partial = self._gated_mlp(self.ops, normed, gate_up, layer.down_proj.args, defer)
            else:
                assert isinstance(normed, Tensor)
                act = lora.project(i, "gate_up", normed, gate_up, self.ops.silu_and_mul)
                partial = lora.project(i, "down", act, layer.down_proj.args)
            partials[j] = self.all_reduce_start(partial) if overlap else partial

    def token_chunks(self, num_tokens: int) -> list[slice]:
        """The step's tokens in the chunks each layer's token-wise part runs in: one, or over several
        ranks for a step of `overlap_min_tokens` or more, `OVERLAP_CHUNKS` of them (multiples of 16
        tokens), so that a chunk's all-reduce runs while the next chunk's GEMMs do. Only
        attention sees the whole step."""
        least = self.overlap_min_tokens
        if not self.sharded or least is None or num_tokens < max(least, 2 * OVERLAP_CHUNKS):
            return [slice(0, num_tokens)]
        size = -(-num_tokens // (16 * OVERLAP_CHUNKS)) * 16
        return [slice(a, min(a + size, num_tokens)) for a in range(0, num_tokens, size)]

    def embed(self, input_ids: Tensor) -> Tensor:
        """The embedding rows of `input_ids`. Over several ranks each rank looks the ids up in its
        rows of the vocabulary and zeros the others, and the all-reduce adds one row to zeros (exact)."""
        if not self.sharded:
            return F.embedding(input_ids, self.embed_tokens["weight"])
        local = input_ids - self.shard.vocab_start
        mine = (local >= 0) & (local < self.shard.vocab_stop - self.shard.vocab_start)
        rows = F.embedding(torch.where(mine, local, 0), self.embed_tokens["weight"])
        return self.all_reduce(rows.masked_fill_(~mine.unsqueeze(-1), 0))

    def all_reduce(self, partial: Tensor | UnscaledRows) -> Tensor | UnscaledRows:
        """A row-parallel output summed over the ranks (in place): the identity on one rank."""
        if not self.sharded:
            return partial
        return self.group.all_reduce(dense(partial))

    def all_reduce_start(self, partial: Tensor | UnscaledRows) -> PendingSum:
        """Starts the all-reduce of a row-parallel output (`reduce_add_norm` waits for it): by the
        copy engines where `overlap_sums` takes it (its size is the same on every rank, so all
        ranks choose alike), else by the group."""
        t = dense(partial)
        sums = self.overlap_sums
        if sums is not None and sums.takes(t):
            return sums.start(t)
        return self.group.all_reduce_start(t)

    def reduce_add_norm(
        self, partial: Tensor | UnscaledRows | PendingSum | None, residual: Tensor, norm_w: Tensor,
        proj: LinearArgs | None,
    ) -> tuple[Tensor | QuantizedRows, Tensor]:  # fmt: skip
        """A row-parallel projection's `partial` output summed over the ranks (`all_reduce`), added
        into `residual` and RMSNormed for projection `proj` (None: the final norm): (normed,
        residual), normed quantized for an FP8 `proj` where its norm kernel does that. `partial`
        None: nothing to add (the first layer, whose residual is the embedding).

        Steps the fused all-reduce takes (`use_fused_allreduce`; the token count is the same on
        every rank, so all ranks choose alike) run the sum, the add and the norm as one kernel,
        which quantizes for an FP8 `proj` with dynamic activations too."""
        if isinstance(partial, PendingSum):  # its all-reduce started already (`token_chunks`)
            return self._add_norm(proj, self.ops, partial.wait(), residual, norm_w, self.spec.rms_norm_eps)
        fused = self.fused_allreduce
        if partial is not None and fused is not None and partial.shape[0] <= fused.max_tokens:
            return fused(dense(partial), residual, norm_w, self.spec.rms_norm_eps, takes_dynamic_fp8(proj, residual))
        reduced = None if partial is None else self.all_reduce(partial)
        return self._add_norm(proj, self.ops, reduced, residual, norm_w, self.spec.rms_norm_eps)

    def use_fused_allreduce(self, max_tokens: int) -> None:
        """Runs each all-reduce with the add + RMSNorm after it as one FlashInfer kernel for steps
        of up to `max_tokens` tokens; larger steps keep NCCL. Collective: every rank calls it."""
        if not self.sharded:
            raise ValueError("the fused all-reduce is for a model over several ranks")
        self.close_collective_buffers()
        dtype = self.embed_tokens["weight"].dtype
        self.fused_allreduce = FlashInferAllReduceNorm(self.group, max_tokens, self.spec.hidden_size, dtype)

    def use_copy_engine_sums(self, max_chunk_tokens: int) -> None:
        """The overlapped all-reduces of chunks of up to `max_chunk_tokens` tokens by the GPUs' copy
        engines (`distributed/copy_engine.py`); larger ones keep the group's. Collective: every rank
        calls it."""
        weight = self.embed_tokens["weight"]
        if not isinstance(self.group, TorchDistGroup) or weight.device.type != "cuda":
            raise ValueError("--tp-overlap-comm copy-engine is for a model over several GPUs")
        self.overlap_sums = CopyEngineAllReduce(self.group.process_group, max_chunk_tokens * self.spec.hidden_size,
                                                weight.dtype, weight.device)  # fmt: skip

    def close_collective_buffers(self) -> None:
        """Frees the fused all-reduce's and the copy-engine all-reduce's buffers, if any (every
        rank, before the group ends)."""
        if self.fused_allreduce is not None:
            self.fused_allreduce.close()
            self.fused_allreduce = None
        if self.overlap_sums is not None:
            self.overlap_sums.close()
            self.overlap_sums = None

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

