"""Grammar masks and logprobs on the GPU: the FlashInfer sampler under a mask agrees with the CPU
sampler on the same logits, and an engine batch mixing grammar rows, logprob rows and plain rows
runs under CUDA graphs with valid JSON and logprobs of the logits it sampled from."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from test_engine_gpu import RecordingSampler

from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.logprobs import compute_logprobs
from flashserve.sample.sampler import Sampler
from flashserve.structured.grammar import TokenBitmask, bitmask_words
from flashserve.worker.input_batch import InputBatch

VOCAB = 128_256
TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", ".whl", "llama3-tokenizer")
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tag": {"type": "string", "maxLength": 8}},
    "required": ["colour", "n", "tag"], "additionalProperties": False,
}


def random_mask(rows: list[int], rng: random.Random) -> tuple[TokenBitmask, list[set[int]]]:
    bitmask = np.zeros((len(rows), bitmask_words(VOCAB)), dtype=np.int32)
    allowed = []
    for j in range(len(rows)):
        tokens = set(rng.sample(range(VOCAB), rng.choice([1, 5, 300, 20_000])))
        for t in tokens:
            bitmask[j, t // 32] |= np.uint32(1 << (t % 32)).view(np.int32)
        allowed.append(tokens)
    return TokenBitmask(rows, bitmask), allowed


def test_masked_sampling_on_the_gpu_agrees_with_the_cpu_sampler() -> None:
    from flashserve.sample.flashinfer import FlashInferSampler

    rng = random.Random(0)
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB, device="cuda") * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)), SamplingParams(temperature=0.7, top_k=50)] * 2
    reqs = InputBatch().update(SchedulerOutput([ScheduledRequest(f"r{i}", [1], 0, [1], True, p)
                                                for i, p in enumerate(params)]))
    mask, allowed = random_mask([0, 1, 2, 3, 4, 6], rng)
    gpu = FlashInferSampler(0).sample_ids(logits, reqs, mask).tolist()
    cpu = Sampler(0).sample_ids(logits.cpu(), reqs, mask).tolist()
    for j, row in enumerate(mask.rows):
        assert gpu[row] in allowed[j]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert [gpu[i] for i in greedy] == [cpu[i] for i in greedy]


def test_logprobs_on_the_gpu_equal_the_cpu_ones() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    ids = torch.tensor([0, 7, 128_000, 55], device="cuda")
    gpu = compute_logprobs(logits, ids, 5)
    cpu = compute_logprobs(logits.cpu(), ids.cpu(), 5)
    torch.testing.assert_close(gpu.chosen.cpu(), cpu.chosen, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gpu.top_logprobs.cpu(), cpu.top_logprobs, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("llama-3.2-1b", load_format="dummy", tokenizer=TOKENIZER, num_pages=512, max_num_seqs=32)


def test_a_batch_of_grammar_logprob_and_plain_rows_under_cuda_graphs(llm: LLM) -> None:
    from flashserve.message.grammar_spec import GrammarSpec
    from flashserve.structured.compiler import GrammarCompiler

    runner = llm.engine.executor
    assert runner.graphs is not None, "decode steps should run from CUDA graphs"
    loaded = llm.stack.loaded
    compiler = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    grammar = compiler.compile_sync(GrammarSpec("json", json.dumps(SCHEMA), "response_format"))
    rng = random.Random(2)
    eos = tuple(loaded.eos_token_ids)
    engine = llm.engine
    for i in range(24):
        prompt = [rng.randrange(1, 128_000) for _ in range(rng.randint(5, 60))]
        kind = i % 3
        if kind == 0:
            params = SamplingParams(max_tokens=64, temperature=0.0, grammar=grammar, eos_token_ids=eos)
        elif kind == 1:
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
        else:
            params = SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    recorder = RecordingSampler(runner.sampler)
    runner.sampler = recorder
    outputs: dict[str, list] = {}
    try:
        while engine.has_unfinished:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
    finally:
        runner.sampler = recorder.inner
    for i in range(24):
        outs = outputs[f"r{i}"]
        tokens = [t for o in outs for t in o.new_token_ids]
        if i % 3 == 0:
            assert outs[-1].finish_reason == "stop", outs[-1]
            value = json.loads("".join(o.new_text for o in outs))
            assert set(value) == {"colour", "n", "tag"} and value["colour"] in ("red", "green", "blue")
            continue
        assert len(tokens) == 24
        if i % 3 == 1:
            logprobs = [lp for o in outs for lp in (o.logprobs or [])]
            assert [lp.token_id for lp in logprobs] == tokens
            for k, lp in enumerate(logprobs):
                expected = torch.log_softmax(recorder.rows[(f"r{i}", k)].double(), dim=-1)
                assert abs(lp.logprob - float(expected[lp.token_id])) < 1e-3
                # The top 3 by value (near-ties may swap between float32 on the GPU and float64 here).
                third = float(expected.topk(3).values[-1])
                assert all(abs(v - float(expected[t])) < 1e-3 and v >= third - 1e-3 for t, v in lp.top)
    assert engine.scheduler.kv_cache.num_used_pages == 0
