"""The runner's persistent batch under CUDA graphs: requests join while others decode from graphs,
leave (finished at different lengths, aborted, preempted), and every token is still sampled from
the logits a teacher-forced pass over its request gives."""

from __future__ import annotations

import random
import time

import pytest
import torch
from test_engine_gpu import RecordingSampler, assert_sampled_from_teacher_forced_logits

from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 64 pages of 16 tokens for up to 24 requests of up to ~260 tokens: preemption happens.
    return LLM("llama-3.2-1b", load_format="dummy", num_pages=64, max_num_seqs=24, max_num_batched_tokens=512)


def test_requests_joining_and_leaving_graph_decode_steps_sample_the_teacher_forced_logits(llm: LLM) -> None:
    engine, runner = llm.engine, llm.engine.executor
    assert runner.graphs is not None and engine.overlap
    replays = 0
    plan_graph = runner.backend.plan_cuda_graph

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003
        nonlocal replays
        replays += 1
        return plan_graph(*args, **kwargs)

    runner.backend.plan_cuda_graph = counting
    recorder = RecordingSampler(runner.sampler)
    runner.sampler = recorder
    rng = random.Random(4)
    prompts: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    try:
        for step in range(400):
            if step % 3 == 0 and len(prompts) < 40:  # a request joins the running batch
                rid = f"join-{len(prompts)}"
                prompts[rid] = [rng.randrange(1, 128000) for _ in range(rng.randint(4, 200))]
                tokens[rid] = []
                engine.add_request(rid, prompts[rid], SamplingParams(max_tokens=rng.randint(4, 60), temperature=0.0,
                                                                     ignore_eos=True))
            if step % 17 == 5:  # one leaves early
                live = [rid for rid in prompts if rid not in finished]
                if live and (out := engine.abort(rng.choice(live))) is not None:
                    finished[out.request_id] = "abort"
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    finished.setdefault(out.request_id, out.finish_reason)
            if len(prompts) == 40 and not engine.has_unfinished:
                break
    finally:
        runner.sampler = recorder.inner
        runner.backend.plan_cuda_graph = plan_graph
    assert not engine.has_unfinished and replays > 50
    assert engine.scheduler.num_preemptions > 0
    done = [rid for rid, reason in finished.items() if reason == "length"]
    assert len(done) >= 25

    class Result:
        def __init__(self, rid: str) -> None:
            self.request_id, self.prompt_token_ids, self.token_ids = rid, prompts[rid], tokens[rid]

    assert_sampled_from_teacher_forced_logits(llm, recorder, [Result(rid) for rid in done[::3]])


def test_launching_a_decode_step_behind_a_busy_device_does_not_wait_for_it(llm: LLM) -> None:
    """Scheduling ahead only helps if the host can launch step N+1 while step N still runs: no
    upload of the step may wait for the device (a copy from pageable memory would)."""
    runner, kv = llm.engine.executor, llm.engine.scheduler.kv_cache
    assert kv.allocate("probe", 9)  # free pages, held for the probe while the engine is idle
    try:
        prompt = list(range(1, 9))
        first = runner.launch(SchedulerOutput([ScheduledRequest(
            "probe", prompt, 0, list(kv.pages("probe")), True, SamplingParams(temperature=0.0), prompt)]))
        torch.cuda._sleep(2_000_000_000)  # about a second of device time ahead of the decode step
        t0 = time.perf_counter()
        second = runner.launch(SchedulerOutput([ScheduledRequest("probe", [0], 8, (), True,
                                                                 last_token_in_flight=True)]), first)
        host_s = time.perf_counter() - t0
        assert second.ready is not None and not second.ready.query()  # still queued behind the sleep
        runner.collect(first)
        (result,) = runner.collect(second)
        assert len(result.token_ids) == 1
        assert host_s < 0.2, f"launching the decode step took {host_s:.3f} s: it waited for the device"
    finally:
        kv.free("probe")
        runner.batch.rows.pop("probe", None)
