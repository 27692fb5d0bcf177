"""Tensor parallelism: an executor that drives N ranks' runners, rank 0's in this process.

`start_tensor_parallel` makes the calling process rank 0: it spawns ranks 1..N-1
(`RankProcesses`, loopback env:// rendezvous on a free port), joins the group with them, and
every rank builds its shard's runner with the same `build_runner` (its warm-up and decode graph
capture run the same steps everywhere). Under a launcher that started every rank itself
(torchrun; WORLD_SIZE set), rank 0 joins the launcher's group and serves, and every other rank
runs `run_worker`. The engine drives the returned `TensorParallelExecutor` exactly as it drives a
`ModelRunner` (launch/collect): before each forward of rank 0's runner it sends the step to the
workers (`ModelRunner.before_forward`), which run the same forward; the model's collectives pair
up. Only rank 0 samples. The engine may launch step N+1 while step N runs (overlap scheduling):
the tokens step N samples stay on rank 0's device, and the step's token ids reach the workers by
a broadcast in the model's group (`ModelRunner` over a group). On CUDA a decode step replays the
same graph on every rank. The step budget probe goes through the executor too, so the workers
follow it as well.

Lifetime: `close()` (also registered with atexit) sends the end and reaps the workers; a worker
that died makes the next step raise `RankFailed` (the engine loop dies with it, and a server
exits non-zero); workers exit by themselves when rank 0 dies.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flashserve.config import CacheConfig, ModelConfig
from flashserve.distributed.comm import DEFAULT_TIMEOUT, TPGroup, close_tp_group, init_tp_group
from flashserve.engine.outputs import SampledTokens, SchedulerOutput
from flashserve.executor.build import build_runner
from flashserve.executor.channel import GlooSteps, StepChannel
from flashserve.executor.channel import available as channel_available
from flashserve.executor.launch import RankFailed, RankProcesses, free_port, rank_env
from flashserve.executor.worker import (
    LoRAUpdate, WireStep, apply_lora_update, check_allreduce_fusion, control_group, rank_device,
    release_before_group_end,
)  # fmt: skip
from flashserve.message.lora import LoRARequest
from flashserve.model_loader import LoadedModel
from flashserve.spec_decode.config import SpeculativeConfig
from flashserve.worker.assembly import pick_device
from flashserve.worker.runner import LaunchedStep, ModelRunner, StepModel

logger = logging.getLogger(__name__)

_MASTER_ADDR = "127.0.0.1"
# Seconds the workers get to leave their loop after the end message before they are killed.
_CLOSE_TIMEOUT = 30.0


class TensorParallelExecutor:
    """Rank 0's runner, with every step it runs sent to the worker ranks first. It launches and
    collects steps as a `ModelRunner` does; `runner` is rank 0's."""

    overlap_capable = True  # the engine may schedule a step behind one still running

    def __init__(self, runner: ModelRunner, control: Any, workers: RankProcesses,
                 steps: StepChannel | GlooSteps | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.control = control
        self.steps = steps if steps is not None else GlooSteps(control)
        self.workers = workers
        self.closed = False
        self.num_threads = torch.get_num_threads()  # this process's CPU threads to restore at close
        runner.before_forward = self._send_step

    # What the engine, the step budget probe and callers read of a runner: rank 0's.
    @property
    def model(self) -> StepModel:
        return self.runner.model

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def backend(self) -> Any:
        return self.runner.backend

    @property
    def graphs(self) -> Any:
        return self.runner.graphs

    @property
    def verify_graphs(self) -> Any:
        return self.runner.verify_graphs

    @property
    def piecewise_graphs(self) -> Any:
        return self.runner.piecewise_graphs

    @property
    def page_size(self) -> int:
        return self.runner.page_size

    @property
    def group(self) -> TPGroup:
        return self.runner.group

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        try:
            return self.runner.launch(out, previous)
        except Exception:
            self.workers.check()  # a dead worker is the better explanation of a failed collective
            raise

    def collect(self, step: LaunchedStep) -> list[SampledTokens]:
        return self.runner.collect(step)

    def start_timing(self) -> bool:
        return self.runner.start_timing()

    def step_done(self, step: LaunchedStep) -> bool | None:
        return self.runner.step_done(step)

    def device_seconds(self, step: LaunchedStep) -> float | None:
        return self.runner.device_seconds(step)

    def forward(self, out: SchedulerOutput, prompt_rows: Sequence[int] = (),
                previous: LaunchedStep | None = None) -> torch.Tensor:
        """Rank 0's float32 logits of one step, the step sent to the workers first, as
        `ModelRunner.forward` (the GPU tests and the TP benchmarks time and compare it)."""
        try:
            return self.runner.forward(out, prompt_rows, previous)
        except Exception:
            self.workers.check()
            raise

    def execute(self, out: SchedulerOutput) -> list[SampledTokens]:
        """One result per `out.requests`, in order, as `ModelRunner.execute`."""
        return self.collect(self.launch(out))

    def add_lora(self, lora: LoRARequest) -> None:
        """Loads an adapter on rank 0 (raises LoRAAdapterError there, and nothing is sent), then
        on every worker, before any later step."""
        self.runner.add_lora(lora)
        self._send(LoRAUpdate(add=lora))

    def remove_lora(self, lora_int_id: int) -> bool:
        removed = self.runner.remove_lora(lora_int_id)
        if removed:
            self._send(LoRAUpdate(remove=lora_int_id))
        return removed

    def list_loras(self) -> set[int]:
        return self.runner.list_loras()

    def _send_step(self, out: SchedulerOutput, prompt_rows: Sequence[int]) -> None:
        self._send((out.for_ranks(), list(prompt_rows)))  # every rank applies the same diffs

    def _send(self, step: WireStep) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel workers were closed")
        self.workers.check()  # raises RankFailed when a worker has died since the last step
        try:
            self.steps.send(step, self.workers.check)
        except Exception:
            self.workers.check()
            raise

    def close(self) -> None:
        """Ends the workers' loop and reaps them (killing any that do not leave in time)."""
        if self.closed:
            return
        atexit.unregister(self.close)
        try:
            self._send(None)
            # The last collective carries no tensor. gloo's threads release a finished broadcast's
            # tensors, which takes the GIL: after a barrier they have, before the interpreter
            # shuts down (a thread that wants the GIL then is killed, aborting the process).
            dist.barrier(group=self.control)
            self.closed = True
            release_before_group_end(self.runner)  # a graph holding NCCL's communicator stalls the group's end
            # Every rank leaves the group before rank 0 waits for the workers to exit: a worker's
            # NCCL teardown waits for its peers (on two H200s it did not exit in 30 s otherwise).
            close_tp_group(self.group)
            self.workers.join(_CLOSE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - closing a broken group still reaps what is left
            logger.warning("tensor-parallel workers did not stop cleanly: %s", exc)
        finally:
            self.closed = True
            self.workers.kill()
            self.steps.close()
            torch.set_num_threads(self.num_threads)
            with contextlib.suppress(Exception):
                close_tp_group(self.group)


def run_worker(model_config: ModelConfig, cache_config: CacheConfig, channel_path: str | None = None,
               cuda_graph: bool = True, max_batch_size: int = 256,
               speculative: SpeculativeConfig | None = None) -> None:  # fmt: skip
    """A worker rank (1..N-1): joins the group, builds its shard's runner (`build_runner`, as
    rank 0 does, with the same warm-up and decode graphs), then runs steps until rank 0 sends the
    end (or dies: the launcher's parent watch ends this process). Steps come through rank 0's
    shared-memory channel at `channel_path` (mapped before the group forms, so that rank 0 may
    unlink it once the group has), else over the gloo group."""
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
        runner, _, _ = build_runner(model_config, cache_config, group, cuda_graph=cuda_graph,
                                    max_batch_size=max_batch_size, speculative=speculative)  # fmt: skip
        while True:
            step = steps.receive()
            if step is None:
                dist.barrier(group=control)  # rank 0's last collective: see TensorParallelExecutor.close
                release_before_group_end(runner)  # as rank 0 does
                break
            if isinstance(step, LoRAUpdate):
                apply_lora_update(runner, step)
                continue
            out, prompt_rows = step
            runner.forward(out, prompt_rows)
    finally:
        steps.close()
        close_tp_group(group)


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """`values` set in os.environ for the block (env:// reads them at init), then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launched_rank(world_size: int) -> int | None:
    """This process's rank when a launcher (torchrun, or the same env:// variables set by hand on
    each node) started every rank with WORLD_SIZE = `world_size`; None when WORLD_SIZE is unset
    and flashserve starts the ranks itself."""
    launched = os.environ.get("WORLD_SIZE")
    if launched is None:
        return None
    if int(launched) != world_size:
        raise ValueError(f"the launcher started {launched} ranks (WORLD_SIZE) but tensor_parallel_size is {world_size}")
    return int(os.environ.get("RANK", "0"))


def check_visible_gpus(device: str, world_size: int) -> None:
    """Ranks this process starts on its node need a GPU each: refused before any process starts
    (a worker without its GPU would die before the group forms, while rank 0 waits for it)."""
    if pick_device(device).type != "cuda":
        return
    visible = torch.cuda.device_count()
    if visible < world_size:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ValueError(f"tensor_parallel_size {world_size} needs {world_size} GPUs on this node; "
                         f"{visible} visible{where}")


def start_tensor_parallel(
    model_config: ModelConfig, cache_config: CacheConfig, *, cuda_graph: bool = True, max_batch_size: int = 256,
    speculative: SpeculativeConfig | None = None,
) -> tuple[TensorParallelExecutor, LoadedModel, int]:
    """Builds rank 0's runner in this process (`build_runner`) and the executor that drives it and
    ranks 1..N-1 beside
    it: started here (child processes on this node), or already started by a launcher such as
    torchrun, on this node or others (`launched_rank`). On CUDA with FlashInfer every rank
    captures the same decode graphs after the warm-up (`cuda_graph`). In a launched rank other
    than 0 this never returns: the process runs its shard's steps until rank 0 ends them, then
    exits 0."""
    world_size = model_config.tensor_parallel_size
    if model_config.model_impl == "hf":  # refused before any process starts
        raise ValueError("tensor parallelism needs the native model path (model_impl auto or native, not hf)")
    if dist.is_initialized():
        raise RuntimeError("tensor_parallel_size > 1 starts its own ranks; this process is already in a group")
    rank = launched_rank(world_size)
    if rank is not None and rank != 0:
        logger.info("rank %d of %d: running rank 0's steps until it ends them", rank, world_size)
        run_worker(model_config, cache_config, None, cuda_graph, max_batch_size, speculative)
        raise SystemExit(0)
    threads = torch.get_num_threads()  # build_runner shares the cores out on a CPU; close restores it
    channel = None
    if rank is None:
        check_visible_gpus(model_config.device, world_size)
        check_allreduce_fusion(model_config)
        # Workers on this node: steps go through shared memory (mapped by the workers before the
        # group forms, unlinked here once it has).
        channel = StepChannel.create(world_size) if channel_available(world_size) else None
        port = free_port(_MASTER_ADDR)
        env = rank_env(0, world_size, _MASTER_ADDR, port)
        args = (model_config, cache_config, str(channel.path) if channel is not None else None, cuda_graph,
                max_batch_size, speculative)
        try:
            workers = RankProcesses.start(run_worker, args, world_size=world_size, ranks=range(1, world_size),
                                          master_addr=_MASTER_ADDR, master_port=port)  # fmt: skip
        except BaseException:
            if channel is not None:
                channel.discard()
            raise
    else:  # the launcher's ranks: none of them is this process's child; a dead one fails a collective
        env, workers = {}, RankProcesses({})
    group: TPGroup | None = None
    try:
        if channel is not None:
            channel.wait_arrivals(workers.check, DEFAULT_TIMEOUT.total_seconds())
        with _environ(env):
            group = init_tp_group(rank_device(model_config.device))
        if channel is not None:
            channel.unlink()
        control = control_group()
        runner, loaded, num_pages = build_runner(model_config, cache_config, group, cuda_graph=cuda_graph,
                                                 max_batch_size=max_batch_size, speculative=speculative)  # fmt: skip
    except BaseException as exc:
        try:
            workers.check()
        except RankFailed as failed:
            raise failed from exc
        finally:
            workers.kill()
            torch.set_num_threads(threads)
            if channel is not None:
                channel.discard()
            if group is not None:
                with contextlib.suppress(Exception):
                    close_tp_group(group)
        raise
    if channel is not None:
        channel.control = control
    executor = TensorParallelExecutor(runner, control, workers, channel)
    executor.num_threads = threads
    atexit.register(executor.close)
    return executor, loaded, num_pages
