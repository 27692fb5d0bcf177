"""LoRA adapters on a tiny random Llama: what is refused at load and why, the HF cache, and the
runner's adapters over fewer device slots and host cache entries than adapters (add, remove,
eviction, reloading), each step's logits against PEFT's forward of the same adapter."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_helpers import ALL_MODULES, add_random_adapter, peft_logits, peft_wrap, save_adapter

from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.config import LoRAConfig
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.lora.adapter import load_adapter
from flashserve.lora.layers import LoRAStack
from flashserve.lora.manager import enable_lora
from flashserve.message.lora import LoRAAdapterError, LoRARequest
from flashserve.message.sampling_params import SamplingParams
from flashserve.models import llama as llama_module
from flashserve.models.llama import LlamaModel, LlamaSpec
from flashserve.models.native import NativeCausalLM
from flashserve.worker.runner import ModelRunner

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, vocab_size=256)  # fmt: skip
PAGE, NUM_PAGES, ATOL = 16, 16, 1e-4


def tiny_llama(**overrides: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**SMALL, **overrides})).float().eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Llama's native model and three adapters PEFT wrote for it (then PEFT's model)."""
    base = tiny_llama()
    native = LlamaModel.from_hf(base, base.config, torch.float32, "cpu", consume=False, ops="torch")
    peft_model = peft_wrap(base, "one", r=8, alpha=16, modules=ALL_MODULES, seed=1, std=0.2)
    add_random_adapter(peft_model, "two", r=4, alpha=8, modules=["q_proj", "v_proj", "down_proj"], seed=2, std=0.2)
    add_random_adapter(peft_model, "three", r=8, alpha=4, modules=["k_proj", "o_proj", "up_proj"], seed=3, std=0.2,
                       rslora=True)  # fmt: skip
    root = str(tmp_path_factory.mktemp("adapters"))
    folders = {name: save_adapter(peft_model, name, root) for name in ("one", "two", "three")}
    return {"native": native, "peft": peft_model, "folders": folders, "spec": native.spec}


def request(adapters: dict[str, Any], name: str, lid: int) -> LoRARequest:
    return LoRARequest(name, lid, adapters["folders"][name])


def copy_adapter(adapters: dict[str, Any], tmp_path: Path, name: str = "one") -> Path:
    folder = tmp_path / "adapter"
    shutil.copytree(adapters["folders"][name], folder)
    return folder


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def refusal(folder: Path | str, spec: LlamaSpec, max_rank: int = 16) -> str:
    with pytest.raises(LoRAAdapterError) as info:
        load_adapter(LoRARequest("bad", 1, str(folder)), spec, max_rank)
    assert "'bad'" in str(info.value)  # the message names the adapter
    return str(info.value)


# --- refused at load, with what is wrong ---------------------------------------------------------


def test_a_rank_over_max_lora_rank_is_refused_naming_the_flag(adapters: dict[str, Any]) -> None:
    message = refusal(adapters["folders"]["one"], adapters["spec"], max_rank=4)
    assert "rank 8 exceeds --max-lora-rank 4" in message


def test_an_adapter_trained_for_another_base_model_is_refused_for_its_shapes(tmp_path: Path,
                                                                             adapters: dict[str, Any]) -> None:
    other = peft_wrap(tiny_llama(hidden_size=32, intermediate_size=48), "default", r=4, alpha=4,
                      modules=["q_proj"], seed=5)  # fmt: skip
    folder = save_adapter(other, "default", str(tmp_path))
    assert "another base model" in refusal(folder, adapters["spec"])


@pytest.mark.parametrize("modules", [["lm_head"], ["embed_tokens"]])
def test_an_adapter_on_the_lm_head_or_embeddings_is_refused_naming_the_supported_modules(
    tmp_path: Path, adapters: dict[str, Any], modules: list[str]
) -> None:  # fmt: skip
    wrapped = peft_wrap(tiny_llama(), "default", r=4, alpha=4, modules=["q_proj", *modules], seed=6)
    message = refusal(save_adapter(wrapped, "default", str(tmp_path)), adapters["spec"])
    assert modules[0] in message and "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in message


def test_modules_to_save_is_refused(tmp_path: Path, adapters: dict[str, Any]) -> None:
    folder = copy_adapter(adapters, tmp_path)
    edit_config(folder, modules_to_save=["lm_head"])
    assert "modules_to_save" in refusal(folder, adapters["spec"])


def test_weights_for_a_layer_the_model_does_not_have_are_refused(tmp_path: Path, adapters: dict[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy_adapter(adapters, tmp_path)
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    assert "layer 7" in refusal(folder, adapters["spec"])


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("no_config", "adapter_config.json is missing"),
        ("no_weights", "adapter_model.safetensors is missing"),
        ("corrupt_weights", "not a readable safetensors file"),
        ("corrupt_config", "adapter_config.json is not valid JSON"),
        ("one_half_missing", "not both lora_A and lora_B"),
    ],
)
def test_missing_or_corrupt_files_are_refused_clearly(tmp_path: Path, adapters: dict[str, Any], damage: str,
                                                      expected: str) -> None:  # fmt: skip
    from safetensors.torch import load_file, save_file

    folder = copy_adapter(adapters, tmp_path)
    weights = folder / "adapter_model.safetensors"
    if damage == "no_config":
        (folder / "adapter_config.json").unlink()
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "corrupt_weights":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors")
    elif damage == "corrupt_config":
        (folder / "adapter_config.json").write_text("{r: 8,")
    else:
        save_file({k: v for k, v in load_file(weights).items() if "layers.0.self_attn.q_proj.lora_B" not in k}, weights)
    assert expected in refusal(folder, adapters["spec"])


def test_a_path_that_is_neither_a_folder_nor_a_cached_hf_repository_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapters: dict[str, Any]
) -> None:  # fmt: skip
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "not downloaded" in refusal("someone/not-cached-adapter", adapters["spec"])
    assert "no folder" in refusal(str(tmp_path / "missing" / "dir"), adapters["spec"])


def test_an_hf_id_in_the_local_hf_cache_loads_without_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapters: dict[str, Any]
) -> None:  # fmt: skip
    import huggingface_hub.constants

    # The cache's layout: models--org--name/{refs/main, snapshots/<commit>/files}.
    repo = tmp_path / "hub" / "models--someone--tiny-adapter"
    commit = "0" * 40
    shutil.copytree(adapters["folders"]["two"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    adapter = load_adapter(LoRARequest("two", 2, "someone/tiny-adapter"), adapters["spec"], 16)
    assert adapter.rank == 4 and {m for _, m in adapter.weights} == {"q_proj", "v_proj", "down_proj"}


# --- the runner's adapters: slots, host cache, add and remove -------------------------------------


def tiny_runner(adapters: dict[str, Any], lora: LoRAConfig | None) -> ModelRunner:
    native = adapters["native"]
    spec = native.spec
    backend = TorchAttentionBackend(spec.num_layers, NUM_PAGES, PAGE, spec.num_kv_heads, spec.head_dim, torch.float32,
                                    "cpu", num_qo_heads=spec.num_heads)  # fmt: skip
    model = NativeCausalLM(native)
    native.lora = None
    runner = ModelRunner(model, torch.device("cpu"), backend, None, PAGE)  # type: ignore[arg-type]
    if lora is not None:
        runner.lora = enable_lora(model, lora)
    return runner


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(0, 256, (6 + i,), generator=gen).tolist() for i in range(n)]


@torch.inference_mode()
def run_step(runner: ModelRunner, lids: list[int]) -> list[torch.Tensor]:
    """Each row's last-position logits of one prefill step whose rows use adapters `lids`."""
    runner.batch.clear()
    rows = [ScheduledRequest(f"r{i}", p, 0, [1 + i], True, SamplingParams(), p, [], lora_int_id=lid)
            for i, (p, lid) in enumerate(zip(prompts(len(lids)), lids))]  # fmt: skip
    return list(runner.forward(SchedulerOutput(rows)))


NAMES = {1: "one", 2: "two", 3: "three"}


def expected(adapters: dict[str, Any], lids: list[int]) -> list[torch.Tensor]:
    return [peft_logits(adapters["peft"], NAMES.get(lid), p)[-1] for p, lid in zip(prompts(len(lids)), lids)]


def test_adapters_over_fewer_slots_and_host_entries_evict_the_least_recently_used_and_reload(
    adapters: dict[str, Any]
) -> None:  # fmt: skip
    runner = tiny_runner(adapters, LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2))
    for lid, name in NAMES.items():
        runner.add_lora(request(adapters, name, lid))
    assert runner.list_loras() == {1, 2, 3}
    assert runner.lora is not None and set(runner.lora.cache) == {2, 3}  # two host entries: "one" left first
    for lids in ([1, 2, 0], [2], [3, 0], [1, 3, 1]):  # "one" is read again; "three" evicts "one", then "two"
        for got, want in zip(run_step(runner, lids), expected(adapters, lids)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert set(runner.lora.slot_of) == {1, 3}


def test_a_removed_adapter_is_forgotten_and_a_step_naming_it_is_refused(adapters: dict[str, Any]) -> None:
    runner = tiny_runner(adapters, LoRAConfig(max_loras=2, max_lora_rank=8))
    runner.add_lora(request(adapters, "one", 1))
    run_step(runner, [1])
    assert runner.remove_lora(1) is True
    assert runner.remove_lora(1) is False and runner.list_loras() == set()
    with pytest.raises(LoRAAdapterError, match="adapter id 1, which was not loaded"):
        run_step(runner, [1])
    for got, want in zip(run_step(runner, [0]), expected(adapters, [0])):  # the base model still serves
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_a_failed_add_leaves_the_adapters_as_they_were(tmp_path: Path, adapters: dict[str, Any]) -> None:
    runner = tiny_runner(adapters, LoRAConfig(max_loras=1, max_lora_rank=8))
    runner.add_lora(request(adapters, "two", 2))
    with pytest.raises(LoRAAdapterError):
        runner.add_lora(LoRARequest("broken", 5, str(tmp_path / "nothing")))
    assert runner.list_loras() == {2}


def test_more_adapters_in_one_step_than_max_loras_is_refused(adapters: dict[str, Any]) -> None:
    runner = tiny_runner(adapters, LoRAConfig(max_loras=1, max_lora_rank=8))
    runner.add_lora(request(adapters, "one", 1))
    runner.add_lora(request(adapters, "two", 2))
    with pytest.raises(LoRAAdapterError, match="--max-loras is 1"):
        run_step(runner, [1, 2])


def test_adding_an_adapter_without_enable_lora_is_refused(adapters: dict[str, Any]) -> None:
    runner = tiny_runner(adapters, None)
    with pytest.raises(LoRAAdapterError, match="--enable-lora"):
        runner.add_lora(request(adapters, "one", 1))


def test_the_generic_transformers_path_refuses_enable_lora() -> None:
    from flashserve.models.hf import HFCausalLM

    with pytest.raises(ValueError, match="--enable-lora needs the native model path"):
        enable_lora(HFCausalLM(tiny_llama()), LoRAConfig())


def test_a_stack_whose_shrink_joins_each_projections_gemm_gives_peft_logits(adapters: dict[str, Any],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`LoRAStack.fuse_shrink` (what a GPU's stack does): each projection's weight and its slots' A
    in one matrix, the adapters through the masked expand (the CPU's per-segment path off, as on a
    GPU), against PEFT for mixed steps, and base rows as the base model's."""
    monkeypatch.setattr(LoRAStack, "_segments", staticmethod(lambda token_slots: None))
    monkeypatch.setattr(llama_module, "packs_for_onednn", lambda *args: False)  # dense weights, as on a GPU
    base = tiny_llama()  # the base PEFT wrapped
    native = LlamaModel.from_hf(base, base.config, torch.float32, "cpu", consume=False, ops="torch")
    runner = tiny_runner({**adapters, "native": native}, LoRAConfig(max_loras=3, max_lora_rank=8))
    assert runner.lora is not None and runner.lora.stack.fuse_shrink(runner.model.model.layers)
    for lid, name in NAMES.items():
        runner.add_lora(request(adapters, name, lid))
    for lids in ([1, 2, 0], [2], [3, 0], [1, 3, 1], [0]):
        for got, want in zip(run_step(runner, lids), expected(adapters, lids)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
