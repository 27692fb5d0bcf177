"""The engine on the embedded SmolLM2-135M-Instruct against HF transformers' own generate()."""

from __future__ import annotations

import pytest
import torch

from flashserve.config import ModelConfig
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams
from flashserve.model_loader.loader import load_model

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three prime numbers.",
    "Explain gravity in one sentence.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A small token budget forces chunked prefill mixed with other requests' decode steps.
    return LLM("", max_num_batched_tokens=24, max_num_seqs=8)


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    """The same checkpoint as a plain transformers model with eager attention (the reference)."""
    model = load_model(ModelConfig(), "cpu").model
    model.set_attn_implementation("eager")
    return model


def chat_ids(llm: LLM, question: str) -> list[int]:
    ids = llm.stack.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_greedy(model: torch.nn.Module, eos: list[int], prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_equal_hf_generate_for_requests_arriving_at_different_steps(llm, hf_model):
    max_new = 20
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    eos = list(llm.stack.loaded.eos_token_ids)
    expected = [hf_greedy(hf_model, eos, p, max_new) for p in prompts]
    params = SamplingParams(max_tokens=max_new, temperature=0.0, eos_token_ids=tuple(llm.stack.loaded.eos_token_ids))
    engine = llm.engine
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    arrivals = {0: [0], 2: [1], 3: [2], 7: [3]}  # step -> requests that arrive before it
    step = 0
    while step < 500 and (engine.has_unfinished or any(s >= step for s in arrivals)):
        for i in arrivals.get(step, []):
            engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        step += 1
    for i in range(len(prompts)):
        assert got[str(i)] == expected[i], QUESTIONS[i]
    assert engine.scheduler.kv_cache.num_used_pages == 0


def test_chat_answer_is_the_models_real_answer(llm):
    out = llm.generate([chat_ids(llm, QUESTIONS[0])], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in out.text


def test_torch_compile_gives_the_same_greedy_tokens(llm):
    # Start-up compiles every step size class (warm-up runs on CPU too when compiling).
    compiled = LLM("", max_num_batched_tokens=24, max_num_seqs=8, torch_compile=True)
    assert compiled.engine.executor.model.model.compiled
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [c.token_ids for c in llm.generate(prompts, params)]
    assert [c.token_ids for c in compiled.generate(prompts, params)] == expected


def test_prefix_cache_hits_give_the_same_greedy_tokens_as_hf(llm, hf_model):
    base = chat_ids(llm, "Describe a lighthouse on a stormy night, in detail.")  # asked by no other test
    mid = len(base) - 5 - (len(base) - 5) % 16 + 7  # a shared prefix that ends mid-page
    prompts = {
        "first": base,
        "shares a prefix ending mid-page": base[:mid] + chat_ids(llm, QUESTIONS[2])[-9:],
        "extends the first": base + chat_ids(llm, QUESTIONS[3])[-12:],
        **{f"n=4, choice {i}": base for i in range(4)},
    }
    eos = list(llm.stack.loaded.eos_token_ids)
    params = SamplingParams(max_tokens=12, temperature=0.0, eos_token_ids=tuple(eos))
    first = llm.generate([base], params)[0]  # computes and registers the shared pages
    later = dict(zip(list(prompts)[1:], llm.generate(list(prompts.values())[1:], params)))
    expected = {tuple(p): hf_greedy(hf_model, eos, p, 12) for p in prompts.values()}
    for name, out in {"first": first, **later}.items():
        assert out.token_ids == expected[tuple(prompts[name])], name
    assert first.num_cached_tokens < later["n=4, choice 0"].num_cached_tokens == (len(base) - 1) // 16 * 16
    assert later["shares a prefix ending mid-page"].num_cached_tokens == mid // 16 * 16 > 0
    assert later["extends the first"].num_cached_tokens == len(base) // 16 * 16
    assert llm.engine.scheduler.kv_cache.num_used_pages == 0
