"""The native Llama-family model behind the runner's `StepModel` seam (as `hf.HFCausalLM` is for the
generic path): logits of a step's rows, and the decode forwards that CUDA graphs capture (with and
without LoRA adapters)."""

from __future__ import annotations

from typing import Callable

import torch

from flashserve.attention.base import AttentionBackend
from flashserve.models.llama import LlamaModel


class NativeCausalLM:
    """The native Llama-family forward behind the runner's `StepModel` seam (as `hf.HFCausalLM`)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, backend)
        return self.model.compute_logits(hidden if logits_indices is None else hidden[logits_indices])

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
