"""One rank's forward of a model split over several (tensor parallelism): the rank's heads and MLP
columns, its rows of the vocabulary, and the all-reduces after the row-parallel projections
(NCCL then the add + RMSNorm, or FlashInfer's fused kernel for small steps). `LlamaModel.forward`
runs it when the model is sharded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from flashserve.layers.fp8 import QuantizedRows
from flashserve.layers.linear import LinearArgs, add_rmsnorm_for, dense, takes_dynamic_fp8
from flashserve.models.llama_layers import attend, backend_rope

if TYPE_CHECKING:
    from flashserve.models.llama import LlamaModel

Tensor = torch.Tensor


def embed_sharded(model: LlamaModel, input_ids: Tensor) -> Tensor:
    """The embedding rows of `input_ids` from the ranks' vocabulary shards: each rank looks up
    the ids in its rows and zeros the others, and the all-reduce adds one row to zeros (exact)."""
    local = input_ids - model.shard.vocab_start
    mine = (local >= 0) & (local < model.shard.vocab_stop - model.shard.vocab_start)
    rows = F.embedding(torch.where(mine, local, 0), model.embed_tokens["weight"])
    return model.group.all_reduce(rows.masked_fill_(~mine.unsqueeze(-1), 0))


def forward_sharded(model: LlamaModel, input_ids: Tensor, positions: Tensor, backend: Any, cos_sin: Tensor) -> Tensor:
    """`LlamaModel.forward` on one rank of several: the rank's heads and MLP columns. A row-parallel
    projection (o_proj, down_proj) leaves partial sums, which `reduce_add_norm` all-reduces
    into the residual before the norm that follows, so that every rank holds the full state."""
    spec, ops = model.rank_spec, model.ops
    rope = backend_rope(backend, positions, cos_sin, spec.head_dim)
    residual = embed_sharded(model, input_ids)
    if not model.layers:
        return ops.rmsnorm(residual, model.norm["weight"], spec.rms_norm_eps)
    partial: Tensor | None = None
    for i, layer in enumerate(model.layers):
        qkv = layer.qkv_proj.args
        if partial is None:
            normed, residual = add_rmsnorm_for(qkv, ops, None, residual, layer.input_layernorm["weight"],
                                               spec.rms_norm_eps)  # fmt: skip
        else:
            normed, residual = reduce_add_norm(model, partial, residual, layer.input_layernorm["weight"], qkv)
        q, k, v = model._qkv_rope(
            spec, ops, normed, positions, cos_sin, qkv,
            layer.q_norm["weight"] if spec.qk_norm else None, layer.k_norm["weight"] if spec.qk_norm else None,
            rope is None,
        )  # fmt: skip
        attn = attend(backend, i, q, k, v, rope).reshape(q.shape[0], spec.q_size)
        partial = layer.o_proj(attn)
        gate_up = layer.gate_up_proj.args
        normed, residual = reduce_add_norm(model, partial, residual, layer.post_attention_layernorm["weight"],
                                           gate_up)  # fmt: skip
        partial = dense(model._gated_mlp(ops, normed, gate_up, layer.down_proj.args))
    assert partial is not None
    final, _ = reduce_add_norm(model, partial, residual, model.norm["weight"], None)
    assert not isinstance(final, QuantizedRows)
    return final


def reduce_add_norm(
    model: LlamaModel, partial: Tensor, residual: Tensor, norm_w: Tensor, proj: LinearArgs | None
) -> tuple[Tensor | QuantizedRows, Tensor]:
    """Sums a row-parallel projection's `partial` over the ranks, adds it into `residual` and
    RMSNorms that, for projection `proj` (None: the final norm): (normed, residual), normed
    quantized for an FP8 `proj`. One fused kernel for steps the fused all-reduce takes (the
    token count is the same on every rank, so all ranks choose alike), which quantizes for an
    FP8 `proj` with dynamic activations too, else NCCL's all-reduce and then the add + RMSNorm
    (`add_rmsnorm_for`). A partial's FP8 scales differ between ranks (each
    quantized its own slice of the activation), so they are applied before the sum."""
    fused = model.fused_allreduce
    if fused is not None and partial.shape[0] <= fused.max_tokens:
        return fused(partial, residual, norm_w, model.spec.rms_norm_eps, takes_dynamic_fp8(proj, residual))
    return add_rmsnorm_for(proj, model.ops, model.group.all_reduce(partial), residual, norm_w, model.spec.rms_norm_eps)
