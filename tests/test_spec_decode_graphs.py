"""CUDA graphs of verify steps, the parts that need no GPU: which steps a verify graph takes, how a
step is padded to a captured batch size, which sizes are captured, and the runner replaying them.
The graphs themselves are checked against eager verify steps in tests/gpu/test_spec_decode_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashserve.attention.base import BatchLayout
from flashserve.attention.cascade import CascadePolicy
from flashserve.attention.flashinfer_verify import CudaGraphVerify, padded_verify_arrays
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.message.sampling_params import SamplingParams
from flashserve.worker.input_batch import InputBatch
from flashserve.worker.runner import ModelRunner
from flashserve.worker.verify_graph import is_uniform_verify_step, verify_capture_sizes

PAGE = 16
K = 4
SCRATCH = 0
PARAMS = SamplingParams(temperature=0.0)


def verify_row(rid: str, computed: int, pages: list[int], drafts: int = K, sample: bool = True) -> ScheduledRequest:
    """A decoding request's row: its last token and `drafts` draft tokens after `computed` tokens."""
    return ScheduledRequest(rid, [7] * (1 + drafts), computed, pages, sample, PARAMS, [1] * computed, [],
                            num_draft_tokens=drafts)


def rows_of(*scheduled: ScheduledRequest) -> list:
    return InputBatch().update(SchedulerOutput(list(scheduled)))


def test_a_step_of_decoding_rows_with_k_drafts_each_is_a_uniform_verify_step():
    assert is_uniform_verify_step(rows_of(verify_row("a", 20, [1, 2]), verify_row("b", 3, [3])), K)


def test_a_row_with_fewer_drafts_than_k_makes_the_step_eager():
    assert not is_uniform_verify_step(rows_of(verify_row("a", 20, [1, 2]), verify_row("b", 3, [3], drafts=2)), K)


def test_a_plain_decode_row_makes_the_step_eager():
    assert not is_uniform_verify_step(rows_of(verify_row("a", 20, [1, 2]), verify_row("b", 3, [3], drafts=0)), K)


def test_a_prefill_chunk_makes_the_step_eager():
    chunk = ScheduledRequest("p", [5] * (K + 1), 0, [4], False, PARAMS, [5] * 30, [])
    assert not is_uniform_verify_step(rows_of(verify_row("a", 20, [1, 2]), chunk), K)


def test_prompt_logprobs_make_the_step_eager():
    assert not is_uniform_verify_step(rows_of(verify_row("a", 20, [1, 2])), K, prompt_rows=[0])


def test_padding_requests_hold_k_plus_1_tokens_at_positions_0_to_k_on_the_scratch_page():
    layout = BatchLayout.build([verify_row("a", 20, [1, 2]), verify_row("b", 3, [3]), verify_row("c", 12, [4, 5])],
                               PAGE)
    a = padded_verify_arrays(layout, 4, K + 1, SCRATCH)
    assert a.qo_indptr.tolist() == [0, 5, 10, 15, 20]
    assert a.kv_indptr.tolist() == [0, 2, 3, 5, 6]
    assert a.kv_indices.tolist() == [1, 2, 3, 4, 5, SCRATCH]
    assert a.kv_last_page_len.tolist() == [9, 8, 1, 5]  # kv lengths 25, 8, 17, then 5 on the scratch page
    assert a.positions.tolist() == [*range(20, 25), *range(3, 8), *range(12, 17), *range(5)]
    assert all(arr.dtype == np.int32 for arr in (a.qo_indptr, a.kv_indptr, a.kv_last_page_len, a.kv_indices,
                                                  a.positions))


def test_a_padding_request_takes_two_scratch_entries_when_k_plus_1_overflows_a_page():
    layout = BatchLayout.build([verify_row("a", 3, [1, 2], drafts=16)], PAGE)
    a = padded_verify_arrays(layout, 2, 17, SCRATCH)
    assert a.kv_indptr.tolist() == [0, 2, 4]
    assert a.kv_indices.tolist() == [1, 2, SCRATCH, SCRATCH]
    assert a.kv_last_page_len.tolist() == [4, 1]  # 20 tokens; 17 = one full page and 1
    assert a.positions[17:].tolist() == list(range(17))


def test_the_capture_step_is_all_padding():
    a = padded_verify_arrays(BatchLayout(PAGE, [0], [0], [], [], []), 2, K + 1, SCRATCH)
    assert a.qo_indptr.tolist() == [0, 5, 10] and a.kv_indices.tolist() == [SCRATCH, SCRATCH]


def test_a_verify_step_with_a_cascade_prefix_level_is_not_padded_for_a_graph():
    shared = [1, 2]
    rows = [verify_row(r, 40, shared + [3 + i]) for i, r in enumerate("abcdefgh")]
    layout = BatchLayout.build(rows, PAGE, CascadePolicy(min_group=2, min_pages=1, min_saved_tokens=0))
    assert layout.prefix is not None
    with pytest.raises(ValueError, match="prefix level"):
        padded_verify_arrays(layout, 8, K + 1, SCRATCH)


class VerifySizes(CudaGraphVerify):
    """The verify-graph choice of the FlashInfer backend over stand-in buffers (graphs of 1, 2 and 4)."""

    def __init__(self, capacity: int) -> None:
        self.page_size, self.scratch_page = PAGE, SCRATCH
        self._verify = SimpleNamespace(wrappers={1: None, 2: None, 4: None}, num_query_tokens=K + 1,  # type: ignore[assignment]
                                       capacity=capacity)


def test_a_verify_step_pads_to_the_smallest_captured_batch_size_that_holds_it():
    layout = BatchLayout.build([verify_row(r, 20, [1, 2]) for r in "abc"], PAGE)
    assert VerifySizes(capacity=100).verify_graph_batch_size(layout) == 4


def test_a_verify_step_above_the_largest_graph_runs_eagerly():
    layout = BatchLayout.build([verify_row(r, 20, [1, 2]) for r in "abcde"], PAGE)
    assert VerifySizes(capacity=100).verify_graph_batch_size(layout) is None


def test_a_verify_step_whose_pages_overflow_the_graph_index_buffer_runs_eagerly():
    layout = BatchLayout.build([verify_row(r, 20, [1, 2]) for r in "abc"], PAGE)  # 6 pages + 1 padding
    assert VerifySizes(capacity=6).verify_graph_batch_size(layout) is None


def test_a_verify_step_of_another_k_runs_eagerly():
    layout = BatchLayout.build([verify_row(r, 20, [1, 2], drafts=2) for r in "ab"], PAGE)
    assert VerifySizes(capacity=100).verify_graph_batch_size(layout) is None


def test_verify_graphs_are_captured_up_to_disable_by_batch_size():
    assert verify_capture_sizes(256, 4, 12) == [1, 2, 4, 8, 12]


def test_verify_graphs_are_captured_up_to_64_requests_when_speculation_is_never_disabled():
    assert verify_capture_sizes(256, 4, None)[-1] == 64


def test_verify_graphs_never_exceed_the_schedulers_batch():
    assert verify_capture_sizes(6, 4, None) == [1, 2, 4, 6]


def test_verify_graphs_hold_at_most_512_tokens():
    assert verify_capture_sizes(256, 16, 200)[-1] == 30  # 30 x 17 tokens


class EagerModel:
    """Logits [rows, vocab] of zeros: what the eager path computes, as far as the runner cares."""

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, ids, positions, backend, logits_indices):  # noqa: ANN001
        self.calls += 1
        return torch.zeros(len(logits_indices) if logits_indices is not None else len(ids), 11)


class FakeVerifyGraphs:
    """Stands in for `VerifyGraphRunner`: logits of ones for the steps it takes (`takes`)."""

    num_draft_tokens = K

    def __init__(self, takes: bool) -> None:
        self.takes, self.steps = takes, []

    def __call__(self, ids, positions, layout):  # noqa: ANN001
        self.steps.append(layout.batch_size)
        return torch.ones(len(ids), 11) if self.takes else None


def runner_with(graphs: FakeVerifyGraphs) -> tuple[ModelRunner, EagerModel]:
    model = EagerModel()
    runner = ModelRunner(model, torch.device("cpu"), SimpleNamespace(plan=lambda layout: None), None, PAGE)  # type: ignore[arg-type]
    runner.verify_graphs, runner.speculative = graphs, True
    return runner, model


def test_the_runner_replays_a_uniform_verify_step_from_its_graph():
    runner, model = runner_with(FakeVerifyGraphs(takes=True))
    logits = runner.forward(SchedulerOutput([verify_row("a", 20, [1, 2]), verify_row("b", 3, [3])]))
    assert logits.shape == (2 * (K + 1), 11) and bool((logits == 1).all()) and model.calls == 0


def test_the_runner_runs_a_verify_step_eagerly_when_no_graph_takes_it():
    graphs = FakeVerifyGraphs(takes=False)
    runner, model = runner_with(graphs)
    logits = runner.forward(SchedulerOutput([verify_row("a", 20, [1, 2])]))
    assert graphs.steps == [1] and model.calls == 1 and bool((logits == 0).all())


def test_the_runner_runs_a_mixed_step_eagerly_without_asking_the_verify_graphs():
    graphs = FakeVerifyGraphs(takes=True)
    runner, model = runner_with(graphs)
    runner.forward(SchedulerOutput([verify_row("a", 20, [1, 2]), verify_row("b", 3, [3], drafts=1)]))
    assert graphs.steps == [] and model.calls == 1
