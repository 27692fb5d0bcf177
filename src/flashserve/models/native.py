"""The native Llama-family model behind the runner's `StepModel` seam (as `hf.HFCausalLM` is for the
generic path): logits of a step's rows, the decode forwards that CUDA graphs capture (with and
without LoRA adapters), and the pieces between attention calls that piecewise graphs capture."""

from __future__ import annotations

from typing import Callable

import torch

from flashserve.attention.base import AttentionBackend
from flashserve.models.llama import LlamaModel
from flashserve.worker.piecewise_graph import LayerPieces


class NativeCausalLM:
    """The native Llama-family forward behind the runner's `StepModel` seam (as `hf.HFCausalLM`)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        return self.logits(self.model(input_ids, positions, backend), logits_indices)

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """float32 logits of the rows `logits_indices` of `hidden` (None: every row)."""
        return self.model.compute_logits(hidden if logits_indices is None else hidden[logits_indices])

    def layer_pieces(self, backend: AttentionBackend) -> LayerPieces:
        """The forward as pieces between attention calls (`worker/piecewise_graph.py`), without LoRA
        adapters: the graphs serve steps whose rows use none."""
        model, lora = self.model, self.model.lora
        rotate = model.rotates(backend)

        def steps(input_ids: torch.Tensor, positions: torch.Tensor):  # type: ignore[no-untyped-def]
            if lora is not None:
                lora.active = False
            return model.layer_steps(input_ids, positions, rotate)

        spec = model.rank_spec
        dtype = model.embed_tokens["weight"].dtype
        return LayerPieces(steps, lambda positions, out: model.attention(backend, positions, out), self.logits,
                           spec.num_heads, spec.head_dim, dtype)

    def decode_logits(self, backend: AttentionBackend) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        model = self.model
        if model.lora is None:
            return lambda ids, pos: model.compute_logits(model(ids, pos, backend))
        lora = model.lora

        def with_adapters(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            # A captured graph holds the adapters' GEMMs, replayed with any step's slots.
            lora.active = True
            return model.compute_logits(model(ids, pos, backend))

        return with_adapters

    def plain_decode_logits(self, backend: AttentionBackend) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """With LoRA adapters: `decode_logits` without them, for decode steps of base-model rows
        alone (a graph of its own, `CudaGraphRunner`'s plain_forward). None without LoRA."""
        model, lora = self.model, self.model.lora
        if lora is None:
            return None

        def without_adapters(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            lora.active = False
            return model.compute_logits(model(ids, pos, backend))

        return without_adapters
