"""LoRA adapters over two tensor-parallel ranks (gloo, CPU) give the logits of one rank.

The executor loads each adapter on rank 0 and sends it to the worker, whose shard of the adapter
follows its shard of the layers (lora_B's rows of q/k/v and gate/up, lora_A's columns of o and
down). The model has one KV head (replicated on both ranks) and an intermediate size of 97 (padded
to 2 x 49), so that the adapters' shards are cut and padded as the layers' are. Dummy weights,
seeded alike on one rank and two; the adapters are PEFT's, written for the same shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_helpers import ALL_MODULES, add_random_adapter, peft_wrap, save_adapter

from flashserve.config import CacheConfig, LoRAConfig, ModelConfig
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.message.lora import LoRAAdapterError, LoRARequest
from flashserve.message.sampling_params import SamplingParams

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=97,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, vocab_size=211,
              max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5,
              rope_theta=10000.0)  # fmt: skip
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(20, 39)), [7, 7, 8]]
LIDS = [1, 0, 2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora_tp")
    (root / "config.json").write_text(json.dumps(CONFIG))
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"}))
    peft_model = peft_wrap(hf, "one", r=8, alpha=16, modules=ALL_MODULES, seed=1, std=0.2)
    add_random_adapter(peft_model, "two", r=4, alpha=4, modules=["k_proj", "o_proj", "up_proj", "down_proj"], seed=2,
                       std=0.2)  # fmt: skip
    folders = {name: save_adapter(peft_model, name, str(root / "adapters")) for name in ("one", "two")}
    return {"model": str(root / "config.json"), "loras": [LoRARequest("one", 1, folders["one"]),
                                                          LoRARequest("two", 2, folders["two"])]}  # fmt: skip


def model_config(setup: dict[str, Any], tp: int) -> ModelConfig:
    return ModelConfig(model=setup["model"], load_format="dummy", dtype="float32", device="cpu",
                       tensor_parallel_size=tp, lora=LoRAConfig(max_loras=2, max_lora_rank=8))  # fmt: skip


@torch.inference_mode()
def steps(runner: Any, lids: list[int] = LIDS) -> list[torch.Tensor]:
    """A mixed prefill step (adapter one, base, adapter two), then a decode step."""
    new = [ScheduledRequest(f"r{i}", p, 0, [1 + 2 * i, 2 + 2 * i], True, SamplingParams(), p, [], lora_int_id=lid)
           for i, (p, lid) in enumerate(zip(PROMPTS, lids))]  # fmt: skip
    decode = [ScheduledRequest(f"r{i}", [11], len(p), [], True) for i, p in enumerate(PROMPTS)]
    return [runner.forward(SchedulerOutput(new)), runner.forward(SchedulerOutput(decode))]


def test_adapters_over_two_ranks_give_the_logits_of_one_rank(setup: dict[str, Any]) -> None:
    from flashserve.executor.build import build_runner
    from flashserve.executor.tensor_parallel import start_tensor_parallel

    cache = CacheConfig(num_pages=16)
    one, _, _ = build_runner(model_config(setup, 1), cache)
    for lora in setup["loras"]:
        one.add_lora(lora)
    expected = steps(one)
    one.batch.clear()
    base_only = steps(one, [0, 0, 0])
    assert (expected[0] - base_only[0]).abs().max() > 0.1  # the adapters matter
    executor, _, _ = start_tensor_parallel(model_config(setup, 2), cache, cuda_graph=False)
    try:
        with pytest.raises(LoRAAdapterError):  # refused on rank 0; the workers are not told
            executor.add_lora(LoRARequest("missing", 3, str(Path(setup["model"]).parent / "nothing")))
        for lora in setup["loras"]:
            executor.add_lora(lora)
        assert executor.list_loras() == {1, 2}
        for got, want in zip(steps(executor), expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert executor.remove_lora(2) is True and executor.list_loras() == {1}
    finally:
        executor.close()
