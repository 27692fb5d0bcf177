"""A native model split over two tensor-parallel ranks computes the single-process logits.

Two rank processes (gloo on loopback) load tiny random checkpoints, each keeping only its shard,
and run the same steps through the paged reference backend: a prefill step, a mixed step (one
request's prefill beside two decode tokens) and decode steps. Their logits are compared with the
native model on one rank, in float32. The ranks are started once for all configs (a module
fixture); the shard arithmetic is tested in this process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flashserve.attention.base import BatchLayout
from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.distributed.comm import MULTICAST_OFF_ENV, close_tp_group, init_tp_group
from flashserve.distributed.sharding import ShardLayout
from flashserve.engine.outputs import ScheduledRequest
from flashserve.executor.launch import RankFailed, RankProcesses
from flashserve.layers.ops import torch_ops
from flashserve.message.sampling_params import SamplingParams
from flashserve.model_loader.checkpoint import load_llama
from flashserve.models.llama import LlamaModel, LlamaSpec
import flashserve.models.llama as llama_module

WORLD = 2
PAGE = 16
NUM_PAGES = 16
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)  # fmt: skip
# Per step, the [a, b) tokens of each of three sequences: prompts of 16 (page-aligned), 5 and 21.
SCHEDULE = [
    [(0, 16), (0, 5), (0, 0)],  # prefill
    [(16, 17), (5, 6), (0, 21)],  # mixed: C's prefill beside A's and B's decode tokens
    [(17, 18), (6, 7), (21, 22)],  # decode
    [(18, 19), (7, 8), (22, 23)],  # decode, a second page for C
]
PREFILL, MIXED, DECODE = [0], [1], [2, 3]


def configs() -> dict[str, Any]:
    """Built on demand: the rank processes never import transformers (it costs seconds each)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        "llama_gqa_untied": LlamaConfig(**SMALL, vocab_size=256, tie_word_embeddings=False),
        "llama_one_kv_head_tied_vocab_211": LlamaConfig(**{**SMALL, "num_key_value_heads": 1}, vocab_size=211,
                                                        tie_word_embeddings=True),  # fmt: skip
        "llama_biases_intermediate_97": LlamaConfig(**{**SMALL, "intermediate_size": 97}, vocab_size=256,
                                                    attention_bias=True, mlp_bias=True),  # fmt: skip
        "qwen2_qkv_biases_tied_vocab_211": Qwen2Config(**SMALL, vocab_size=211, tie_word_embeddings=True),
        "qwen3_qk_norm_untied": Qwen3Config(**SMALL, head_dim=16, vocab_size=256, tie_word_embeddings=False),
    }


NAMES = ["llama_gqa_untied", "llama_one_kv_head_tied_vocab_211", "llama_biases_intermediate_97",
         "qwen2_qkv_biases_tied_vocab_211", "qwen3_qk_norm_untied"]  # fmt: skip


def hf_model(config: Any) -> torch.nn.Module:
    """Random weights, with random norms and biases too (HF starts them at 1 and 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@torch.inference_mode()
def run_schedule(model: LlamaModel) -> list[torch.Tensor]:
    """The logits [T, V] of every step of SCHEDULE, through a backend with the rank's heads."""
    spec, shard = model.spec, model.shard
    backend = TorchAttentionBackend(spec.num_layers, NUM_PAGES, PAGE, shard.num_kv_heads, spec.head_dim,
                                    torch.float32, "cpu", num_qo_heads=shard.num_heads)  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (19, 8, 23)]
    pages = [[1, 5], [3], [7, 2]]
    params = SamplingParams()
    logits = []
    for step in SCHEDULE:
        reqs = [ScheduledRequest(str(i), seqs[i][a:b], a, pages[i], True, params)
                for i, (a, b) in enumerate(step) if b > a]  # fmt: skip
        layout = BatchLayout.build(reqs, PAGE)
        backend.plan(layout)
        ids = torch.tensor([t for r in reqs for t in r.new_token_ids], dtype=torch.long)
        logits.append(model.compute_logits(model(ids, torch.tensor(layout.positions, dtype=torch.long), backend)))
    return logits


# A fused all-reduce + add + RMSNorm stand-in (the real one is FlashInfer's, on GPUs): the group's
# all-reduce and the PyTorch norm, recording the token count of each call.
FUSED_MAX_TOKENS = 8  # the decode steps of SCHEDULE (3 tokens) are under it, the others over


class RecordingFusedAllReduce:
    max_tokens = FUSED_MAX_TOKENS

    def __init__(self, group: Any) -> None:
        self.group, self.tokens = group, []

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        assert not quantize  # FP8 projections are dequantized on a CPU: nothing reads FP8 rows here
        self.tokens.append(partial.shape[0])
        summed = residual + self.group.all_reduce(partial.clone())
        return torch_ops().rmsnorm(summed, weight, eps), summed

    def close(self) -> None:
        pass


# Steps of this many tokens or more run in token chunks whose all-reduces overlap (the 21- and
# 23-token steps of SCHEDULE; not its 3-token decode steps).
OVERLAP_MIN_TOKENS = 16


def _rank_main(checkpoints: str, names: list[str], out_dir: str) -> None:
    """One rank: loads each checkpoint's shard two ways, runs the steps, saves what it saw."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    group = init_tp_group("cpu")
    found: dict[str, Any] = {"env": {k: os.environ.get(k) for k in MULTICAST_OFF_ENV}, "models": {}}
    for name in names:
        path = os.path.join(checkpoints, name)
        config = config_of(path)
        state = load_file(os.path.join(path, "model.safetensors"))
        from_state = LlamaModel.from_hf(state, config, torch.float32, "cpu", ops="torch", group=group)
        from_files = load_llama(path, config, torch.float32, "cpu", ops="torch", group=group)
        found["models"][name] = {
            "state": run_schedule(from_state),
            "files": run_schedule(from_files),
            "heads": (from_state.shard.num_heads, from_state.shard.num_kv_heads),
            "shapes": {n: tuple(p.shape) for n, p in from_state.named_parameters()},
        }
    overlapped = LlamaModel.from_hf(load_file(os.path.join(checkpoints, names[0], "model.safetensors")), config_of(
        os.path.join(checkpoints, names[0])), torch.float32, "cpu", ops="torch", group=group)
    overlapped.overlap_min_tokens = OVERLAP_MIN_TOKENS
    found["overlap"] = {"logits": run_schedule(overlapped),
                        "chunks": {n: len(overlapped.token_chunks(n)) for n in (3, 21, 23)}}  # fmt: skip
    # RoPE in place, as FlashInfer's, and dense weights, as on GPUs (not packed for oneDNN): the
    # chunks' q, k, v stay rows of one qkv output (no join).
    packs = llama_module.packs_for_onednn
    llama_module.packs_for_onednn = lambda *_: False  # type: ignore[assignment]
    in_place = LlamaModel.from_hf(load_file(os.path.join(checkpoints, names[0], "model.safetensors")), config_of(
        os.path.join(checkpoints, names[0])), torch.float32, "cpu", ops="torch", group=group)
    llama_module.packs_for_onednn = packs
    in_place.overlap_min_tokens = OVERLAP_MIN_TOKENS
    in_place.ops = dataclasses.replace(in_place.ops, apply_rope=rope_in_place)
    seen: list[bool] = []
    rows_of = llama_module.in_rows_of
    llama_module.in_rows_of = lambda *args: seen.append(rows_of(*args)) or seen[-1]  # type: ignore[assignment]
    found["overlap_rows"] = {"logits": run_schedule(in_place), "rows_of_one_output": seen}
    llama_module.in_rows_of = rows_of
    fused = RecordingFusedAllReduce(group)
    model = LlamaModel.from_hf(load_file(os.path.join(checkpoints, names[0], "model.safetensors")), config_of(
        os.path.join(checkpoints, names[0])), torch.float32, "cpu", ops="torch", group=group)
    model.fused_allreduce = fused
    found["fused"] = {"logits": run_schedule(model), "tokens": fused.tokens}
    torch.save(found, os.path.join(out_dir, f"rank{group.rank}.pt"))
    close_tp_group(group)


def rope_in_place(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                  cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's RoPE written back into q and k, as FlashInfer's kernel rotates them."""
    rotated_q, rotated_k = torch_ops().apply_rope(positions, q, k, head_dim, cos_sin)
    return q.copy_(rotated_q), k.copy_(rotated_k)


def config_of(path: str) -> Any:
    with open(os.path.join(path, "config.json")) as f:
        return SimpleNamespace(**json.load(f))  # the fields a transformers config would read


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """{"root": checkpoints, "one_rank": {name: step logits}, "ranks": [what each rank saved]}."""
    root = tmp_path_factory.mktemp("tp")
    one_rank = {}
    for name, config in configs().items():
        hf = hf_model(config)
        hf.save_pretrained(root / name)
        one_rank[name] = run_schedule(LlamaModel.from_hf(hf, config, torch.float32, "cpu", ops="torch"))
    with RankProcesses.start(_rank_main, (str(root), NAMES, str(root)), world_size=WORLD) as ranks:
        ranks.join(timeout=180)
    return {"root": root, "one_rank": one_rank, "ranks": [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]}


def assert_steps_match(runs: dict[str, Any], name: str, steps: list[int]) -> None:
    for step in steps:
        expected = runs["one_rank"][name][step]
        for rank in range(WORLD):
            got = runs["ranks"][rank]["models"][name]["state"][step]
            where = f"rank {rank} step {step}"
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_one_rank_on_a_prefill_step(runs: dict[str, Any], name: str) -> None:
    assert_steps_match(runs, name, PREFILL)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_one_rank_on_a_mixed_prefill_and_decode_step(runs: dict[str, Any], name: str) -> None:
    assert_steps_match(runs, name, MIXED)


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_match_one_rank_on_decode_steps_over_the_paged_cache(runs: dict[str, Any], name: str) -> None:
    assert_steps_match(runs, name, DECODE)


def test_a_fused_allreduce_and_norm_gives_the_logits_of_one_rank(runs: dict[str, Any]) -> None:
    for rank in range(WORLD):
        for step, got in enumerate(runs["ranks"][rank]["fused"]["logits"]):
            torch.testing.assert_close(got, runs["one_rank"][NAMES[0]][step], atol=1e-5, rtol=1e-4)


def test_only_steps_within_the_fused_allreduce_s_tokens_take_it(runs: dict[str, Any]) -> None:
    layers = configs()[NAMES[0]].num_hidden_layers
    for rank in range(WORLD):
        # One per row-parallel projection (o_proj and down_proj of each layer), for each of the two
        # 3-token decode steps; the 21- and 23-token steps went through the group's all-reduce.
        assert runs["ranks"][rank]["fused"]["tokens"] == [3] * (2 * layers) * len(DECODE)


def test_steps_run_in_token_chunks_with_overlapped_all_reduces_give_the_logits_of_one_rank(runs: dict[str, Any]) -> None:
    for rank in range(WORLD):
        assert runs["ranks"][rank]["overlap"]["chunks"] == {3: 1, 21: 2, 23: 2}
        for step, got in enumerate(runs["ranks"][rank]["overlap"]["logits"]):
            torch.testing.assert_close(got, runs["one_rank"][NAMES[0]][step], atol=1e-5, rtol=1e-4)


def test_overlapped_chunks_with_rope_in_place_attend_rows_of_one_qkv_output_with_the_logits_of_one_rank(
    runs: dict[str, Any],
) -> None:
    for rank in range(WORLD):
        seen = runs["ranks"][rank]["overlap_rows"]["rows_of_one_output"]
        assert seen and all(seen)  # every chunked layer's q, k, v were views, none joined by a copy
        for step, got in enumerate(runs["ranks"][rank]["overlap_rows"]["logits"]):
            torch.testing.assert_close(got, runs["one_rank"][NAMES[0]][step], atol=1e-5, rtol=1e-4)


def test_a_large_step_over_several_ranks_splits_into_chunks_of_whole_16_token_rows() -> None:
    from flashserve.distributed.comm import SingleRankGroup

    class TwoRanks(SingleRankGroup):
        rank, world_size = 0, 2

    model = LlamaModel(LlamaSpec.from_hf_config(configs()[NAMES[0]]), torch_ops(), group=TwoRanks())
    assert model.token_chunks(2048) == [slice(0, 2048)]  # off until overlap_min_tokens is set
    model.overlap_min_tokens = 1024
    assert model.token_chunks(2048) == [slice(0, 1024), slice(1024, 2048)]
    assert model.token_chunks(1000) == [slice(0, 1000)]
    assert model.token_chunks(1030) == [slice(0, 528), slice(528, 1030)]
    single = LlamaModel(LlamaSpec.from_hf_config(configs()[NAMES[0]]), torch_ops())
    single.overlap_min_tokens = 1024
    assert single.token_chunks(2048) == [slice(0, 2048)]  # one rank has nothing to overlap


def test_copy_engine_all_reduces_are_refused_off_gpus_with_the_flag_named() -> None:
    model = LlamaModel(LlamaSpec.from_hf_config(configs()[NAMES[0]]), torch_ops())
    with pytest.raises(ValueError, match="--tp-overlap-comm copy-engine"):
        model.use_copy_engine_sums(4096)


def test_every_rank_returns_the_whole_vocabulary(runs: dict[str, Any]) -> None:
    for name in NAMES:
        rank0, rank1 = (runs["ranks"][r]["models"][name]["state"] for r in range(WORLD))
        for a, b in zip(rank0, rank1):
            assert a.shape[-1] == runs["one_rank"][name][0].shape[-1]
            assert torch.equal(a, b)


def test_shard_read_from_safetensors_equals_shard_cut_from_the_state_dict(runs: dict[str, Any]) -> None:
    for rank in runs["ranks"]:
        for name in NAMES:
            model = rank["models"][name]
            assert all(torch.equal(a, b) for a, b in zip(model["files"], model["state"])), name


def test_one_rank_reads_the_whole_model_from_safetensors(runs: dict[str, Any]) -> None:
    from transformers import AutoConfig

    for name in NAMES:
        path = runs["root"] / name
        model = load_llama(path, AutoConfig.from_pretrained(path), torch.float32, "cpu", ops="torch")
        assert all(torch.equal(a, b) for a, b in zip(run_schedule(model), runs["one_rank"][name])), name


def test_a_rank_holds_only_its_heads_mlp_columns_and_vocabulary_rows(runs: dict[str, Any]) -> None:
    shapes = runs["ranks"][1]["models"]["llama_gqa_untied"]["shapes"]
    head_dim = 16
    assert shapes["layers.0.qkv_proj.weight"] == ((2 + 1 + 1) * head_dim, 64)  # 4 q / 2 kv heads, halved
    assert shapes["layers.0.o_proj.weight"] == (64, 2 * head_dim)
    assert shapes["layers.0.gate_up_proj.weight"] == (2 * 48, 64)
    assert shapes["layers.0.down_proj.weight"] == (64, 48)
    assert shapes["lm_head.weight"] == (128, 64)
    assert shapes["embed_tokens.weight"] == (128, 64)  # the same rows of the vocabulary as the head


def test_a_tied_model_s_rank_holds_only_its_vocabulary_rows_of_the_embedding(runs: dict[str, Any]) -> None:
    shapes = runs["ranks"][1]["models"]["llama_one_kv_head_tied_vocab_211"]["shapes"]
    assert shapes["embed_tokens.weight"][0] == shapes["lm_head.weight"][0] == 106  # 211 rows, padded halves


def test_a_single_kv_head_is_replicated_on_every_rank(runs: dict[str, Any]) -> None:
    assert [r["models"]["llama_one_kv_head_tied_vocab_211"]["heads"] for r in runs["ranks"]] == [(2, 1), (2, 1)]


def test_rank_processes_run_with_nvlink_multicast_off(runs: dict[str, Any]) -> None:
    assert [r["env"] for r in runs["ranks"]] == [MULTICAST_OFF_ENV] * WORLD


# --- the shard arithmetic, in this process ---------------------------------------------------


def layout(rank: int, world_size: int = 2, **shape: int) -> ShardLayout:
    fields = dict(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=96, vocab_size=256)
    return ShardLayout.build(rank=rank, world_size=world_size, **{**fields, **shape})


def test_a_vocabulary_that_does_not_divide_pads_the_last_shard() -> None:
    embedding = torch.arange(211.0)[:, None].expand(211, 3)
    first, last = (layout(r, vocab_size=211).slice_for("lm_head") for r in range(2))
    assert first is not None and last is not None
    assert torch.equal(first.take(embedding)[:, 0], torch.arange(106.0))
    assert torch.equal(last.take(embedding)[:, 0], torch.cat([torch.arange(106.0, 211.0), torch.zeros(1)]))


def test_row_parallel_biases_are_added_by_rank_zero_only() -> None:
    bias = torch.randn(64)
    kept, zeroed = (layout(r).slice_for("o_bias") for r in range(2))
    assert kept is not None and zeroed is not None
    assert torch.equal(kept.take(bias), bias) and torch.equal(zeroed.take(bias), torch.zeros(64))


def test_ranks_of_a_kv_head_keep_the_head_their_query_heads_use() -> None:
    # 8 q heads in 2 groups of 4 over 4 ranks: ranks 0-1 use KV head 0, ranks 2-3 KV head 1.
    assert [layout(r, 4, num_heads=8, num_kv_heads=2).kv_head_start for r in range(4)] == [0, 0, 1, 1]


def test_query_heads_that_do_not_divide_over_the_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="4 attention heads do not split over 3 ranks"):
        layout(0, 3)


def test_kv_heads_that_neither_divide_nor_replicate_evenly_are_refused() -> None:
    with pytest.raises(ValueError, match="3 KV heads do not split over 2 ranks"):
        layout(0, 2, num_heads=6, num_kv_heads=3)


def test_a_model_built_for_a_rank_of_an_impossible_split_is_refused() -> None:
    from transformers import LlamaConfig

    group: Any = SimpleNamespace(rank=0, world_size=3)
    with pytest.raises(ValueError, match="attention heads do not split"):
        LlamaModel.from_hf({}, LlamaConfig(**SMALL, vocab_size=256), torch.float32, "cpu", group=group)


# --- a rank that dies ------------------------------------------------------------------------


def _die_or_wait(_: None) -> None:
    """Rank 1 is killed before the all-reduce that rank 0 waits in."""
    group = init_tp_group("cpu")
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    group.all_reduce(torch.ones(1))
    time.sleep(600)  # should the all-reduce return, rank 0 still must not outlive the failure


def test_a_killed_rank_fails_the_launch_fast_and_leaves_no_process() -> None:
    start = time.monotonic()
    ranks = RankProcesses.start(_die_or_wait, (None,), world_size=WORLD)
    with pytest.raises(RankFailed, match="rank 1 was killed by SIGKILL"):
        ranks.join(timeout=120)
    assert time.monotonic() - start < 60
    for p in ranks.processes.values():
        assert not p.is_alive()
        with pytest.raises(ProcessLookupError):
            os.kill(p.pid, 0)  # type: ignore[arg-type]


def _start_ranks_and_wait(pid_file: str) -> None:
    """A stand-in for the server process: starts two sleeping ranks, then waits to be killed."""
    ranks = RankProcesses.start(time.sleep, (600,), world_size=WORLD)
    Path(pid_file + ".tmp").write_text(" ".join(str(p.pid) for p in ranks.processes.values()))
    os.replace(pid_file + ".tmp", pid_file)  # whole, or not there
    time.sleep(600)


def _is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_ranks_exit_when_the_process_that_started_them_is_killed(tmp_path: Path) -> None:
    import multiprocessing

    pid_file = tmp_path / "ranks"
    parent = multiprocessing.get_context("spawn").Process(target=_start_ranks_and_wait, args=(str(pid_file),))
    parent.start()
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and parent.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p) for p in pid_file.read_text().split()]
    finally:
        parent.kill()
        parent.join()
    deadline = time.monotonic() + 10
    while not all(_is_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [p for p in pids if not _is_gone(p)]
    for pid in orphans:  # so that a failure leaves nothing running either
        os.kill(pid, signal.SIGKILL)
    assert not orphans


def test_dummy_checkpoint_draws_the_same_weights_for_a_seed_and_others_for_another() -> None:
    from flashserve.model_loader.checkpoint import DummyCheckpoint
    from flashserve.models.llama_weights import LlamaSpec

    spec = LlamaSpec.from_hf_config(configs()["llama_gqa_untied"])
    a, b = (DummyCheckpoint(seed=7).read_llama_shard(spec, torch.float32, "cpu") for _ in range(2))
    other = DummyCheckpoint(seed=8).read_llama_shard(spec, torch.float32, "cpu")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["layers.0.qkv_proj.weight"], other["layers.0.qkv_proj.weight"])
    assert torch.equal(a["norm.weight"], torch.ones_like(a["norm.weight"]))  # norms start at 1
    assert a["embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def test_a_rank_draws_its_dummy_shard_as_the_slice_of_the_whole_dummy_model() -> None:
    from flashserve.model_loader.checkpoint import DummyCheckpoint
    from flashserve.models.llama_weights import LlamaSpec

    spec = LlamaSpec.from_hf_config(configs()["llama_gqa_untied"])
    whole = DummyCheckpoint(seed=3).read_llama_shard(spec, torch.float32, "cpu")
    shard = ShardLayout.for_spec(spec, 1, WORLD)
    part = DummyCheckpoint(seed=3).read_llama_shard(spec, torch.float32, "cpu", shard)
    # The rank's rows of the LM head, its columns of o_proj and down_proj.
    assert torch.equal(part["lm_head.weight"], shard.slice_for("lm_head").take(whole["lm_head.weight"]))
    assert torch.equal(part["layers.0.o_proj.weight"], shard.slice_for("o").take(whole["layers.0.o_proj.weight"]))
    assert torch.equal(part["layers.1.down_proj.weight"], shard.slice_for("down").take(whole["layers.1.down_proj.weight"]))
