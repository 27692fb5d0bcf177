"""Which slice of each full checkpoint tensor a tensor-parallel rank holds.

Megatron's split of a Llama layer: q/k/v and gate/up are column-parallel (a rank computes its
own heads and its own MLP columns from the replicated hidden state); o_proj and down_proj are
row-parallel (a rank multiplies its heads' or columns' share, and an all-reduce sums the
partial outputs). The LM head and the embedding are vocabulary-parallel: a rank holds the same
rows of the vocabulary of both, computes logits for its rows (then they are gathered), and looks
up the tokens that fall in its rows (zeros for the others, then an all-reduce, which is exact).
A tied model's rank holds those rows once, for both. Norms are replicated.

Everything here is a pure function of the shapes and (rank, world_size), and a slice is a plain
value (`TensorSlice`: a range of one dimension, zero-padded to a size), so that the same answer
serves a full state dict (`TensorSlice.take`) and a safetensors reader that loads only those
bytes (`TensorSlice.read`).

Sizes that do not divide by the world size are padded rather than refused where zeros are exact:
the vocabulary (padded logits are cut off after the gather) and the MLP's intermediate size
(silu(0) * 0 = 0, and zero columns of down_proj add nothing). Query heads must divide; KV heads
must divide the world size or be divisible by it: with fewer KV heads than ranks, a rank keeps
the one KV head its query heads attend with (replicated on the ranks that share it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# The kinds of checkpoint tensor, as `models/llama_weights.py` names them, that are split; any other kind
# (norms, q/k norms) is replicated whole.
_Q_ROWS = ("q", "q_bias")
_KV_ROWS = ("k", "v", "k_bias", "v_bias")
_MLP_ROWS = ("gate", "up", "gate_bias", "up_bias")
# Biases added after a row-parallel projection: once, on rank 0, or the all-reduce adds them N times.
_FIRST_RANK_ONLY = ("o_bias", "down_bias")


@dataclass(frozen=True)
class TensorSlice:
    """Indices [start, stop) of dimension `dim` of a full tensor, zero-padded to `size` there."""

    dim: int
    start: int
    stop: int
    size: int

    def shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        return full_shape[: self.dim] + (self.size,) + full_shape[self.dim + 1 :]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The slice of an in-memory tensor, as a tensor of its own (it holds no view of `full`)."""
        part = full.narrow(self.dim, self.start, self.stop - self.start)
        return self._padded(part, tuple(full.shape), full.dtype)

    def read(self, source: Any) -> torch.Tensor:
        """The slice of a safetensors `PySafeSlice` (`safe_open(...).get_slice(name)`): reads only it."""
        full_shape = tuple(source.get_shape())
        if self.stop == self.start:
            return torch.zeros(self.shape(full_shape))  # nothing to read; the caller casts
        index = (slice(None),) * self.dim + (slice(self.start, self.stop),)
        part = source[index]  # a tensor of its own already
        return part if part.shape[self.dim] == self.size else self._padded(part, full_shape, part.dtype)

    def _padded(self, part: torch.Tensor, full_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if part.shape[self.dim] == self.size:
            return part.clone(memory_format=torch.contiguous_format)
        out = torch.zeros(self.shape(full_shape), dtype=dtype, device=part.device)
        out.narrow(self.dim, 0, part.shape[self.dim]).copy_(part)
        return out


def split_evenly(total: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(start, stop, size) of a rank's share of `total` items in `size = ceil(total / world_size)`
    blocks: the last ranks' blocks run short (or empty) and are padded to `size`."""
    size = -(-total // world_size)
    start = min(rank * size, total)
    return start, min(start + size, total), size


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a Llama-family model. `world_size == 1` is the whole model.

    num_heads / num_kv_heads are the rank's query and KV heads: its attention backend is built
    with them. intermediate_size and vocab_size are the rank's (padded) MLP and LM-head rows.
    """

    rank: int
    world_size: int
    head_dim: int
    hidden_size: int
    num_heads: int
    q_head_start: int
    num_kv_heads: int
    kv_head_start: int
    mlp_start: int
    mlp_stop: int
    intermediate_size: int
    vocab_start: int
    vocab_stop: int
    vocab_size: int
    full_vocab_size: int

    @classmethod
    def build(
        cls, *, rank: int, world_size: int, num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int,
        intermediate_size: int, vocab_size: int,
    ) -> ShardLayout:  # fmt: skip
        """Raises ValueError when the heads cannot be split over `world_size` ranks."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if num_heads % world_size:
            raise ValueError(f"{num_heads} attention heads do not split over {world_size} ranks: "
                             f"choose a tensor-parallel size that divides {num_heads}")  # fmt: skip
        if num_kv_heads % world_size == 0:
            kv_heads, kv_start = num_kv_heads // world_size, rank * num_kv_heads // world_size
        elif world_size % num_kv_heads == 0:
            # Each rank's query heads fall in one KV group: keep that group's KV head.
            kv_heads, kv_start = 1, rank * num_kv_heads // world_size
        else:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {world_size} ranks (nor replicate "
                             f"evenly): choose a tensor-parallel size that divides or is a multiple of "
                             f"{num_kv_heads}")  # fmt: skip
        q_heads = num_heads // world_size
        mlp_start, mlp_stop, mlp_size = split_evenly(intermediate_size, rank, world_size)
        vocab_start, vocab_stop, vocab_rows = split_evenly(vocab_size, rank, world_size)
        return cls(
            rank=rank, world_size=world_size, head_dim=head_dim, hidden_size=hidden_size,
            num_heads=q_heads, q_head_start=rank * q_heads, num_kv_heads=kv_heads, kv_head_start=kv_start,
            mlp_start=mlp_start, mlp_stop=mlp_stop, intermediate_size=mlp_size,
            vocab_start=vocab_start, vocab_stop=vocab_stop, vocab_size=vocab_rows, full_vocab_size=vocab_size,
        )  # fmt: skip

    @classmethod
    def for_spec(cls, spec: Any, rank: int, world_size: int) -> ShardLayout:
        """The layout of a `weights.LlamaSpec` (or anything with its shape fields)."""
        return cls.build(
            rank=rank, world_size=world_size, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            vocab_size=spec.vocab_size,
        )  # fmt: skip

    @property
    def is_whole(self) -> bool:
        return self.world_size == 1

    def rank_spec(self, spec: T) -> T:
        """`spec` (a `weights.LlamaSpec`) with this rank's heads and MLP size: the shapes of its
        layers. The spec itself on one rank."""
        if self.is_whole:
            return spec
        return dataclasses.replace(  # type: ignore[type-var]
            spec, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, intermediate_size=self.intermediate_size
        )

    def slice_for(self, kind: str) -> TensorSlice | None:
        """The rank's slice of a checkpoint tensor of this kind (`models/llama_weights.py`'s per-layer keys,
        "embed_tokens", "lm_head", "norm"); None: the rank holds all of it."""
        if self.is_whole:
            return None
        d = self.head_dim
        if kind in _Q_ROWS:
            return TensorSlice(0, self.q_head_start * d, (self.q_head_start + self.num_heads) * d, self.num_heads * d)
        if kind in _KV_ROWS:
            start, rows = self.kv_head_start * d, self.num_kv_heads * d
            return TensorSlice(0, start, start + rows, rows)
        if kind == "o":
            return TensorSlice(1, self.q_head_start * d, (self.q_head_start + self.num_heads) * d, self.num_heads * d)
        if kind in _MLP_ROWS:
            return TensorSlice(0, self.mlp_start, self.mlp_stop, self.intermediate_size)
        if kind == "down":
            return TensorSlice(1, self.mlp_start, self.mlp_stop, self.intermediate_size)
        if kind in ("lm_head", "embed_tokens"):
            return TensorSlice(0, self.vocab_start, self.vocab_stop, self.vocab_size)
        if kind in _FIRST_RANK_ONLY:
            # Rank 0 keeps the bias; the others hold zeros of its shape (an exact no-op add).
            return TensorSlice(0, 0, self.hidden_size if self.rank == 0 else 0, self.hidden_size)
        return None
