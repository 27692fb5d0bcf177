"""The collectives a tensor-parallel forward needs, behind one small interface.

The model calls `group.all_reduce` after its row-parallel projections and `group.all_gather`
on the vocabulary-parallel logits. `SingleRankGroup` makes both identities, and the model does
not call them at all on one rank, so that path costs nothing. `TorchDistGroup` runs them over
torch.distributed: gloo on a CPU, NCCL on CUDA GPUs.

`init_tp_group` reads the standard env:// variables (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK), so that torchrun can launch ranks on several nodes as well as
`launch.RankProcesses` on one.
"""

from __future__ import annotations

import os
from datetime import timedelta
from itertools import combinations
from typing import Any, MutableMapping, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from flashserve.layers.fp8 import FP8_DTYPE, QuantizedRows
from flashserve.layers.pdl import launches_early

Tensor = torch.Tensor

# NVLink multicast (NVLS, symmetric-memory multicast) is off in every rank process: on the GPU
# hosts it is not usable, and a collective that tries it fails or hangs.
MULTICAST_OFF_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# torch 2.13 renamed all_gather_into_tensor (the old name warns); older releases have only it.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# How long a collective (and the rendezvous) may wait for a peer before it raises.
DEFAULT_TIMEOUT = timedelta(minutes=5)


@runtime_checkable
class TPGroup(Protocol):
    """The ranks that share one model's shards. Every rank calls every collective in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sums `t` over the ranks in place and returns it."""
        ...

    def all_reduce_start(self, t: Tensor) -> PendingSum:
        """Starts summing `t` over the ranks in place; `wait()` on the result returns it summed.
        On CUDA the sum runs on the communicator's stream, beside the kernels enqueued after it."""
        ...

    def all_gather(self, t: Tensor, dim: int = -1) -> Tensor:
        """Concatenates every rank's `t` (same shape on all) along `dim`, in rank order."""
        ...

    def broadcast(self, t: Tensor) -> Tensor:
        """Overwrites `t` on every rank with rank 0's `t` (same shape and dtype on all), in place."""
        ...


class PendingSum:
    """An all-reduce in flight (`TPGroup.all_reduce_start`). `wait()` returns the summed tensor; on
    CUDA the current stream then waits for the sum, the host does not."""

    __slots__ = ("_t", "_work")

    def __init__(self, t: Tensor, work: Any = None) -> None:
        self._t, self._work = t, work

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._t


class SingleRankGroup:
    """One rank holds the whole model: the collectives return their input."""

    rank = 0
    world_size = 1

    def all_reduce(self, t: Tensor) -> Tensor:
        return t

    def all_reduce_start(self, t: Tensor) -> PendingSum:
        return PendingSum(t)

    def all_gather(self, t: Tensor, dim: int = -1) -> Tensor:
        return t

    def broadcast(self, t: Tensor) -> Tensor:
        return t

    def __repr__(self) -> str:
        return "SingleRankGroup()"


class TorchDistGroup:
    """Collectives over a torch.distributed process group (the default group unless given)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, t: Tensor) -> Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group)
        return t

    def all_reduce_start(self, t: Tensor) -> PendingSum:
        return PendingSum(t, dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group, async_op=True))

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The torch.distributed group these collectives run in."""
        return self._group if self._group is not None else dist.group.WORLD

    def all_gather(self, t: Tensor, dim: int = -1) -> Tensor:
        t = t.contiguous()
        # Gathered along the first dimension (one contiguous block per rank), then laid side by side.
        out = t.new_empty((self._world_size * t.shape[0], *t.shape[1:]) if t.dim() else (self._world_size,))
        _all_gather_single(out, t, group=self._group)
        return torch.cat(out.view(self._world_size, *t.shape).unbind(0), dim=dim)

    def broadcast(self, t: Tensor) -> Tensor:
        dist.broadcast(t, group_src=0, group=self._group)
        return t

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def __repr__(self) -> str:
        return f"TorchDistGroup(rank={self._rank}, world_size={self._world_size})"


class FusedAllReduceNorm(Protocol):
    """A row-parallel projection's all-reduce, the residual add and the RMSNorm after it in one
    step, for steps of up to `max_tokens` tokens: (partial, residual, norm weight, eps) ->
    (normed, residual + sum of partial over the ranks)."""

    max_tokens: int

    def __call__(
        self, partial: Tensor, residual: Tensor, weight: Tensor, eps: float, quantize: bool = False
    ) -> tuple[Tensor | QuantizedRows, Tensor]:
        """`quantize`: the normed rows quantized to FP8 per token (for an FP8 projection)."""
        ...

    def close(self) -> None: ...


def off_node_ranks(world_size: int) -> str | None:
    """None where all `world_size` ranks run on this node (torchrun's LOCAL_WORLD_SIZE, or the
    ranks this process started), else how they are spread."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return None if local == world_size else f"the {world_size} ranks run {local} to a node"


def allreduce_fusion_blocker(world_size: int, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `FlashInferAllReduceNorm` cannot run for these ranks, or None when it can: it needs CUDA
    GPUs, a float16 or bfloat16 model, every rank on this node (its buffers are shared by CUDA IPC)
    and flashinfer.comm. The same answer on every rank of a node."""
    if device.type != "cuda":
        return "it needs CUDA GPUs"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it takes float16 or bfloat16 models, not {dtype}"
    spread = off_node_ranks(world_size)
    if spread is not None:
        return f"it shares GPU memory within one node, and {spread}"
    try:
        import flashinfer.comm  # noqa: F401  (needs cuda-python and nvidia-ml-py besides flashinfer)
    except ImportError as exc:
        return f"flashinfer.comm failed to import: {exc}"
    return None


def nvlink_gap(devices: Sequence[int]) -> str | None:
    """Which pair of these local CUDA devices NVLink does not connect, or None when NVLink connects
    every pair (NVML's peer-to-peer status, by UUID, so CUDA_VISIBLE_DEVICES may reorder them)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no NVML: nothing says the GPUs are linked
        return f"NVML is not available ({exc})"
    try:
        handles = [pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(d).uuid}")
                   for d in devices]  # fmt: skip
        for (i, a), (j, b) in combinations(zip(devices, handles), 2):
            status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if status != pynvml.NVML_P2P_STATUS_OK:
                return f"NVLink does not connect cuda:{i} and cuda:{j}"
    except pynvml.NVMLError as exc:
        return f"NVML could not tell how the GPUs are linked ({exc})"
    finally:
        pynvml.nvmlShutdown()
    return None


class FlashInferAllReduceNorm:
    """FlashInfer's TensorRT-LLM all-reduce with the residual add and RMSNorm fused into its
    kernel (pattern kARResidualRMSNorm; kARResidualRMSNormDynamicFP8Quant where an FP8 projection
    reads the norm, which the same kernel then quantizes per token): the ranks' GPUs write into each other's buffers over
    NVLink (one-shot for small steps), with no NCCL launch, no separate norm kernel and no NVLink
    multicast (`backend="trtllm"`; "auto" may pick a multicast backend). The buffers are shared by
    CUDA IPC, so every rank must be on this node. CUDA graphs capture it. On Hopper it launches
    with PDL (`layers/pdl.py`), so its launch overlaps the end of the projection before it.

    Collective to build: every rank of `group` (NCCL) constructs it at the same point.
    """

    def __init__(self, group: TPGroup, max_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
        reason = allreduce_fusion_blocker(group.world_size, torch.device("cuda"), dtype)
        if reason is not None:
            raise ValueError(f"the fused all-reduce cannot run here: {reason}")
        from flashinfer.comm import AllReduceFusionPattern, allreduce_fusion, create_allreduce_fusion_workspace

        from flashserve.attention.flashinfer_modules import use_prebuilt_modules

        use_prebuilt_modules(torch.device("cuda", torch.cuda.current_device()))
        self.max_tokens = max_tokens
        self._pdl = launches_early(torch.device("cuda", torch.cuda.current_device()))
        self._fusion = allreduce_fusion
        self._pattern = AllReduceFusionPattern.kARResidualRMSNorm
        self._fp8_pattern = AllReduceFusionPattern.kARResidualRMSNormDynamicFP8Quant
        self._workspace = create_allreduce_fusion_workspace(
            backend="trtllm", world_size=group.world_size, rank=group.rank, max_token_num=max_tokens,
            hidden_dim=hidden_size, dtype=dtype, gpus_per_node=group.world_size,
        )  # fmt: skip

    def __call__(
        self, partial: Tensor, residual: Tensor, weight: Tensor, eps: float, quantize: bool = False
    ) -> tuple[Tensor | QuantizedRows, Tensor]:
        summed = torch.empty_like(residual)
        if quantize:
            # One scale a token: amax / 448, at least 1 / (448 * 512), as `fp8.quantize_rows`.
            q = torch.empty(partial.shape, dtype=FP8_DTYPE, device=partial.device)
            s = torch.empty((partial.shape[0], 1), dtype=torch.float32, device=partial.device)
            self._fusion(
                input=partial.contiguous(), workspace=self._workspace, pattern=self._fp8_pattern,
                launch_with_pdl=self._pdl, residual_in=residual, residual_out=summed, quant_out=q, scale_out=s,
                rms_gamma=weight, rms_eps=eps,
            )  # fmt: skip
            return QuantizedRows(q, s), summed
        normed = torch.empty_like(partial)
        self._fusion(
            input=partial.contiguous(), workspace=self._workspace, pattern=self._pattern,
            launch_with_pdl=self._pdl, residual_in=residual,
            residual_out=summed, norm_out=normed, rms_gamma=weight, rms_eps=eps,
        )  # fmt: skip
        return normed, summed

    def close(self) -> None:
        """Frees the shared buffers (every rank, before the group is destroyed)."""
        if self._workspace is not None:
            self._workspace.destroy()
            self._workspace = None


def disable_multicast(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Sets each variable of `MULTICAST_OFF_ENV` that `env` lacks; a value already there wins."""
    for key, value in MULTICAST_OFF_ENV.items():
        env.setdefault(key, value)
    return env


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; RANK on a single node)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def init_tp_group(device: torch.device | str = "cpu", *, timeout: timedelta = DEFAULT_TIMEOUT) -> TPGroup:
    """Joins the ranks named by the env:// variables; a `SingleRankGroup` when WORLD_SIZE is 1 or unset.

    device: where this rank's tensors live: NCCL on CUDA (pass cuda:LOCAL_RANK), gloo elsewhere.
    The multicast switches are set in this process's environment first, before NCCL reads them.
    """
    disable_multicast(os.environ)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return SingleRankGroup()
    device = torch.device(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", init_method="env://", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    return TorchDistGroup()


def close_tp_group(group: TPGroup) -> None:
    """Leaves the process group that `init_tp_group` joined (nothing to do on one rank)."""
    if isinstance(group, TorchDistGroup) and dist.is_initialized():
        dist.destroy_process_group()
