"""A tensor-parallel rank's runner, the step's wire format, and the worker ranks' loop.

Every rank builds the same runner over its own shard (`build_rank_runner`): the native model
with `group`, an attention backend with the rank's heads, and a KV cache with as many pages as
the smallest rank can hold, so that the page ids rank 0's scheduler hands out are valid
everywhere. Rank 0 schedules and samples; ranks 1..N-1 run `run_worker`: receive a step, run
the same forward (the collectives inside it pair up with rank 0's), drop the logits.

Every rank takes the same steps: the `SchedulerOutput` rank 0's scheduler made (new requests
once, then diffs), which each rank applies to its own input batch, plus the token rows rank 0
wants prompt logprobs for (they set the logits' rows, and the vocabulary all-gather needs the
same shape on every rank). A request's last token still in flight on rank 0's device reaches the
others by a broadcast of the step's ids (`RankRunner`). Grammars and bitmasks stay on rank 0
(`SchedulerOutput.for_ranks`), which alone samples, so structured output works unchanged over N
ranks.

Steps travel through rank 0's shared-memory channel when rank 0 started the workers on its node
(`channel.StepChannel`), else over a gloo group of their own whose timeout is long: a worker
waits there for as long as the server sits idle, while the model's collectives keep the default
timeout. The gloo group also carries a step too large for the channel.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from datetime import timedelta
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flashserve.attention import get_backend_cls
from flashserve.attention.kv_quant import resolve_kv_cache_dtype
from flashserve.config import CacheConfig, ModelConfig
from flashserve.distributed.comm import (
    TPGroup, allreduce_fusion_blocker, close_tp_group, init_tp_group, local_rank, nvlink_gap,
)  # fmt: skip
from flashserve.engine.outputs import SchedulerOutput
from flashserve.executor.channel import GlooSteps, StepChannel
from flashserve.model_loader import LoadedModel, load
from flashserve.models.llama import LlamaModel, NativeCausalLM
from flashserve.models.llama_weights import UnsupportedModelError
from flashserve.worker.assembly import (
    attention_dtype, backend_options, capture_decode_graphs, kv_page_bytes, num_kv_pages, pick_backend, pick_device,
    pick_sampler,
)  # fmt: skip
from flashserve.worker.input_batch import BatchRow
from flashserve.worker.runner import LaunchedStep, ModelRunner, TokenSampler
from flashserve.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# Steps of up to this many tokens take the fused all-reduce (`--enable-flashinfer-allreduce-fusion`);
# larger ones NCCL. Measured at four ranks of [tokens, 8192] bf16 from CUDA graphs
# (benchmark.tp_allreduce, 4 x H200): fused / NCCL 0.47 at 1 token, 0.63 at 16, 0.77 at 64, 1.11 at
# 256, 1.43 at 512, so decode-sized steps take it and prefill-sized ones don't. Its buffers take
# 4 x ranks x this x hidden_size x 2 bytes per rank.
FUSED_ALLREDUCE_MAX_TOKENS = 128
# How long a worker may wait for the next step: as long as the server may stay idle.
CONTROL_TIMEOUT = timedelta(days=365)

# A step (`SchedulerOutput.for_ranks`) and its prompt-logprob token rows; None ends the workers' loop.
WireStep = tuple[SchedulerOutput, list[int]] | None
# Capture decode CUDA graphs for batch sizes up to this one, as rank 0 does at the same time.
WireCapture = tuple[str, int]
CAPTURE = "capture"


def control_group() -> Any:
    """The gloo group that carries steps (called by every rank, in the same order)."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def rank_device(name: str) -> torch.device:
    device = pick_device(name)
    if device.type == "cuda":
        return torch.device("cuda", local_rank())
    return device


class RankRunner(ModelRunner):
    """A rank's runner over its shard. A step may be launched behind the one still running on
    the device: a request's last token, sampled there on rank 0's device and never on the
    host, reaches the other ranks by a broadcast of the step's token ids in the model's group
    (rank 0 fills them from the step before, the others receive them), so that every rank
    embeds the same tokens."""

    def __init__(self, model: NativeCausalLM, device: torch.device, backend: Any, sampler: TokenSampler,
                 page_size: int, group: TPGroup) -> None:  # fmt: skip
        super().__init__(model, device, backend, sampler, page_size)
        self.group = group

    def _step_inputs(self, rows: list[BatchRow], prompt_rows: Sequence[int], previous: LaunchedStep | None) -> StepInputs:
        inputs = self.inputs.build(rows, prompt_rows, self.cascade, previous, fill_in_flight=self.group.rank == 0)
        if inputs.has_in_flight:  # rank 0's ids, tokens in flight filled in, replace the placeholders
            inputs.input_ids = self.group.broadcast(inputs.input_ids)
        return inputs


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
    able = torch.tensor([reason is None], dtype=torch.int32, device=device)
    dist.all_reduce(able, op=dist.ReduceOp.MIN)
    if able.item():
        return True
    if setting:
        raise ValueError(f"--enable-flashinfer-allreduce-fusion: {reason or 'another rank cannot run it'}")
    if group.rank == 0:
        logger.info("all-reduce: NCCL, then the norm (FlashInfer's fused all-reduce is off: %s)",
                    reason or "another rank cannot run it")  # fmt: skip
    return False


def build_rank_runner(
    model_config: ModelConfig, cache_config: CacheConfig, group: TPGroup, sampler: TokenSampler | None = None
) -> tuple[RankRunner, LoadedModel, int]:
    """This rank's runner over its shard; (runner, loaded model with max_model_len capped by the
    cache, number of pages, the same on every rank). Collective: every rank calls it."""
    if model_config.model_impl == "hf":
        raise ValueError("tensor parallelism needs the native model path (model_impl auto or native, not hf)")
    t0 = time.perf_counter()
    device = rank_device(model_config.device)
    if device.type == "cpu":
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    # A safetensors checkpoint or dummy weights: each rank reads (or draws) only its slices, and
    # no rank builds the whole transformers model first.
    try:
        loaded = load(model_config, device, group)
    except UnsupportedModelError as exc:
        raise ValueError(f"tensor parallelism needs a model of the native Llama family: {exc}") from exc
    model, shape = loaded.model, loaded.attention
    assert isinstance(model, NativeCausalLM)
    native = model.model
    fused = take_fused_allreduce(model_config, group, device, loaded.dtype)
    if fused:
        native.use_fused_allreduce(FUSED_ALLREDUCE_MAX_TOKENS)  # before the KV cache takes the memory left
    t_loaded = time.perf_counter()
    backend_name = pick_backend(model_config.attention_backend, device)
    attn_dtype = attention_dtype(model_config, loaded.dtype, device, backend_name)
    kv_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, attn_dtype)
    page_size = cache_config.page_size
    page_bytes = kv_page_bytes(shape.num_layers, page_size, shape.num_kv_heads, shape.head_dim, kv_dtype)
    # The same page ids on every rank: as many pages as the smallest rank holds.
    mine = torch.tensor([num_kv_pages(cache_config, page_bytes, device)], dtype=torch.long, device=device)
    every = [torch.zeros_like(mine) for _ in range(group.world_size)]
    dist.all_gather(every, mine)
    rank_pages = [int(t.item()) for t in every]
    num_pages = min(rank_pages)
    backend = get_backend_cls(backend_name)(
        shape.num_layers, num_pages, page_size, shape.num_kv_heads, shape.head_dim, attn_dtype, device,
        shape.sm_scale, num_qo_heads=shape.num_heads, kv_cache_dtype=kv_dtype, **backend_options(model_config, backend_name),
    )  # fmt: skip
    capacity = (num_pages - 1) * page_size  # page 0 is the KV cache manager's scratch page
    if capacity < loaded.max_model_len:
        loaded = replace(loaded, max_model_len=capacity)
    if group.rank == 0:
        logger.info(
            "KV cache pages each rank has memory for: %s (%s GB); every rank takes %d",
            rank_pages, [round(n * page_bytes / 1e9, 2) for n in rank_pages], num_pages,
        )
        logger.info(
            "model %s on %d ranks (%s, %s, native path), rank 0: %d query / %d KV heads, %s attention, "
            "%s, KV cache %d pages x %d tokens (%s, %.2f GB per rank); start-up: shard loaded in %.1f s, "
            "KV cache sized and allocated in %.1f s",
            loaded.name, group.world_size, device, loaded.dtype, shape.num_heads, shape.num_kv_heads, backend_name,
            f"FlashInfer's fused all-reduce + RMSNorm (steps up to {FUSED_ALLREDUCE_MAX_TOKENS} tokens)" if fused
            else "NCCL all-reduce", num_pages, page_size, kv_dtype, num_pages * page_bytes / 1e9, t_loaded - t0,
            time.perf_counter() - t_loaded,
        )  # fmt: skip
    runner_sampler = sampler if sampler is not None else pick_sampler(device, model_config.seed)
    return RankRunner(model, device, backend, runner_sampler, page_size, group), loaded, num_pages


def release_before_group_end(runner: ModelRunner) -> None:
    """Drops `runner`'s decode graphs (`CudaGraphRunner.release`), then the buffers of its fused
    all-reduce, before its rank leaves the group."""
    if runner.graphs is not None:
        runner.graphs.release()
        runner.graphs = None
    native = getattr(runner.model, "model", None)
    if isinstance(native, LlamaModel):
        native.close_fused_allreduce()


def capture_message(max_batch_size: int) -> WireCapture:
    return (CAPTURE, max_batch_size)


def run_worker(model_config: ModelConfig, cache_config: CacheConfig, channel_path: str | None = None) -> None:
    """A worker rank (1..N-1): joins the group, builds its shard, then runs steps until rank 0
    sends the end (or dies: the launcher's parent watch ends this process). Steps come through
    rank 0's shared-memory channel at `channel_path` (mapped before the group forms, so that rank
    0 may unlink it once the group has), else over the gloo group. A capture message makes it
    capture decode CUDA graphs beside rank 0: every rank holds the same graphs, with the model's
    collectives inside, and replays the one rank 0 replays, since it runs the same steps."""
    device = rank_device(model_config.device)
    channel = None
    if channel_path is not None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        channel = StepChannel(Path(channel_path), rank, world_size, None, create=False)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a GPU that cannot be had fails here, before the arrival
        channel.arrive()
    group = init_tp_group(device)
    control = control_group()
    steps: StepChannel | GlooSteps = GlooSteps(control)
    if channel is not None:
        channel.control = control
        steps = channel
    try:
        runner, _, _ = build_rank_runner(model_config, cache_config, group)
        while True:
            step = steps.receive()
            if step is None:
                dist.barrier(group=control)  # rank 0's last collective: see TensorParallelRunner.close
                release_before_group_end(runner)  # as rank 0 does
                break
            if step[0] == CAPTURE:
                capture_decode_graphs(runner, runner.model, step[1])
                continue
            out, prompt_rows = step
            runner.forward(out, prompt_rows)
    finally:
        steps.close()
        close_tp_group(group)
