"""Speculative decoding over two tensor-parallel ranks (gloo, CPU): verify steps reach the worker
rank as they are (their draft rows included) and the greedy tokens are one rank's without
speculation, with n-gram drafts and with a draft model (on rank 0 alone). Dummy weights of a small
Llama config, as tests/test_tp_engine.py."""

from __future__ import annotations

import pytest
from test_tp_engine import ENGINE, write_config

from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.slow
def test_two_ranks_with_speculation_generate_one_ranks_greedy_tokens(tmp_path):
    model = write_config(tmp_path)
    prompts = [list(range(7, 20)) * 3, [5, 6] * 10]  # repeats: prompt lookup finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = [c.token_ids for c in LLM(model, **ENGINE).generate(prompts, params)]
    with LLM(model, tensor_parallel_size=2, speculative_config=SPEC, **ENGINE) as pair:
        assert [c.token_ids for c in pair.generate(prompts, params)] == expected
        stats = pair.engine.scheduler.spec_stats
        assert stats is not None and stats.num_drafts > 0


@pytest.mark.slow
def test_two_ranks_with_a_draft_model_on_rank_zero_generate_one_ranks_greedy_tokens(tmp_path):
    """The model as its own draft: every draft agrees with the target, so verify steps accept them
    and the tokens are still the target's greedy ones."""
    model = write_config(tmp_path)
    prompts = [list(range(7, 30)), [5, 6, 9] * 6]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = [c.token_ids for c in LLM(model, **ENGINE).generate(prompts, params)]
    spec = {"model": model, "num_speculative_tokens": 3}
    with LLM(model, tensor_parallel_size=2, speculative_config=spec, **ENGINE) as pair:
        assert pair.engine.executor.runner.drafter is not None
        assert [c.token_ids for c in pair.generate(prompts, params)] == expected
        stats = pair.engine.scheduler.spec_stats
        assert stats is not None and stats.num_accepted_tokens > 0
