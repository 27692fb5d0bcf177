"""Four tensor-parallel ranks compute the single-process logits, with fewer KV heads than ranks.

The 70B served at tensor parallelism 4 has 8 KV heads (2 a rank), but smaller models and larger
TP sizes have fewer KV heads than ranks: then each rank keeps the one KV head its query heads
attend with. Four rank processes (gloo on loopback, one thread each) load tiny random Llama
checkpoints with 1 and 2 KV heads and a vocabulary that does not divide by 4, keep only their
shards, and run `test_tensor_parallel`'s schedule (a prefill step, a mixed prefill + decode step,
decode steps over the paged cache); their logits are compared with one process's, in float32.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_tensor_parallel import DECODE, MIXED, PREFILL, SMALL, config_of, hf_model, run_schedule

from flashserve.distributed.comm import close_tp_group, init_tp_group
from flashserve.executor.launch import RankProcesses
from flashserve.models.llama import LlamaModel

WORLD = 4
NAMES = ["one_kv_head_vocab_211", "two_kv_heads_vocab_257_tied"]


def configs() -> dict[str, Any]:
    from transformers import LlamaConfig

    return {
        "one_kv_head_vocab_211": LlamaConfig(**{**SMALL, "num_key_value_heads": 1}, vocab_size=211,
                                             tie_word_embeddings=False),  # fmt: skip
        "two_kv_heads_vocab_257_tied": LlamaConfig(**{**SMALL, "num_attention_heads": 8, "num_key_value_heads": 2},
                                                   vocab_size=257, tie_word_embeddings=True),  # fmt: skip
    }


def _rank_main(checkpoints: str, names: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)  # four ranks share the machine's cores
    group = init_tp_group("cpu")
    found = {}
    for name in names:
        path = os.path.join(checkpoints, name)
        model = LlamaModel.from_hf(load_file(os.path.join(path, "model.safetensors")), config_of(path), torch.float32,
                                   "cpu", ops="torch", group=group)  # fmt: skip
        found[name] = {"logits": run_schedule(model), "heads": (model.shard.num_heads, model.shard.num_kv_heads),
                       "kv_head_start": model.shard.kv_head_start}  # fmt: skip
    torch.save(found, os.path.join(out_dir, f"rank{group.rank}.pt"))
    close_tp_group(group)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tp4")
    one_rank = {}
    for name, config in configs().items():
        hf = hf_model(config)
        hf.save_pretrained(root / name)
        one_rank[name] = run_schedule(LlamaModel.from_hf(hf, config, torch.float32, "cpu", ops="torch"))
    with RankProcesses.start(_rank_main, (str(root), NAMES, str(root)), world_size=WORLD) as ranks:
        ranks.join(timeout=240)
    return {"one_rank": one_rank, "ranks": [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]}


def assert_steps_match(runs: dict[str, Any], name: str, steps: list[int]) -> None:
    for step in steps:
        expected = runs["one_rank"][name][step]
        for rank in range(WORLD):
            got = runs["ranks"][rank][name]["logits"][step]
            where = f"rank {rank} step {step}"
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_four_ranks_match_one_rank_on_a_prefill_step(runs: dict[str, Any], name: str) -> None:
    assert_steps_match(runs, name, PREFILL)


@pytest.mark.parametrize("name", NAMES)
def test_four_ranks_match_one_rank_on_a_mixed_prefill_and_decode_step(runs: dict[str, Any], name: str) -> None:
    assert_steps_match(runs, name, MIXED)


@pytest.mark.parametrize("name", NAMES)
def test_four_ranks_match_one_rank_on_decode_steps_over_the_paged_cache(runs: dict[str, Any], name: str) -> None:
    assert_steps_match(runs, name, DECODE)


def test_with_fewer_kv_heads_than_ranks_each_rank_keeps_the_kv_head_of_its_query_heads(runs: dict[str, Any]) -> None:
    # 4 query heads over 4 ranks, one KV head: every rank keeps head 0. 8 query heads and 2 KV
    # heads: ranks 0 and 1 (query heads 0-3) keep KV head 0, ranks 2 and 3 keep KV head 1.
    one = [runs["ranks"][r]["one_kv_head_vocab_211"] for r in range(WORLD)]
    two = [runs["ranks"][r]["two_kv_heads_vocab_257_tied"] for r in range(WORLD)]
    assert [(r["heads"], r["kv_head_start"]) for r in one] == [((1, 1), 0)] * 4
    assert [(r["heads"], r["kv_head_start"]) for r in two] == [((2, 1), 0), ((2, 1), 0), ((2, 1), 1), ((2, 1), 1)]
