"""The whole engine on the GPU: dummy Llama-3.2-1B weights, FlashInfer, native model, CUDA graphs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from flashserve.attention.base import BatchLayout
from flashserve.engine.outputs import ScheduledRequest
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams
from flashserve.models.hf import HFCausalLM
from flashserve.models.native import NativeCausalLM


class RecordingSampler:
    """Keeps the logits row each request was sampled from, keyed by (request id, output position):
    a row whose last token is in flight samples the output after that token."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rows: dict[tuple[str, int], torch.Tensor] = {}

    def sample_ids(self, logits, requests, bitmask=None):
        for row, r in zip(logits, requests):
            self.rows[(r.request_id, len(r.output_token_ids) + r.last_token_in_flight)] = row.float().cpu()
        return self.inner.sample_ids(logits, requests, bitmask)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 160 pages of 16 tokens for 64 requests of up to ~360 tokens: preemption is certain.
    return LLM("llama-3.2-1b", load_format="dummy", num_pages=160, max_num_seqs=64, max_num_batched_tokens=1024)


def teacher_forced_logits(llm: LLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logits at every generated position from ONE prefill of prompt + output[:-1] on fresh pages."""
    runner = llm.engine.executor
    tokens = prompt + output[:-1]
    bm = llm.engine.scheduler.kv_cache
    assert bm.allocate("rescore", len(tokens))
    try:
        req = ScheduledRequest("rescore", tokens, 0, list(bm.pages("rescore")), True, SamplingParams())
        layout = BatchLayout.build([req], runner.page_size)
        runner.backend.plan(layout)
        dev = runner.device
        rows = torch.arange(len(prompt) - 1, len(tokens), device=dev)
        with torch.inference_mode():
            return runner.model.forward(torch.tensor(tokens, device=dev), torch.tensor(layout.positions, device=dev),
                                        runner.backend, rows).float().cpu()
    finally:
        bm.free("rescore")


def teacher_forced_errors(llm: LLM, recorder: RecordingSampler, results: list) -> list[float]:
    """Per result: the largest relative error of the logits its tokens were sampled from against a
    teacher-forced re-scoring (bf16)."""
    errors = []
    for res in results:
        got = torch.stack([recorder.rows[(res.request_id, k)] for k in range(len(res.token_ids))])
        ref = teacher_forced_logits(llm, res.prompt_token_ids, res.token_ids)
        err = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        print(f"ERR {res.request_id}: max relative error {err:.3e} over {len(res.token_ids)} tokens")
        errors.append(err)
    return errors


def assert_sampled_from_teacher_forced_logits(llm: LLM, recorder: RecordingSampler, results: list) -> None:
    """The logits each result's tokens were sampled from match a teacher-forced re-scoring (bf16)."""
    for res, err in zip(results, teacher_forced_errors(llm, recorder, results)):
        assert err < 3e-2, f"{res.request_id}: max relative error {err:.3e}"


def test_64_requests_under_preemption_finish_and_recompute_corrupts_nothing(llm):
    rng = random.Random(0)
    runner = llm.engine.executor
    recorder = RecordingSampler(runner.sampler)
    runner.sampler = recorder
    try:
        prompts = [[rng.randrange(1, 128000) for _ in range(rng.randint(8, 300))] for _ in range(64)]
        params = [SamplingParams(max_tokens=rng.randint(8, 48), temperature=0.0, ignore_eos=True) for _ in prompts]
        results = llm.generate(prompts, params)
    finally:
        runner.sampler = recorder.inner
    assert llm.engine.scheduler.num_preemptions > 0
    assert [len(r.token_ids) for r in results] == [p.max_tokens for p in params]
    assert all(r.finish_reason == "length" for r in results)
    assert llm.engine.scheduler.kv_cache.num_used_pages == 0
    assert_sampled_from_teacher_forced_logits(llm, recorder, results[::8])  # re-scoring: one prefill each


@pytest.mark.parametrize("variant", ["torch_compile", "hf_path"])
def test_engine_variant_samples_the_logits_a_teacher_forced_pass_gives(variant: str):
    # Start-up warms up (compiling, for torch_compile) and captures decode graphs for batch sizes
    # 1..16 of the compiled native model or of the generic HF path; decode steps replay them, the
    # re-scoring prefill runs eagerly. (test_native_gpu.py measures both against HF in float32.)
    kwargs = {"torch_compile": True} if variant == "torch_compile" else {"model_impl": "hf"}
    llm = LLM("llama-3.2-1b", load_format="dummy", num_pages=160, max_num_seqs=16, max_num_batched_tokens=1024, **kwargs)
    runner = llm.engine.executor
    assert runner.graphs is not None
    assert isinstance(runner.model, NativeCausalLM if variant == "torch_compile" else HFCausalLM)
    recorder = RecordingSampler(runner.sampler)
    runner.sampler = recorder
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 128000) for _ in range(rng.randint(8, 200))] for _ in range(16)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert all(len(r.token_ids) == 24 for r in results)
    assert llm.engine.scheduler.kv_cache.num_used_pages == 0
    assert_sampled_from_teacher_forced_logits(llm, recorder, results[::4])


def test_requests_that_hit_the_prefix_cache_sample_the_teacher_forced_logits(llm):
    rng = random.Random(2)
    shared = [rng.randrange(1, 128000) for _ in range(200)]
    llm.generate([shared], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # registers its pages
    prompts = [shared[: rng.randint(40, 200)] + [rng.randrange(1, 128000) for _ in range(rng.randint(1, 40))]
               for _ in range(24)]
    runner = llm.engine.executor
    recorder = RecordingSampler(runner.sampler)
    runner.sampler = recorder
    try:
        results = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    finally:
        runner.sampler = recorder.inner
    assert all(r.num_cached_tokens >= 32 for r in results)
    assert llm.engine.scheduler.kv_cache.num_used_pages == 0
    assert_sampled_from_teacher_forced_logits(llm, recorder, results[::3])


def test_a_mixed_load_with_aborts_and_preemption_leaves_every_page_free_or_cached(llm):
    rng = random.Random(3)
    engine = llm.engine
    shared = [rng.randrange(1, 128000) for _ in range(96)]
    preemptions = engine.scheduler.num_preemptions
    for i in range(48):
        prompt = shared[: rng.randint(0, 96)] + [rng.randrange(1, 128000) for _ in range(rng.randint(8, 250))]
        engine.add_request(f"mixed-{i}", prompt, SamplingParams(max_tokens=rng.randint(8, 64), ignore_eos=True))
    for step in range(10_000):
        if not engine.has_unfinished:
            break
        engine.step()
        if step in (3, 10, 25):
            for i in rng.sample(range(48), 5):
                engine.abort(f"mixed-{i}")
    kv = engine.scheduler.kv_cache
    assert not engine.has_unfinished and engine.scheduler.num_preemptions > preemptions
    assert kv.num_used_pages == 0 and kv.num_free_pages == kv.capacity and kv.num_cached_pages > 0


def test_a_prompt_chunked_beside_a_stream_samples_the_teacher_forced_logits():
    """With --chunked-prefill-size 1024, a 2,500-token prompt that arrives while a stream decodes
    runs in chunks; its second chunk continues over the first's pages and attends apart (its own
    tokens in the ragged pass, the first chunk's in a second pass, merged). Its tokens and the
    stream's are sampled from the logits a teacher-forced prefill gives."""
    llm = LLM("llama-3.2-1b", load_format="dummy", num_pages=400, max_num_seqs=8, max_num_batched_tokens=4096,
              chunked_prefill_size=1024, enable_prefix_caching=False)  # fmt: skip
    engine, runner = llm.engine, llm.engine.executor
    recorder = RecordingSampler(runner.sampler)
    runner.sampler = recorder
    continued = []
    plan = runner.backend.plan

    def recording_plan(layout):
        plan(layout)
        continued.append(runner.backend._step is not None and runner.backend._step.continued is not None)

    runner.backend.plan = recording_plan
    rng = random.Random(6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {"stream": [rng.randrange(1, 128000) for _ in range(40)],
               "long": [rng.randrange(1, 128000) for _ in range(2500)]}  # fmt: skip
    tokens: dict[str, list[int]] = {"stream": [], "long": []}
    engine.add_request("stream", prompts["stream"], params)
    for out in engine.step():  # the stream's prompt; from here it decodes
        tokens[out.request_id] += out.new_token_ids
    engine.add_request("long", prompts["long"], params)
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    runner.sampler = recorder.inner
    runner.backend.plan = plan
    assert any(continued), "no step attended a continued prompt apart"
    assert [len(tokens[rid]) for rid in prompts] == [12, 12]
    done = [SimpleNamespace(request_id=rid, prompt_token_ids=prompts[rid], token_ids=tokens[rid]) for rid in prompts]
    assert_sampled_from_teacher_forced_logits(llm, recorder, done)


def test_a_decode_step_s_device_time_is_measured_for_late_launches_within_its_wall_time(llm):
    import time

    assert llm.engine.start_late_launches()  # what --late-launch does at start
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]] * 4, params)  # warm: graphs, the first steps' times
    start = time.perf_counter()
    llm.generate([[5, 6, 7, 8]] * 4, params)
    wall_per_step = (time.perf_counter() - start) / 64
    late = llm.engine.late
    assert late is not None and late.decode_s is not None
    # Steps run back to back under overlap scheduling: a step's device time is at most the wall time
    # a step takes (the prefill's share included), and more than nothing.
    assert 0 < late.decode_s <= wall_per_step, (late.decode_s, wall_per_step)
