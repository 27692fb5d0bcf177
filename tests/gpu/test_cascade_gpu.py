"""Cascade attention on FlashInfer: groups' shared prefixes attended once and merged, against flat
attention over the same pages; and the engine with cascade on (its decode steps from cascade CUDA
graphs) samples logits as close to a teacher-forced flat pass as the engine with flat attention
does. Cascade decode from graphs against eager and flat attention: test_cuda_graph.py."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from test_engine_gpu import RecordingSampler, teacher_forced_errors
from test_flashinfer_backend import KV_HEADS, NUM_LAYERS, PAGE, TOL, make_backends, rel_err

from flashserve.attention.base import BatchLayout
from flashserve.attention.cascade import CascadePolicy
from flashserve.engine.outputs import ScheduledRequest
from flashserve.entrypoints.llm import LLM
from flashserve.message.sampling_params import SamplingParams

SHARED_A = [3, 7, 11, 15]  # 64 tokens, read by three requests
SHARED_B = [20, 21]  # 32 tokens, read by two


def scheduled(new: list[int]) -> list[ScheduledRequest]:
    """Six requests: a group of three behind SHARED_A, a lone one, a group of two behind SHARED_B.
    Each has its own pages after the shared ones; `new[i]` tokens are new this step."""
    own = iter(range(30, 95))
    specs = [(SHARED_A, 70), (SHARED_A, 80), (SHARED_A, 66), ([], 40), (SHARED_B, 33), (SHARED_B, 47)]
    out = []
    for i, ((shared, computed), n) in enumerate(zip(specs, new)):
        total_pages = -(-(computed + n) // PAGE)
        pages = shared + [next(own) for _ in range(total_pages - len(shared))]
        out.append(ScheduledRequest(str(i), [1] * n, computed, pages, True, SamplingParams()))
    return out


@pytest.mark.parametrize("new", [[1] * 6, [5, 1, 9, 12, 1, 3]], ids=["decode", "mixed"])
@pytest.mark.parametrize("q_heads", [8, 32])
def test_cascade_step_matches_flat_attention(new: list[int], q_heads: int) -> None:
    fi, ref = make_backends(q_heads, 128, torch.bfloat16)
    requests = scheduled(new)
    cascade = BatchLayout.build(requests, PAGE, CascadePolicy())
    assert cascade.prefix is not None and cascade.prefix.num_groups == 2
    fi.plan(cascade)
    ref.plan(BatchLayout.build(requests, PAGE))
    gen = torch.Generator("cuda").manual_seed(len(new) + q_heads)
    for layer in range(NUM_LAYERS):
        q, k, v = (torch.randn(cascade.num_tokens, h, 128, generator=gen, device="cuda").bfloat16()
                   for h in (q_heads, KV_HEADS, KV_HEADS))
        out, expected = fi.forward(layer, q, k, v), ref.forward(layer, q, k, v)
        assert rel_err(out, expected) < TOL[torch.bfloat16]


def test_a_cascade_decode_step_pads_to_a_graph_only_where_cascade_graphs_were_built() -> None:
    requests = scheduled([1] * 6)
    flat, cascade = BatchLayout.build(requests, PAGE), BatchLayout.build(requests, PAGE, CascadePolicy())
    without, _ = make_backends(8, 128, torch.bfloat16)
    without.init_cuda_graph([8, 16])
    assert without.cuda_graph_batch_size(flat) == 8
    assert without.cuda_graph_batch_size(cascade) is None
    with_cascade, _ = make_backends(8, 128, torch.bfloat16)
    with_cascade.init_cuda_graph([8, 16], cascade=True)
    assert with_cascade.cuda_graph_batch_size(flat) == 8
    assert with_cascade.cuda_graph_batch_size(cascade) == 8


def test_engine_with_cascade_samples_logits_as_close_to_a_teacher_forced_pass_as_flat_attention() -> None:
    """The same prompts with cascade off (flat) and on, each result's logits against a
    teacher-forced flat re-scoring. The flat engine's own distance to that pass on these prompts is
    the bf16 noise here (it reaches 3.04e-2 on the H100), so cascade is held to it: the prefix
    level and the merge round in another order, which may cost a little, never more than 15%."""
    llm = LLM("llama-3.2-1b", load_format="dummy", num_pages=400, max_num_seqs=32, cascade_attention="on")
    rng = random.Random(5)
    shared = [rng.randrange(1, 128000) for _ in range(200)]
    llm.generate([shared], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # caches its pages
    prompts = [shared + [rng.randrange(1, 128000) for _ in range(rng.randint(1, 30))] for _ in range(16)]
    runner = llm.engine.executor
    backend = runner.backend
    plan, plan_graph, cascade_steps = backend.plan, backend.plan_cuda_graph, []

    def recording_plan(layout: BatchLayout) -> None:
        cascade_steps.append((layout.prefix is not None, False))
        plan(layout)

    def recording_plan_graph(layout: BatchLayout, batch_size: int, cascade: bool | None = None) -> None:
        cascade_steps.append((layout.prefix is not None, True))
        plan_graph(layout, batch_size, cascade)

    errors = {}
    for name, policy in (("flat", None), ("cascade", CascadePolicy())):
        runner.cascade, cascade_steps[:] = policy, []
        backend.plan, backend.plan_cuda_graph = recording_plan, recording_plan_graph
        recorder = RecordingSampler(runner.sampler)
        runner.sampler = recorder
        try:
            results = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        finally:
            runner.sampler, backend.plan, backend.plan_cuda_graph = recorder.inner, plan, plan_graph
        if policy is None:
            assert not any(prefix for prefix, _ in cascade_steps)
        else:
            # Every decode step of the group went through the prefix level, from a cascade graph.
            assert sum(prefix and graph for prefix, graph in cascade_steps) >= 15
        errors[name] = teacher_forced_errors(llm, recorder, results)
    assert llm.engine.scheduler.kv_cache.num_used_pages == 0
    flat, cascade = errors["flat"], errors["cascade"]
    print(f"flat: max {max(flat):.3e}, mean {statistics.mean(flat):.3e}; "
          f"cascade: max {max(cascade):.3e}, mean {statistics.mean(cascade):.3e}")
    assert max(cascade) <= 1.15 * max(flat)
    assert statistics.mean(cascade) <= 1.15 * statistics.mean(flat)
