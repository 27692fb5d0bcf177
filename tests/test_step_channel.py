"""Rank 0's steps reach the workers through shared memory (`parallel.channel.StepChannel`).

Three processes (rank 0 and two readers) over a gloo group on loopback: every reader gets every
step, in order; a step larger than the slot comes over the gloo group; the file is gone from
/dev/shm once the group has formed, whatever happens after.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

from flashserve.executor import channel as channel_module
from flashserve.executor.channel import SHM_DIR, StepChannel
from flashserve.executor.launch import free_port

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")

WORLD = 3
STEPS = [([([i, i + 1], 7 * i, list(range(i % 5)), i % 2 == 0, i % 3 == 0)], [i]) for i in range(200)]
LARGE = ([([1] * 10, 0, list(range(channel_module.SLOT_BYTES // 2)), True, False)], [])  # pickles to > the slot


def _rank(rank: int, port: int, path_queue: Any, results: Any, steps: list[Any]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank == 0:
        ch = StepChannel.create(WORLD)
        for _ in range(WORLD - 1):
            path_queue.put(str(ch.path))
    else:
        ch = StepChannel(Path(path_queue.get()), rank, WORLD, None, create=False)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    if rank == 0:
        ch.unlink()
        results.put(("file left", ch.path.exists()))
    ch.control = dist.group.WORLD
    got = []
    for step in steps + [None]:
        if rank == 0:
            ch.send(step)
        else:
            got.append(ch.receive())
    if rank:
        results.put((rank, got[:-1] == steps and got[-1] is None))
    dist.barrier()
    ch.close()
    dist.destroy_process_group()


def run_ranks(steps: list[Any]) -> dict[Any, Any]:
    ctx = mp.get_context("spawn")
    path_queue, results = ctx.Queue(), ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, port, path_queue, results, steps)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return dict(results.get(timeout=5) for _ in range(WORLD))


def test_every_worker_receives_every_step_in_order() -> None:
    results = run_ranks(STEPS)
    assert results[1] and results[2]


def test_a_step_larger_than_the_slot_comes_over_the_gloo_group() -> None:
    results = run_ranks([STEPS[0], LARGE, STEPS[1]])
    assert results[1] and results[2]


def test_the_shared_memory_file_is_gone_once_the_group_has_formed() -> None:
    assert run_ranks(STEPS[:2])["file left"] is False
