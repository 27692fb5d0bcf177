"""The draft model's weights and KV pool count in the KV cache's sizing at start: each page of the
budget pays for the target's page and the draft's page of the same id, and the draft is loaded
before the GPU's free memory is measured."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from flashserve.config import CacheConfig, ModelConfig
from flashserve.executor.build import build_runner
from flashserve.spec_decode.config import SpeculativeConfig
from flashserve.worker.assembly import num_kv_pages

MIB = 1 << 20


def test_each_page_of_the_cpu_budget_pays_for_the_drafts_page_too():
    cache = CacheConfig(cpu_kv_cache_gb=1 / 1024)
    assert num_kv_pages(cache, 2048, torch.device("cpu"), draft_page_bytes=4096) == MIB // 6144


def test_the_gpu_budget_is_the_free_memory_left_after_both_models_loaded(monkeypatch):
    free = 10 * MIB  # what the device reports after the target's and the draft's weights
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * MIB))
    cache = CacheConfig(gpu_memory_utilization=0.5)
    assert num_kv_pages(cache, 1000, torch.device("cuda"), draft_page_bytes=500) == (5 * MIB) // 1500


def tiny_config(path: Path, layers: int) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": layers, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "vocab_size": 512,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    }))  # fmt: skip
    return str(path)


@pytest.fixture(scope="module")
def built(tmp_path_factory):  # noqa: ANN001
    """A one-layer target with a two-layer draft of dummy weights, on a 1 MiB CPU KV budget; the
    start-up log records."""
    root = tmp_path_factory.mktemp("draft-sizing")
    target, draft = tiny_config(root / "target", 1), tiny_config(root / "draft", 2)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("flashserve")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        runner, _, num_pages = build_runner(
            ModelConfig(model=target, load_format="dummy", device="cpu"), CacheConfig(cpu_kv_cache_gb=1 / 1024),
            speculative=SpeculativeConfig("draft_model", 3, model=draft))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    return runner, num_pages, [r.getMessage() for r in records]


def test_the_target_gets_the_pages_that_the_budget_buys_beside_the_drafts(built):
    _, num_pages, _ = built
    target_page = 2 * 1 * 16 * 1 * 16 * 4  # K and V, 1 layer, page of 16, 1 KV head, head_dim 16, float32
    draft_page = 2 * target_page  # 2 layers
    assert num_pages == MIB // (target_page + draft_page)


def test_the_draft_has_its_kv_pool_of_as_many_pages_as_the_target(built):
    runner, num_pages, _ = built
    assert runner.drafter is not None
    assert runner.drafter.backend.kv_cache[0][0].shape[0] == num_pages == runner.backend.kv_cache[0][0].shape[0]


def test_the_start_up_log_reports_the_drafts_weights_and_kv_pool(built):
    runner, num_pages, messages = built
    line = next(m for m in messages if m.startswith("draft model"))
    assert f"its own KV pool of {num_pages} pages" in line and "weights" in line and "memory sizing" in line


def test_only_a_runner_built_for_speculation_looks_for_draft_tokens(built, tiny_llama_config):
    runner, _, _ = built
    plain, _, _ = build_runner(ModelConfig(model=str(tiny_llama_config.parent), load_format="dummy", device="cpu"),
                               CacheConfig(num_pages=8))
    assert runner.speculative and not plain.speculative


def test_model_bytes_counts_a_tied_weight_once():
    from flashserve.executor.draft import model_bytes

    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    assert model_bytes(torch.nn.Sequential(embed, head)) == 10 * 4 * 4
