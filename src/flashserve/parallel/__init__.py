"""Tensor parallelism: the ranks' communication, which slice of each weight a rank holds, the
rank processes, and a reader that loads a rank's slices straight from safetensors.

- `comm.py`      `TPGroup` (rank, world size, all_reduce, all_gather): one rank or torch.distributed
- `sharding.py`  `ShardLayout`: a rank's heads, MLP columns and vocabulary rows; `TensorSlice`
- `launch.py`    `RankProcesses`: start ranks as child processes, fail fast when one dies
- `checkpoint.py` read a rank's shard of a Llama-family checkpoint from its safetensors files
- `worker.py`    a rank's runner over its shard, the step's wire format, the worker ranks' loop
- `executor.py`  rank 0: starts the workers, sends them each step (`LLM(..., tensor_parallel_size=N)`)

worker.py and executor.py are not re-exported: they import the model, which imports this package.
"""

from flashserve.parallel.comm import SingleRankGroup, TorchDistGroup, TPGroup, close_tp_group, init_tp_group
from flashserve.parallel.launch import RankFailed, RankProcesses
from flashserve.parallel.sharding import ShardLayout, TensorSlice

__all__ = [
    "RankFailed", "RankProcesses", "ShardLayout", "SingleRankGroup", "TPGroup", "TensorSlice", "TorchDistGroup",
    "close_tp_group", "init_tp_group",
]  # fmt: skip
