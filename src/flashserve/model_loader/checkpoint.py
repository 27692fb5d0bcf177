"""Reads a Llama-family checkpoint's safetensors files into the native model's weights, taking
only a tensor-parallel rank's slice of each tensor; or draws a dummy checkpoint's random weights
the same way, one tensor at a time.

A rank that loads through a whole transformers model holds every weight in memory before it
keeps its share; here each rank asks safetensors for its rows or columns (`get_slice`), so the
host memory of N ranks on one node is about one model, not N. The tensor names and shapes are
checked against the config from the files' headers before anything is read.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from safetensors import safe_open

from flashserve.distributed.comm import SingleRankGroup, TPGroup
from flashserve.distributed.sharding import ShardLayout
from flashserve.layers.ops import Ops
from flashserve.layers.quantization import projection_loading
from flashserve.models.llama import LlamaModel
from flashserve.models.llama_weights import LlamaSpec, check_hf_shapes, expected_hf_shapes, fuse_weights

if TYPE_CHECKING:
    from flashserve.layers.quantization import ProjectionLoader

_INDEX = "model.safetensors.index.json"
_EMBEDDING, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_SINGLE = "model.safetensors"


def safetensors_files(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """The weight files of a checkpoint directory (its index's files, else model.safetensors,
    else every .safetensors file), or the given file(s)."""
    if not isinstance(path, (str, os.PathLike)):
        return [os.fspath(p) for p in path]
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [path]
    index = os.path.join(path, _INDEX)
    if os.path.isfile(index):
        # Beside a transformers index there may be other files (Mistral's consolidated.safetensors).
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    if os.path.isfile(os.path.join(path, _SINGLE)):
        return [os.path.join(path, _SINGLE)]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return files


def read_llama_shard(
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    spec: LlamaSpec,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: ShardLayout | None = None,
    projections: ProjectionLoader | None = None,
) -> dict[str, torch.Tensor]:
    """The native weights (`weights.fuse_weights` names) of `shard`'s rank, or of the whole model;
    `projections`: an FP8 checkpoint's loader (its scales are read and sliced with the weights).

    Raises WeightMismatchError when the files' tensors do not match `spec`.
    """
    device = torch.device(device)
    with contextlib.ExitStack() as stack:
        owner: dict[str, Any] = {}
        for file in safetensors_files(path):
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for name in handle.keys():
                owner[name] = handle
        stored = {name: name for name in owner}
        if spec.tie_word_embeddings and _EMBEDDING not in owner and _LM_HEAD in owner:
            # A tied pair saved once (safetensors keeps one name of shared tensors, the GGUF cache's
            # files keep the head's): the embedding is that tensor.
            stored = {(_EMBEDDING if name == _LM_HEAD else name): name for name in owner}
        scheme = projections.scheme if projections is not None else None
        check_hf_shapes({name: tuple(owner[s].get_slice(s).get_shape()) for name, s in stored.items()}, spec, scheme)

        def read(name: str, kind: str) -> torch.Tensor:
            where = shard.slice_for(kind) if shard is not None else None
            handle, name = owner[stored[name]], stored[name]
            return handle.get_tensor(name) if where is None else where.read(handle.get_slice(name))

        return fuse_weights(read, spec, dtype, device, shard, projections)


@dataclass(frozen=True)
class DummyCheckpoint:
    """Random weights in a checkpoint's shapes (`load_format="dummy"`): matrices and embeddings
    normal(0, `std`) as transformers initialises them, norms 1, biases 0.

    Each tensor is drawn whole on the device from a generator seeded by `seed` and its name, then
    cut to the rank's slice: every rank count draws the same model (tensor-parallel ranks agree
    with one rank), and a rank holds its shard plus one whole tensor at a time, never the model.
    """

    seed: int = 0
    std: float = 0.02

    def read_llama_shard(
        self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str, shard: ShardLayout | None = None,
        projections: ProjectionLoader | None = None,
    ) -> dict[str, torch.Tensor]:
        """The native weights of `shard`'s rank, or of the whole model (`read_llama_shard`'s);
        `projections` quantizes the drawn projections at load."""
        device = torch.device(device)
        shapes = expected_hf_shapes(spec)

        def read(name: str, kind: str) -> torch.Tensor:
            shape = shapes[name]
            if kind.endswith("norm"):
                full = torch.ones(shape, dtype=dtype, device=device)
            elif kind.endswith("bias"):
                full = torch.zeros(shape, dtype=dtype, device=device)
            else:
                gen = torch.Generator(device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, self.std, generator=gen)
            where = shard.slice_for(kind) if shard is not None else None
            return full if where is None else where.take(full)

        return fuse_weights(read, spec, dtype, device, shard, projections)


def load_llama(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | DummyCheckpoint,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    spec: LlamaSpec | None = None,
    max_positions: int | None = None,
    ops: Ops | str = "auto",
    compile: bool = False,
    group: TPGroup | None = None,
    quantization: str | None = None,
) -> LlamaModel:
    """The native model of the rank's shard, read straight from a checkpoint's safetensors files
    (only the rank's slice of each tensor), or drawn from a `DummyCheckpoint` a tensor at a time;
    no transformers model is built. source: a checkpoint directory, its .safetensors files, or a
    DummyCheckpoint. spec: `hf_config`'s, when the caller has it already. The other arguments and
    errors are `LlamaModel.from_hf`'s; the architecture is the config's. An FP8 checkpoint (its
    config's `quantization_config`) loads in its format; dummy weights of such a config are drawn in
    high precision and quantized at load.
    """
    device = torch.device(device)
    spec = spec if spec is not None else LlamaSpec.from_hf_config(hf_config)
    group = group if group is not None else SingleRankGroup()
    shard = ShardLayout.for_spec(spec, group.rank, group.world_size)
    dummy = isinstance(source, DummyCheckpoint)
    scheme, loader = projection_loading(hf_config, quantization, dtype, device, compile, dense_source=dummy)
    if isinstance(source, DummyCheckpoint):
        weights = source.read_llama_shard(spec, dtype, device, shard, loader)
    else:
        weights = read_llama_shard(source, spec, dtype, device, shard, loader)
    return LlamaModel.from_weights(spec, weights, dtype, device, max_positions, ops, compile, group, scheme)
