"""The engine over two tensor-parallel ranks (gloo, CPU) generates what one rank generates.

This process is rank 0 (`LLM(..., tensor_parallel_size=2)`) and spawns one worker. Both run the
same dummy weights (seeded alike) of a small Llama config: 4 query heads, 2 or 1 KV heads, a
vocabulary of 211 (not divisible by 2). Prompts of 3, 20 and 53 tokens under a 32-token step
budget give whole prefills, chunked prefills and decode steps, alone and mixed. The engines are
built once per config (a class fixture: one group per process at a time); lifetime tests start their own.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from flashserve.cli import build_parser
from flashserve.serve_args import to_configs
from flashserve.entrypoints.llm import LLM
from flashserve.executor.launch import RankFailed
from flashserve.message.sampling_params import SamplingParams

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=211,
              max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5,
              rope_theta=10000.0)  # fmt: skip
ENGINE = dict(load_format="dummy", dtype="float32", device="cpu", num_pages=64, max_num_batched_tokens=32)
PROMPTS = [[1, 2, 3], [5] * 20, list(range(7, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def write_config(directory: Path, **overrides: Any) -> str:
    path = directory / "config.json"
    path.write_text(json.dumps({**CONFIG, **overrides}))
    return str(path)


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.executor.workers.processes.values()]  # type: ignore[attr-defined]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="class", params=[2, 1], ids=["kv_heads_2", "kv_heads_1"])
def engines(request: Any, tmp_path_factory: Any) -> Iterator[tuple[LLM, LLM]]:
    """(one rank, two ranks) over the same dummy weights."""
    model = write_config(tmp_path_factory.mktemp("model"), num_key_value_heads=request.param)
    single = LLM(model, **ENGINE)
    with LLM(model, tensor_parallel_size=2, **ENGINE) as pair:
        yield single, pair


class TestTwoRanksMatchOneRank:
    def test_two_ranks_generate_the_single_rank_greedy_tokens(self, engines: tuple[LLM, LLM]) -> None:
        single, pair = engines
        expected = [c.token_ids for c in single.generate(PROMPTS, GREEDY)]
        assert [c.token_ids for c in pair.generate(PROMPTS, GREEDY)] == expected
        assert all(len(t) == GREEDY.max_tokens for t in expected)

    def test_two_ranks_launch_each_step_behind_the_one_running(self, engines: tuple[LLM, LLM]) -> None:
        """Overlap scheduling stays on: the tokens in flight reach the worker by a broadcast (the
        greedy test above checks that they are the right ones)."""
        single, pair = engines
        assert pair.engine.overlap and single.engine.overlap

    def test_prompt_logprob_rows_reach_every_rank(self, engines: tuple[LLM, LLM]) -> None:
        """Steps whose logits include prompt rows keep the ranks' vocabulary gathers the same shape."""
        single, pair = engines
        params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=1)
        expected = [c.token_ids for c in single.generate(PROMPTS, params)]
        assert [c.token_ids for c in pair.generate(PROMPTS, params)] == expected


def test_close_leaves_no_worker_alive(tmp_path: Path) -> None:
    llm = LLM(write_config(tmp_path), tensor_parallel_size=2, **ENGINE)
    pids = worker_pids(llm)
    llm.close()
    assert all(gone(pid) for pid in pids)
    assert not multiprocessing.active_children()
    with pytest.raises(RuntimeError):
        llm.generate(PROMPTS[:1], GREEDY)


def test_steps_go_through_shared_memory_whose_file_is_gone_once_the_ranks_run(tmp_path: Path) -> None:
    from flashserve.executor.channel import SHM_DIR, StepChannel

    with LLM(write_config(tmp_path), tensor_parallel_size=2, **ENGINE) as llm:
        steps = llm.engine.executor.steps  # type: ignore[attr-defined]
        assert isinstance(steps, StepChannel)
        assert not steps.path.exists()
        assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert not list(SHM_DIR.glob(f"flashserve-steps-{os.getpid()}-*"))


def test_interpreter_exit_without_close_stops_the_workers(tmp_path: Path) -> None:
    script = (
        "from flashserve.entrypoints.llm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({write_config(tmp_path)!r}, tensor_parallel_size=2, **{ENGINE!r})\n"
        "    print(*[p.pid for p in llm.engine.executor.workers.processes.values()])\n"
    )
    (tmp_path / "main.py").write_text(script)
    done = subprocess.run([sys.executable, str(tmp_path / "main.py")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert pids and all(gone(pid) for pid in pids)


def test_killed_worker_fails_the_next_generate_and_leaves_no_process(tmp_path: Path) -> None:
    llm = LLM(write_config(tmp_path), tensor_parallel_size=2, **ENGINE)
    try:
        (pid,) = worker_pids(llm)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        start = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1 was killed by SIGKILL"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 5
        assert gone(pid) and not multiprocessing.active_children()
    finally:
        llm.close()


def test_a_worker_that_dies_while_it_starts_fails_the_start_at_once(tmp_path: Path, monkeypatch: Any) -> None:
    from flashserve.executor import tensor_parallel as executor
    from flashserve.executor.channel import StepChannel

    create = StepChannel.create

    def unreachable_channel(world_size: int) -> StepChannel:
        channel = create(world_size)
        channel.unlink()  # the worker cannot open it, and exits 1 before it joins the group
        return channel

    monkeypatch.setattr(executor.StepChannel, "create", unreachable_channel)
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 exited with status 1"):
        LLM(write_config(tmp_path), tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 60  # not the 300 s rendezvous timeout
    assert not multiprocessing.active_children()


def test_hf_model_path_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="native model path"):
        LLM(write_config(tmp_path), tensor_parallel_size=2, model_impl="hf", **ENGINE)
    assert not multiprocessing.active_children()


def test_more_ranks_than_visible_gpus_are_refused_before_any_rank_starts(tmp_path: Path, monkeypatch: Any) -> None:
    import torch

    from flashserve.executor import tensor_parallel as executor

    monkeypatch.setattr(executor, "pick_device", lambda name: torch.device("cuda"))  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match=r"needs 2 GPUs on this node; 1 visible \(CUDA_VISIBLE_DEVICES=3\)"):
        LLM(write_config(tmp_path), tensor_parallel_size=2, **{**ENGINE, "device": "cuda"})
    assert not multiprocessing.active_children()


def test_the_fused_allreduce_off_gpus_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--enable-flashinfer-allreduce-fusion needs CUDA GPUs"):
        LLM(write_config(tmp_path), tensor_parallel_size=2, enable_flashinfer_allreduce_fusion=True, **ENGINE)
    assert not multiprocessing.active_children()


def test_allreduce_fusion_flag_reaches_the_model_config() -> None:
    parser = build_parser({})
    assert to_configs(parser.parse_args(["serve"])).model.enable_flashinfer_allreduce_fusion is None  # auto
    args = parser.parse_args(["serve", "--tp", "2", "--enable-flashinfer-allreduce-fusion"])
    assert to_configs(args).model.enable_flashinfer_allreduce_fusion is True
    args = parser.parse_args(["serve", "--tp", "2", "--no-enable-flashinfer-allreduce-fusion"])
    assert to_configs(args).model.enable_flashinfer_allreduce_fusion is False


def test_the_fused_allreduce_needs_cuda_gpus() -> None:
    import torch

    from flashserve.distributed.comm import allreduce_fusion_blocker

    assert allreduce_fusion_blocker(2, torch.device("cpu"), torch.bfloat16) == "it needs CUDA GPUs"


def test_the_fused_allreduce_needs_a_half_precision_model() -> None:
    import torch

    from flashserve.distributed.comm import allreduce_fusion_blocker

    reason = allreduce_fusion_blocker(2, torch.device("cuda"), torch.float32)
    assert reason == "it takes float16 or bfloat16 models, not torch.float32"


def test_the_fused_allreduce_needs_every_rank_on_one_node(monkeypatch: Any) -> None:
    import torch

    from flashserve.distributed.comm import allreduce_fusion_blocker

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 4 ranks over two nodes
    reason = allreduce_fusion_blocker(4, torch.device("cuda"), torch.bfloat16)
    assert reason == "it shares GPU memory within one node, and the 4 ranks run 2 to a node"


def take_fused(monkeypatch: Any, setting: bool | None, blocker: str | None, gap: str | None) -> bool:
    """`take_fused_allreduce` of rank 0 of 2 whose checks answer `blocker` and `gap` (the ranks'
    agreement, an all-reduce, is this rank's own answer)."""
    import types

    import torch

    from flashserve.config import ModelConfig
    from flashserve.executor import worker

    monkeypatch.setattr(worker, "allreduce_fusion_blocker", lambda *_: blocker)
    monkeypatch.setattr(worker, "nvlink_gap", lambda _: gap)
    monkeypatch.setattr(worker.dist, "all_reduce", lambda t, op: t)
    group = types.SimpleNamespace(rank=0, world_size=2)
    config = ModelConfig(enable_flashinfer_allreduce_fusion=setting)
    return worker.take_fused_allreduce(config, group, torch.device("cpu"), torch.bfloat16)


def test_by_default_gpus_that_nvlink_connects_take_the_fused_allreduce(monkeypatch: Any) -> None:
    assert take_fused(monkeypatch, None, blocker=None, gap=None)


def test_by_default_gpus_without_nvlink_keep_nccl(monkeypatch: Any) -> None:
    assert not take_fused(monkeypatch, None, blocker=None, gap="NVLink does not connect cuda:0 and cuda:1")


def test_by_default_ranks_that_cannot_run_the_fused_allreduce_keep_nccl(monkeypatch: Any) -> None:
    assert not take_fused(monkeypatch, None, blocker="it needs CUDA GPUs", gap=None)


def test_the_forced_fused_allreduce_runs_without_nvlink(monkeypatch: Any) -> None:
    assert take_fused(monkeypatch, True, blocker=None, gap="NVLink does not connect cuda:0 and cuda:1")


def copy_engine_blocker(monkeypatch: Any, device: str, gap: str | None, local: int = 2) -> str | None:
    """Why two ranks on `device` cannot run the copy-engine all-reduce, NVML reporting `gap`, `local`
    ranks a node."""
    import torch

    from flashserve.executor import worker

    monkeypatch.setattr(worker, "nvlink_gap", lambda _: gap)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    return worker.copy_engine_blocker(2, torch.device(device))


def test_copy_engine_all_reduces_run_on_gpus_of_one_node_that_nvlink_connects(monkeypatch: Any) -> None:
    assert copy_engine_blocker(monkeypatch, "cuda", gap=None) is None


def test_copy_engine_all_reduces_need_nvlink_between_the_gpus(monkeypatch: Any) -> None:
    gap = "NVLink does not connect cuda:0 and cuda:1"
    assert copy_engine_blocker(monkeypatch, "cuda", gap=gap) == gap


def test_copy_engine_all_reduces_need_every_rank_on_one_node(monkeypatch: Any) -> None:
    assert "within one node" in str(copy_engine_blocker(monkeypatch, "cuda", gap=None, local=1))


def test_copy_engine_all_reduces_take_one_model_a_process(monkeypatch: Any) -> None:
    from flashserve.distributed import copy_engine

    monkeypatch.setattr(copy_engine, "_RENDEZVOUS_MADE", True)
    assert "one model a process" in str(copy_engine_blocker(monkeypatch, "cuda", gap=None))


def test_copy_engine_all_reduces_are_refused_at_start_with_the_flag_and_the_reason_named(monkeypatch: Any) -> None:
    import types

    import torch

    from flashserve.executor import worker

    monkeypatch.setattr(worker.dist, "all_reduce", lambda t, op: t)
    with pytest.raises(ValueError, match="--tp-overlap-comm copy-engine: it needs CUDA GPUs"):
        worker.check_copy_engine_sums(types.SimpleNamespace(rank=0, world_size=2), torch.device("cpu"))


def test_the_start_up_log_names_what_carries_the_overlapped_all_reduces() -> None:
    from flashserve.config import ModelConfig
    from flashserve.executor.build import all_reduce_summary

    plain = all_reduce_summary(False, ModelConfig())
    copies = all_reduce_summary(True, ModelConfig(tp_overlap_min_tokens=1024, tp_overlap_comm="copy-engine"))
    assert plain == "NCCL all-reduce"
    assert copies.startswith("FlashInfer's fused all-reduce") and "steps of 1024+ tokens" in copies
    assert "overlapped by copy engines" in copies


def test_the_forced_fused_allreduce_where_it_cannot_run_is_an_error(monkeypatch: Any) -> None:
    with pytest.raises(ValueError, match="--enable-flashinfer-allreduce-fusion: it takes float16 or bfloat16"):
        take_fused(monkeypatch, True, blocker="it takes float16 or bfloat16 models, not torch.float32", gap=None)


def test_the_disabled_fused_allreduce_keeps_nccl(monkeypatch: Any) -> None:
    assert not take_fused(monkeypatch, False, blocker=None, gap=None)


def test_tp_flag_is_an_alias_of_tensor_parallel_size() -> None:
    parser = build_parser({})
    assert to_configs(parser.parse_args(["serve"])).model.tensor_parallel_size == 1
    assert to_configs(parser.parse_args(["serve", "--tp", "2"])).model.tensor_parallel_size == 2
    assert to_configs(parser.parse_args(["serve", "--tensor-parallel-size", "3"])).model.tensor_parallel_size == 3
    env = build_parser({"FLASHSERVE_TENSOR_PARALLEL_SIZE": "4"})
    assert to_configs(env.parse_args(["serve"])).model.tensor_parallel_size == 4


def test_ranks_read_their_shards_from_a_safetensors_checkpoint(tmp_path: Path) -> None:
    """No rank builds the whole transformers model: rank 0 holds the native model's shard, and the
    weights each rank read from the files generate what one rank's full load generates."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    config = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config)).save_pretrained(tmp_path / "ckpt")
    engine = {k: v for k, v in ENGINE.items() if k != "load_format"}
    expected = [c.token_ids for c in LLM(str(tmp_path / "ckpt"), **engine).generate(PROMPTS, GREEDY)]
    from flashserve.models.native import NativeCausalLM

    with LLM(str(tmp_path / "ckpt"), tensor_parallel_size=2, **engine) as pair:
        assert isinstance(pair.stack.loaded.model, NativeCausalLM) and pair.stack.loaded.model.model.sharded
        assert [c.token_ids for c in pair.generate(PROMPTS, GREEDY)] == expected


def test_start_up_logs_every_rank_s_kv_pages_and_takes_the_smallest(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="flashserve.executor.worker")
    engine = {**ENGINE, "num_pages": None, "cpu_kv_cache_gb": 0.001}
    with LLM(write_config(tmp_path), tensor_parallel_size=2, **engine) as llm:
        pages = llm.engine.scheduler.kv_cache.num_pages
    line = next(r.getMessage() for r in caplog.records if "each rank has memory for" in r.getMessage())
    assert line.startswith(f"KV cache pages each rank has memory for: [{pages}, {pages}]")
    assert line.endswith(f"every rank takes {pages}")


def test_ranks_started_by_a_launcher_serve_and_all_exit_on_sigterm(tmp_path: Path) -> None:
    """torchrun's way (each rank a `flashserve serve` with the env:// variables; here two on one
    machine): rank 0 serves, rank 1 runs its shard's steps; SIGTERM to rank 0 ends both with 0."""
    import subprocess
    import sys

    import httpx
    from live_server import free_port, live_server

    model = write_config(tmp_path)
    master = str(free_port())
    args = ["--model", model, "--load-format", "dummy", "--dtype", "float32", "--device", "cpu", "--num-pages", "64",
            "--tp", "2"]
    launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master, "WORLD_SIZE": "2"}
    worker = subprocess.Popen([sys.executable, "-m", "flashserve", "serve", *args],
                              env=dict(os.environ, **launcher, RANK="1", LOCAL_RANK="1", FLASHSERVE_PORT=str(free_port())),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with live_server(args, env={**launcher, "RANK": "0", "LOCAL_RANK": "0"}) as (base, server):
            reply = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": PROMPTS[1], "max_tokens": 4,
                                                                "temperature": 0}, timeout=60)  # fmt: skip
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
            server.send_signal(signal.SIGTERM)
            assert server.wait(60) == 0
        assert worker.wait(60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()


def test_a_graph_release_that_fails_still_releases_the_other_graphs_before_the_group_ends() -> None:
    """A rank leaving the group drops every graph even where one's release fails (a graph still
    holding NCCL's communicator would stall the group's end), then raises that failure."""
    from types import SimpleNamespace

    from flashserve.executor.worker import release_before_group_end

    released: list[str] = []

    class Graphs:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        def release(self) -> None:
            if self.fails:
                raise RuntimeError(f"{self.name} cannot be released")
            released.append(self.name)

    runner: Any = SimpleNamespace(piecewise_graphs=Graphs("piecewise", fails=True), verify_graphs=Graphs("verify"),
                                  graphs=Graphs("decode"), model=SimpleNamespace())  # fmt: skip
    with pytest.raises(RuntimeError, match="piecewise cannot be released"):
        release_before_group_end(runner)
    assert released == ["verify", "decode"]
    assert (runner.piecewise_graphs, runner.verify_graphs, runner.graphs) == (None, None, None)
