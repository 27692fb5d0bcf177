"""The runner's logits over packed, ragged, chunked steps equal transformers' eager forward."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.config import CacheConfig, ModelConfig
from flashserve.engine.outputs import NOTHING, ScheduledRequest, SchedulerOutput, sample_error
from flashserve.executor.build import build_runner
from flashserve.message.sampling_params import SamplingParams
from flashserve.models import hf
from flashserve.worker.runner import ModelRunner

PAGE = 16
NUM_PAGES = 48
VOCAB = 211
SMALL = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=512,
)


class ArgmaxSampler:
    def sample_ids(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest], bitmask=None) -> torch.Tensor:  # noqa: ANN001
        return logits.argmax(-1)


def build_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2-bias":  # Qwen2 has q/k/v biases; make them non-zero so they matter
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=False))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=kind == "llama-tied"))
    return model.float().eval()


def make_runner(model: torch.nn.Module, sampler: object | None = None) -> ModelRunner:
    num_layers, heads, kv_heads, head_dim = hf.model_shape(model.config)
    backend = TorchAttentionBackend(num_layers, NUM_PAGES, PAGE, kv_heads, head_dim, torch.float32, "cpu", None,
                                    num_qo_heads=heads)
    return ModelRunner(hf.HFCausalLM(model), torch.device("cpu"), backend, sampler or ArgmaxSampler(), PAGE)


def eager_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [L, V] from transformers' own eager attention (no cache)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(previous)


class Requests:
    """Hand-made scheduling: shuffled pages from a free list, chunks chosen by the test."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(NUM_PAGES))
        self.rng.shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.pages: dict[str, list[int]] = {}

    def add(self, rid: str, total_len: int) -> None:
        self.tokens[rid] = [self.rng.randrange(VOCAB) for _ in range(total_len)]
        self.pages[rid] = [self.free.pop() for _ in range((total_len + PAGE - 1) // PAGE)]

    def chunk(self, rid: str, start: int, end: int, sample: bool = True) -> ScheduledRequest:
        return ScheduledRequest(rid, self.tokens[rid][start:end], start, self.pages[rid], sample, SamplingParams())


def check_steps(model: torch.nn.Module, reqs: Requests, steps: list[list[ScheduledRequest]]) -> None:
    runner = make_runner(model)
    expected_full = {rid: eager_logits(model, toks) for rid, toks in reqs.tokens.items()}
    for step in steps:
        logits = runner.forward(SchedulerOutput(step))
        expected = torch.stack([expected_full[r.request_id][r.kv_len - 1] for r in step if r.sample])
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


def ragged_schedule(reqs: Requests) -> list[list[ScheduledRequest]]:
    """Chunked prefill across steps, page-aligned and unaligned prompts, a late arrival, decodes."""
    for rid, length in (("a", 45), ("b", 19), ("c", 8), ("d", 36)):
        reqs.add(rid, length)
    c = reqs.chunk
    steps = [
        [c("a", 0, 20, sample=False), c("b", 0, 16), c("c", 0, 5)],
        [c("a", 20, 40), c("b", 16, 17), c("c", 5, 6), c("d", 0, 32)],
    ]
    for i in range(3):  # decodes; b finishes after two, c joins the last one
        other = c("b", 17 + i, 18 + i) if i < 2 else c("c", 6, 7)
        steps.append([c("a", 40 + i, 41 + i), other, c("d", 32 + i, 33 + i)])
    return steps


@pytest.mark.parametrize("kind", ["llama-untied", "llama-tied", "qwen2-bias"])
def test_runner_logits_match_eager_forward_over_chunked_ragged_steps(kind: str) -> None:
    reqs = Requests()
    check_steps(build_model(kind), reqs, ragged_schedule(reqs))


def test_attention_gets_backend_through_forward_kwargs_and_no_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, object, int]] = []
    real = hf.paged_attention_forward

    def spy(module, query, key, value, attention_mask, scaling=None, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((module.layer_idx, attention_mask, id(kwargs[hf.BACKEND_KWARG])))
        return real(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    monkeypatch.setattr(hf, "paged_attention_forward", spy)
    model = build_model("llama-untied")
    runner = make_runner(model)
    reqs = Requests()
    reqs.add("a", 10)
    runner.forward(SchedulerOutput([reqs.chunk("a", 0, 10)]))
    assert [layer for layer, _, _ in seen] == [0, 1]
    assert all(mask is None for _, mask, _ in seen)  # no O(T^2) mask was built
    assert all(backend == id(runner.backend) for _, _, backend in seen)
    hf.register_paged_attention()  # leave the real function registered for other tests


def test_lm_head_runs_only_on_sampled_rows() -> None:
    model = build_model("llama-untied")
    rows: list[int] = []
    model.lm_head.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    reqs = Requests()
    reqs.add("a", 40)
    reqs.add("b", 12)
    reqs.add("c", 5)
    runner = make_runner(model)
    step = [reqs.chunk("a", 0, 40), reqs.chunk("b", 0, 12, sample=False), reqs.chunk("c", 0, 5)]
    runner.forward(SchedulerOutput(step))
    assert rows == [2]


def test_execute_returns_no_token_for_chunks_that_do_not_sample() -> None:
    reqs = Requests()
    reqs.add("a", 30)
    reqs.add("b", 4)
    runner = make_runner(build_model("llama-tied"))
    result = runner.execute(SchedulerOutput([reqs.chunk("a", 0, 16, sample=False), reqs.chunk("b", 0, 4)]))
    assert result[0] == NOTHING
    assert len(result[1].token_ids) == 1 and 0 <= result[1].token_ids[0] < VOCAB


class FailsOnRequest(ArgmaxSampler):
    def __init__(self, bad_id: str) -> None:
        self.bad_id = bad_id

    def sample_ids(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest], bitmask=None) -> torch.Tensor:  # noqa: ANN001
        if any(r.request_id == self.bad_id for r in requests):
            raise ValueError(f"cannot sample {self.bad_id}")
        return super().sample_ids(logits, requests, bitmask)


def test_sampling_error_fails_only_its_request() -> None:
    reqs = Requests()
    for rid in ("a", "b", "c"):
        reqs.add(rid, 6)
    runner = make_runner(build_model("llama-tied"), FailsOnRequest("b"))
    result = runner.execute(SchedulerOutput([reqs.chunk(rid, 0, 6) for rid in ("a", "b", "c")]))
    assert result[1] == sample_error("cannot sample b")
    assert all(len(result[i].token_ids) == 1 for i in (0, 2))


def test_execute_of_an_empty_step_returns_nothing() -> None:
    assert make_runner(build_model("llama-tied")).execute(SchedulerOutput([])) == []


def test_build_runner_sizes_the_cpu_cache_from_gigabytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = LlamaConfig(**SMALL)
    config.save_pretrained(tmp_path)
    cache = CacheConfig(page_size=PAGE, cpu_kv_cache_gb=1 / 1024)  # 1 MiB
    runner, loaded, num_pages = build_runner(ModelConfig(model=str(tmp_path), load_format="dummy", device="cpu"), cache)
    page_bytes = 2 * 2 * PAGE * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, float32
    assert num_pages == (1 << 20) // page_bytes
    assert loaded.max_model_len == min(512, num_pages * PAGE)
    assert runner.backend.kv_cache[0][0].shape == (num_pages, PAGE, 2, 16)
    reqs = Requests()
    reqs.add("a", 7)
    assert len(runner.execute(SchedulerOutput([reqs.chunk("a", 0, 7)]))[0].token_ids) == 1
