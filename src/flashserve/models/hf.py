"""Generic path: any transformers CausalLM, its attention routed to our paged backend.

A step's tokens are packed as one sequence (batch 1, `position_ids` = the layout's positions) and
the model runs without transformers' own cache. transformers hands each attention layer's q/k/v
(RoPE applied) to the function registered under `ATTN_IMPLEMENTATION`; the backend arrives there
through the model's forward kwargs, which transformers passes down to the attention function, so
no global state is involved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flashserve.attention.base import AttentionBackend

# No "flash" in the name: transformers 5 takes such names for hub kernels and tries to fetch one.
ATTN_IMPLEMENTATION = "paged_kv"
# The forward kwarg that carries the backend to the attention function.
BACKEND_KWARG = "paged_backend"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None).

    The mask is unused: the backend knows each request's causal span from its plan. transformers
    builds none for an implementation it has no mask function for.
    """
    backend: AttentionBackend | None = kwargs.get(BACKEND_KWARG)
    if backend is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION!r} attention needs the backend in the kwarg {BACKEND_KWARG!r}")
    if query.shape[0] != 1:
        raise ValueError(f"the step's tokens are packed as one sequence, got batch {query.shape[0]}")
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = backend.forward(module.layer_idx, q, k, v)
    return out.unsqueeze(0), None


def register_paged_attention() -> None:
    """Makes `ATTN_IMPLEMENTATION` a valid attn_implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def use_paged_attention(model: torch.nn.Module) -> None:
    """Switches a loaded model's attention layers to the paged backend."""
    register_paged_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        # transformers refuses (with a warning) for models whose attention does not dispatch
        # through AttentionInterface; running them would silently bypass the KV cache.
        raise ValueError(f"{type(model).__name__} does not support transformers' AttentionInterface")


def model_shape(hf_config: Any) -> tuple[int, int, int, int]:
    """(num_layers, num_heads, num_kv_heads, head_dim) of a transformers config."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return text.num_hidden_layers, num_heads, num_kv_heads, head_dim


def attention_scale(model: torch.nn.Module) -> float | None:
    """The softmax scale the model's attention layers use (`scaling`), None if not exposed."""
    for module in model.modules():
        if hasattr(module, "layer_idx") and isinstance(getattr(module, "scaling", None), float):
            return module.scaling
    return None


class HFCausalLM:
    """Runs a transformers CausalLM on a packed step; computes logits only for sampled rows."""

    def __init__(self, model: torch.nn.Module) -> None:
        use_paged_attention(model)
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        if self.decoder is None or self.decoder is model or self.lm_head is None:
            raise ValueError(f"{type(model).__name__}: expected a decoder and an lm_head")
        self.softcap: float | None = getattr(model.config, "final_logit_softcapping", None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """input_ids/positions [T] (backend already planned) -> float32 logits [len(logits_indices), V]
        (every row's when None)."""
        outputs = self.decoder(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            **{BACKEND_KWARG: backend},
        )
        hidden = outputs.last_hidden_state[0]
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        # The lm_head on the sampled rows only: a long prefill needs one row, not T.
        logits = self.lm_head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def decode_logits(self, backend: AttentionBackend) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """`(input_ids, positions) -> logits` of every row: what a decode-step CUDA graph captures."""
        return lambda ids, pos: self.forward(ids, pos, backend, None)
