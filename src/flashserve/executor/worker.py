"""What a tensor-parallel rank needs beside its runner (`executor/build.py build_runner`): its
device, whether the ranks take the fused all-reduce, the KV pages every rank can hold, the step's
wire format and the group that carries steps.

Every rank takes the same steps: the `SchedulerOutput` rank 0's scheduler made (new requests
once, then diffs), which each rank applies to its own input batch, plus the token rows rank 0
wants prompt logprobs for (they set the logits' rows, and the vocabulary all-gather needs the
same shape on every rank). A request's last token still in flight on rank 0's device reaches the
others by a broadcast of the step's ids (`ModelRunner` over a group). Grammars and bitmasks stay
on rank 0 (`SchedulerOutput.for_ranks`), which alone samples, so structured output works
unchanged over N ranks.

Steps travel through rank 0's shared-memory channel when rank 0 started the workers on its node
(`channel.StepChannel`), else over a gloo group of their own whose timeout is long: a worker
waits there for as long as the server sits idle, while the model's collectives keep the default
timeout. The gloo group also carries a step too large for the channel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flashserve.config import ModelConfig
from flashserve.distributed.comm import TPGroup, allreduce_fusion_blocker, local_rank, nvlink_gap, off_node_ranks
from flashserve.distributed.copy_engine import rendezvous_made_here
from flashserve.engine.outputs import SchedulerOutput
from flashserve.message.lora import LoRAAdapterError, LoRARequest
from flashserve.models.llama import LlamaModel
from flashserve.worker.assembly import pick_device
from flashserve.worker.runner import ModelRunner

logger = logging.getLogger(__name__)

# Steps of up to this many tokens take the fused all-reduce (`--enable-flashinfer-allreduce-fusion`);
# larger ones NCCL. Measured at four ranks of [tokens, 8192] bf16 from CUDA graphs
# (benchmark.tp_allreduce, 4 x H200): fused / NCCL 0.47 at 1 token, 0.63 at 16, 0.77 at 64, 1.11 at
# 256, 1.43 at 512, so decode-sized steps take it and prefill-sized ones don't. Its buffers take
# 4 x ranks x this x hidden_size x 2 bytes per rank.
FUSED_ALLREDUCE_MAX_TOKENS = 128
# How long a worker may wait for the next step: as long as the server may stay idle.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class LoRAUpdate:
    """Between steps: an adapter every worker rank loads (`add`, which rank 0 loaded and checked
    first) or forgets (`remove`, its id)."""

    add: LoRARequest | None = None
    remove: int | None = None


# A step (`SchedulerOutput.for_ranks`) and its prompt-logprob token rows, or an adapter update;
# None ends the workers' loop.
WireStep = tuple[SchedulerOutput, list[int]] | LoRAUpdate | None


def apply_lora_update(runner: ModelRunner, update: LoRAUpdate) -> None:
    """A worker rank's side of an adapter update. Rank 0 checked the adapter already; a worker
    that cannot read it logs why (a step that uses it then fails on that rank)."""
    if update.remove is not None:
        runner.remove_lora(update.remove)
    if update.add is not None:
        try:
            runner.add_lora(update.add)
        except LoRAAdapterError as exc:
            logger.error("rank %d could not load a LoRA adapter rank 0 loaded: %s", runner.group.rank, exc)


def control_group() -> Any:
    """The gloo group that carries steps (called by every rank, in the same order)."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def rank_device(name: str, several: bool = True) -> torch.device:
    """The device of `name` ("auto", "cuda", "cpu"...); a rank of several takes its local GPU."""
    device = pick_device(name)
    if several and device.type == "cuda":
        return torch.device("cuda", local_rank())
    return device


def check_allreduce_fusion(model_config: ModelConfig) -> None:
    """The fused all-reduce, when `--enable-flashinfer-allreduce-fusion` asks for it, runs on CUDA
    GPUs only."""
    if model_config.enable_flashinfer_allreduce_fusion and pick_device(model_config.device).type != "cuda":
        raise ValueError("--enable-flashinfer-allreduce-fusion needs CUDA GPUs")


def take_fused_allreduce(model_config: ModelConfig, group: TPGroup, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the ranks run each all-reduce and the add + RMSNorm after it as FlashInfer's one
    kernel (`FlashInferAllReduceNorm`) rather than NCCL's all-reduce and the norm.
    `--enable-flashinfer-allreduce-fusion` forces it (an error where it cannot run) and
    `--no-enable-flashinfer-allreduce-fusion` keeps NCCL. Unset, it is taken where it can run and
    NVLink connects every rank's GPU, where it measured faster than NCCL. Collective: the ranks
    agree, taking it only where every rank can."""
    setting = model_config.enable_flashinfer_allreduce_fusion
    if setting is False:
        return False
    reason = allreduce_fusion_blocker(group.world_size, device, dtype)
    if reason is None and setting is None:
        reason = nvlink_gap(range(group.world_size))
    reason = every_rank_able(reason, device)
    if reason is None:
        return True
    if setting:
        raise ValueError(f"--enable-flashinfer-allreduce-fusion: {reason}")
    if group.rank == 0:
        logger.info("all-reduce: NCCL, then the norm (FlashInfer's fused all-reduce is off: %s)", reason)
    return False


def every_rank_able(reason: str | None, device: torch.device) -> str | None:
    """None where no rank has a `reason` it cannot run something, else this rank's reason (or that
    another rank cannot). Collective: every rank gets the same answer."""
    able = torch.tensor([reason is None], dtype=torch.int32, device=device)
    dist.all_reduce(able, op=dist.ReduceOp.MIN)
    return None if able.item() else reason or "another rank cannot run it"


def copy_engine_blocker(world_size: int, device: torch.device) -> str | None:
    """Why `--tp-overlap-comm copy-engine` cannot run for these ranks, or None when it can: it maps
    every peer's buffer into each GPU (torch's symmetric memory) and moves the sums by peer copies,
    so it needs CUDA GPUs, every rank on this node and NVLink between them; and, as torch's symmetric
    memory meets only peers that have made as many rendezvous as this process, a process that has not
    built such a model before (`copy_engine.rendezvous_made_here`: a second `LLM` in one process, whose
    other ranks are new processes)."""
    if device.type != "cuda":
        return "it needs CUDA GPUs"
    if rendezvous_made_here():
        return ("one model a process: this process built a model with it before, and torch's symmetric memory "
                "cannot meet new rank processes from one that has (start a new process, or use nccl)")
    spread = off_node_ranks(world_size)
    if spread is not None:
        return f"it maps GPU memory within one node, and {spread}"
    return nvlink_gap(range(world_size))


def check_copy_engine_sums(group: TPGroup, device: torch.device) -> None:
    """Raises on every rank alike where any rank cannot run the copy-engine all-reduce
    (`copy_engine_blocker`). Collective."""
    reason = every_rank_able(copy_engine_blocker(group.world_size, device), device)
    if reason is not None:
        raise ValueError(f"--tp-overlap-comm copy-engine: {reason}")


def shared_kv_pages(pages: int, page_bytes: int, device: torch.device, group: TPGroup) -> int:
    """The KV pages every rank takes: the fewest any rank (this one has memory for `pages`) holds,
    so that the page ids rank 0's scheduler hands out are valid everywhere. Collective."""
    mine = torch.tensor([pages], dtype=torch.long, device=device)
    every = [torch.zeros_like(mine) for _ in range(group.world_size)]
    dist.all_gather(every, mine)
    rank_pages = [int(t.item()) for t in every]
    if group.rank == 0:
        logger.info(
            "KV cache pages each rank has memory for: %s (%s GB); every rank takes %d",
            rank_pages, [round(n * page_bytes / 1e9, 2) for n in rank_pages], min(rank_pages),
        )
    return min(rank_pages)


def release_before_group_end(runner: ModelRunner) -> None:
    """Drops `runner`'s piecewise, verify and decode graphs (`CudaGraphRunner.release`), then the
    buffers of its fused and copy-engine all-reduces, before its rank leaves the group. Each is
    released even where one before it fails (a graph still holding NCCL's communicator would stall
    the group's end); the first failure is raised after."""
    failures: list[Exception] = []
    for name in ("piecewise_graphs", "verify_graphs", "graphs"):
        graphs = getattr(runner, name)
        setattr(runner, name, None)
        if graphs is not None:
            try:
                graphs.release()
            except Exception as exc:  # noqa: BLE001 - the others are released first, then it is raised
                failures.append(exc)
    native = getattr(runner.model, "model", None)
    if isinstance(native, LlamaModel):
        native.close_collective_buffers()
    if failures:
        raise failures[0]
