"""The draft-model method on the CPU: the embedded model as its own draft has every draft accepted,
and a copy of it cut to its first layers has some accepted; either way greedy outputs are the
target's own."""

from __future__ import annotations


import pytest

from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams
from flashserve.model_loader.loader import embedded_gguf_path
from spec_helpers import speculation_off

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def chats(llm: LLM) -> list[list[int]]:
    tokenizer = llm.stack.tokenizer
    return [list(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                                 add_generation_prompt=True, tokenize=False)))
            for q in QUESTIONS]


def on_and_off(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    prompts = chats(llm)
    on = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    with speculation_off(llm):
        off = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    return on, off


def test_the_model_as_its_own_draft_has_every_draft_accepted():
    llm = LLM("", num_pages=96, max_num_seqs=4,
              speculative_config={"model": embedded_gguf_path(), "num_speculative_tokens": 3})
    on, off = on_and_off(llm)
    stats = llm.engine.scheduler.spec_stats
    assert on == off
    assert stats is not None and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_of_the_first_layers_has_some_drafts_accepted(tmp_path):
    from flashserve.config import ModelConfig
    from flashserve.model_loader.loader import load_model

    loaded = load_model(ModelConfig(device="cpu"), "cpu")  # transformers' model of the embedded checkpoint
    model = loaded.model
    model.model.layers = model.model.layers[:20]
    model.config.num_hidden_layers = 20
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:20]
    model.save_pretrained(tmp_path)
    loaded.tokenizer.save_pretrained(tmp_path)
    llm = LLM("", num_pages=96, max_num_seqs=4, speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3})
    on, off = on_and_off(llm)
    stats = llm.engine.scheduler.spec_stats
    assert on == off
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
