"""LoRA adapters in the runner on the embedded SmolLM2-135M (float32, CPU): the logits of base +
adapter against PEFT's own forward of the same adapter on the same base, and a step mixing four
adapters and base rows against steps of each row's adapter alone.

The adapters are written by PEFT (`save_pretrained`) from random A and B; the runner is built as
the server builds it (`build_runner` with a `LoRAConfig`), once for the module.

Tolerance: float32 throughout; the native forward matches transformers' to 1e-4 without adapters
(tests/test_native_llama.py); with adapters the logits agree with PEFT's to 5e-4 absolute (on
logits of magnitude ~20), while each adapter moves them by more than 0.5.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lora_helpers import ALL_MODULES, add_random_adapter, peft_logits, peft_wrap, save_adapter

from flashserve.config import CacheConfig, LoRAConfig, ModelConfig
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.message.lora import LoRARequest
from flashserve.message.sampling_params import SamplingParams
from flashserve.model_loader.loader import embedded_gguf_path

ATOL = 5e-4
# name: (id, PEFT's arguments)
ADAPTERS: dict[str, tuple[int, dict[str, Any]]] = {
    "every-projection": (1, dict(r=8, alpha=16, modules=ALL_MODULES, seed=1)),
    "q-v-rslora": (2, dict(r=16, alpha=8, modules=["q_proj", "v_proj"], seed=2, rslora=True)),
    "o-gate-down": (3, dict(r=4, alpha=4, modules=["o_proj", "gate_proj", "down_proj"], seed=3)),
    "k-up": (4, dict(r=16, alpha=32, modules=["k_proj", "up_proj"], seed=4)),
}
PAGE = 16


@pytest.fixture(scope="module")
def peft_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The embedded model in transformers (float32) with the four adapters, saved by PEFT."""
    from transformers import AutoModelForCausalLM

    path = embedded_gguf_path()
    base = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, attn_implementation="eager")  # fmt: skip
    names = list(ADAPTERS)
    model = peft_wrap(base, names[0], **ADAPTERS[names[0]][1])
    for name in names[1:]:
        add_random_adapter(model, name, **ADAPTERS[name][1])
    root = str(tmp_path_factory.mktemp("adapters"))
    model.folders = {name: save_adapter(model, name, root) for name in names}
    return model.eval()


@pytest.fixture(scope="module")
def runner(peft_model: Any) -> Any:
    from flashserve.executor.build import build_runner

    lora = LoRAConfig(max_loras=4, max_lora_rank=16)
    runner, _, _ = build_runner(ModelConfig(device="cpu", lora=lora), CacheConfig(num_pages=64, page_size=PAGE))
    for name, (lid, _) in ADAPTERS.items():
        runner.add_lora(LoRARequest(name, lid, peft_model.folders[name]))
    return runner


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_row(rid: str, tokens: list[int], pages: list[int], lora_int_id: int) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, 0, pages, True, SamplingParams(), tokens, [], lora_int_id=lora_int_id)


def decode_row(rid: str, token: int, position: int) -> ScheduledRequest:
    return ScheduledRequest(rid, [token], position, [], True)


@pytest.mark.parametrize("name", [*ADAPTERS, None])
@torch.inference_mode()
def test_runner_logits_with_an_adapter_match_peft_forward_of_it(runner: Any, peft_model: Any, name: str | None) -> None:
    lid = ADAPTERS[name][0] if name is not None else 0
    tokens = prompt(lid, 13)
    runner.batch.clear()
    prefill = runner.forward(SchedulerOutput([new_row("r", tokens[:12], [1], lid)]), prompt_rows=range(11))
    decode = runner.forward(SchedulerOutput([decode_row("r", tokens[12], 12)]))
    expected = peft_logits(peft_model, name, tokens)
    got = torch.cat([prefill[1:], prefill[:1], decode])  # positions 0..10, then 11, then 12
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    if name is not None:  # the adapter matters: its logits are not the base model's
        assert (expected - peft_logits(peft_model, None, tokens)).abs().max() > 0.5


@torch.inference_mode()
def test_a_step_mixing_four_adapters_and_base_rows_gives_each_row_its_adapters_logits_alone(runner: Any) -> None:
    lids = [1, 0, 2, 3, 0, 4, 1]
    prompts = [prompt(100 + i, 5 + i) for i in range(len(lids))]
    runner.batch.clear()
    mixed = [new_row(f"m{i}", p, [1 + i], lid) for i, (p, lid) in enumerate(zip(prompts, lids))]
    mixed_prefill = runner.forward(SchedulerOutput(mixed))
    mixed_decode = runner.forward(SchedulerOutput([decode_row(f"m{i}", 7, len(p)) for i, p in enumerate(prompts)]))
    for i, (p, lid) in enumerate(zip(prompts, lids)):
        runner.batch.clear()
        alone_prefill = runner.forward(SchedulerOutput([new_row("alone", p, [20], lid)]))
        alone_decode = runner.forward(SchedulerOutput([decode_row("alone", 7, len(p))]))
        torch.testing.assert_close(mixed_prefill[i], alone_prefill[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(mixed_decode[i], alone_decode[0], atol=ATOL, rtol=0)
        if lid:  # and the row's adapter applied: not the base model's logits
            runner.batch.clear()
            base = runner.forward(SchedulerOutput([new_row("base", p, [21], 0)]))
            assert (mixed_prefill[i] - base[0]).abs().max() > 0.5
