"""Two tensor-parallel ranks over NCCL on two GPUs generate what one GPU generates, and leave no
process behind. A small float32 Llama (8 query heads, 2 KV heads, a vocabulary of 1,001 that does
not divide by 2), dummy weights seeded alike on every rank. Steps run eagerly: tensor parallelism
captures no CUDA graphs yet. Skipped on a machine with fewer than two GPUs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from test_tp_engine import gone, worker_pids

from flashserve.llm import LLM
from flashserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=1001,
              max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-5,
              rope_theta=10000.0)  # fmt: skip
ENGINE = dict(load_format="dummy", dtype="float32", num_pages=256, max_num_batched_tokens=64)
PROMPTS = [[1, 2, 3], [5] * 40, list(range(7, 200))]  # whole, chunked and mixed prefills, then decodes
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory: Any) -> str:
    path = tmp_path_factory.mktemp("tp-model") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def one_gpu_tokens(model: str) -> list[list[int]]:
    with LLM(model, cuda_graph=False, **ENGINE) as llm:
        return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def test_two_gpus_generate_the_greedy_tokens_of_one(model: str, one_gpu_tokens: list[list[int]]) -> None:
    with LLM(model, tensor_parallel_size=2, **ENGINE) as llm:
        tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert tokens == one_gpu_tokens


def test_close_ends_the_worker_promptly(model: str) -> None:
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    pids = worker_pids(llm)
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 10  # not the 30 s join timeout and a kill
    assert all(gone(pid) for pid in pids)
