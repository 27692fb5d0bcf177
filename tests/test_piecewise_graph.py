"""What piecewise CUDA graphs (`worker/piecewise_graph.py`) rely on, on a CPU: the native model's
pieces between attention calls, run over a step padded to a captured token count with attention
written into a fixed buffer for the real rows only, give the eager step's logits; the aliases kept
of the pieces' outputs read their memory without keeping it; the captured token counts. The
graphs themselves are captured and replayed by the GPU suite (tests/gpu/test_native_gpu.py and
test_fp8_gpu.py, "piecewise")."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_native_llama import CONFIGS, NUM_PAGES, PAGE, hf_model

from flashserve.attention.base import BatchLayout
from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.engine.outputs import ScheduledRequest
from flashserve.message.sampling_params import SamplingParams
from flashserve.models.llama import LlamaModel
from flashserve.models.native import NativeCausalLM
from flashserve.worker.piecewise_graph import capture_token_counts, weak_alias

PADDED = 48  # the captured count every step below is padded to


def padded_pieces_logits(model: NativeCausalLM, backend: TorchAttentionBackend, ids: torch.Tensor,
                         pos: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """As `PiecewiseGraphRunner` replays a step: ids/positions padded with an earlier step's values,
    each layer's attention for the real rows written into `stale` (whose padding rows hold what they
    held), the pieces' rows of the step read at the end."""
    t = ids.shape[0]
    pieces = model.layer_pieces(backend)
    pad_ids = torch.cat([ids, torch.arange(PADDED - t) % 7])
    pad_pos = torch.cat([pos, torch.arange(PADDED - t) % 5])
    attention = pieces.attention(pad_pos[:t], stale[:t])
    steps = pieces.steps(pad_ids, pad_pos)
    item = next(steps)
    while True:
        i, q, k, v = item
        attention(i, q[:t], k[:t], v[:t])
        try:
            item = steps.send(stale[:PADDED])
        except StopIteration as done:
            return pieces.logits(done.value[:t], None)


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen3_qk_norm"])
@torch.inference_mode()
def test_pieces_over_padded_rows_with_attention_in_a_fixed_buffer_give_the_eager_steps_logits(name: str) -> None:
    config = CONFIGS[name]
    native = NativeCausalLM(LlamaModel.from_hf(hf_model(config), config, torch.float32, "cpu"))
    spec = native.model.spec
    backends = [TorchAttentionBackend(spec.num_layers, NUM_PAGES, PAGE, spec.num_kv_heads, spec.head_dim,
                                      torch.float32, "cpu") for _ in range(2)]  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (30, 12)]
    pages = [[1, 2], [3]]
    # A prompt, then a chunk after its cached prefix beside a second prompt, then decode rows.
    schedule = [[(0, 20)], [(20, 29), (0, 11)], [(29, 30), (11, 12)]]
    stale = torch.full((PADDED, spec.num_heads, spec.head_dim), 1e4)  # what earlier steps left
    for step in schedule:
        reqs = [ScheduledRequest(str(i), seqs[i][a:b], a, pages[i], True, SamplingParams()) for i, (a, b) in enumerate(step)]
        layout = BatchLayout.build(reqs, PAGE)
        ids = torch.tensor([t for r in reqs for t in r.new_token_ids])
        pos = torch.tensor(layout.positions)
        for backend in backends:
            backend.plan(layout)
        eager = native.forward(ids, pos, backends[0], None)
        pieces = padded_pieces_logits(native, backends[1], ids, pos, stale)
        torch.testing.assert_close(pieces, eager, rtol=1e-5, atol=1e-5)


def test_a_weak_alias_reads_the_tensors_memory_and_lets_it_be_freed() -> None:
    base = torch.zeros(4, 6, dtype=torch.bfloat16)
    view = base[:, 1:4]
    alias = weak_alias(view)
    assert (alias.shape, alias.stride(), alias.dtype) == (view.shape, view.stride(), view.dtype)
    base.fill_(3)
    assert torch.equal(alias, view)
    gone = weakref.ref(base)
    del base, view
    gc.collect()
    assert gone() is None


def test_captured_token_counts_step_by_at_most_a_third_beyond_128_and_end_at_the_maximum() -> None:
    assert capture_token_counts(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert capture_token_counts(100) == [16, 32, 64, 96, 100]
    assert capture_token_counts(8) == [8]
    assert capture_token_counts(1024)[-3:] == [768, 896, 1024]


def test_graphs_are_captured_with_dead_cycles_collected_first_and_the_collector_off() -> None:
    """`collector_paused`, around every capture: dead reference cycles are freed before the first
    capture begins, none while captures run (the collector is off: a CUDA graph it frees would reset
    itself inside the capture), and the collector is back on after, as it was."""
    from flashserve.worker.cuda_graph import collector_paused

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    before = Cycle()
    freed = weakref.ref(before)
    del before
    assert gc.isenabled() and freed() is not None  # dead, not freed yet (no collection ran)
    with collector_paused():
        assert freed() is None
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()
