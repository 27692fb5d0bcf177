"""Graph-mode decode equals eager decode: a small attention-only model run three ways.

The same weights run through a `CudaGraphRunner` with captured graphs, through one that never
captured (eager FlashInfer), and eagerly on the PyTorch reference backend, over a prefill step
and decode steps of several batch sizes (padded ones, exact ones, one above the largest graph).
"""

from __future__ import annotations

import gc

import pytest
import torch

from flashserve.attention.base import BatchLayout
from flashserve.attention.flashinfer import FlashInferAttentionBackend
from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.engine.outputs import ScheduledRequest
from flashserve.message.sampling_params import SamplingParams
from flashserve.worker.cuda_graph import CudaGraphRunner, capture_batch_sizes

PAGE = 16
NUM_PAGES = 128
NUM_LAYERS = 2
KV_HEADS = 2
VOCAB = 97
MAX_POS = 512
GRAPH_SIZES = [1, 2, 4, 8]


class TinyModel:
    """Embeddings plus residual attention layers: enough to route q/k/v through a backend."""

    def __init__(self, backend, q_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        gen = torch.Generator("cuda").manual_seed(0)
        hidden = q_heads * head_dim
        self.backend, self.q_heads, self.head_dim = backend, q_heads, head_dim
        self.tok = torch.randn(VOCAB, hidden, generator=gen, device="cuda").to(dtype)
        self.pos = torch.randn(MAX_POS, hidden, generator=gen, device="cuda").to(dtype)
        qkv = (q_heads + 2 * KV_HEADS) * head_dim
        self.w = [(torch.randn(hidden, qkv, generator=gen, device="cuda") / hidden**0.5).to(dtype) for _ in range(NUM_LAYERS)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tok[input_ids] + self.pos[positions]
        t, d = h.shape[0], self.head_dim
        for layer, w in enumerate(self.w):
            q, k, v = (h @ w).split([self.q_heads * d, KV_HEADS * d, KV_HEADS * d], dim=-1)
            out = self.backend.forward(layer, q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d))
            h = h + out.reshape(t, -1)
        return h.float()


def scheduled(lengths: list[int], new: list[int], pages: list[list[int]]) -> list[ScheduledRequest]:
    params = SamplingParams()
    return [
        ScheduledRequest(str(i), [(7 * i + c) % VOCAB for c in range(n)], c, p, True, params)
        for i, (c, n, p) in enumerate(zip(lengths, new, pages))
    ]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def fi_backend(q_heads: int, head_dim: int, dtype: torch.dtype, fused_decode: bool = False) -> FlashInferAttentionBackend:
    return FlashInferAttentionBackend(NUM_LAYERS, NUM_PAGES, PAGE, KV_HEADS, head_dim, dtype, "cuda", None,
                                      num_qo_heads=q_heads, fused_decode=fused_decode)


def assert_request_pages_agree(a: FlashInferAttentionBackend, b: FlashInferAttentionBackend, tol: float) -> None:
    """Every page but the scratch page 0 (where padding rows write) holds the same K/V."""
    for (ak, av), (bk, bv) in zip(a.kv_cache, b.kv_cache):
        torch.testing.assert_close(ak[1:], bk[1:], atol=tol, rtol=tol)
        torch.testing.assert_close(av[1:], bv[1:], atol=tol, rtol=tol)


@pytest.mark.parametrize("fused_decode", [False, True], ids=["flashinfer-decode", "fused-decode"])
@pytest.mark.parametrize(
    "q_heads,head_dim,dtype", [(6, 64, torch.bfloat16), (8, 128, torch.float16)], ids=["g3-d64-bf16", "g4-d128-fp16"]
)
def test_graph_decode_equals_eager_decode(q_heads: int, head_dim: int, dtype: torch.dtype, fused_decode: bool) -> None:
    """`fused_decode`: the steps of up to 4 requests through the Triton decode, eager and from graphs."""
    graph_backend = fi_backend(q_heads, head_dim, dtype, fused_decode)
    eager_backend = fi_backend(q_heads, head_dim, dtype, fused_decode)
    ref_backend = TorchAttentionBackend(NUM_LAYERS, NUM_PAGES, PAGE, KV_HEADS, head_dim, dtype, "cuda", None)
    graphed = CudaGraphRunner(TinyModel(graph_backend, q_heads, head_dim, dtype), graph_backend, GRAPH_SIZES)
    eager = CudaGraphRunner(TinyModel(eager_backend, q_heads, head_dim, dtype), eager_backend, GRAPH_SIZES)
    ref_model = TinyModel(ref_backend, q_heads, head_dim, dtype)
    with torch.inference_mode():
        graphed.capture()
    assert graphed.captured and not eager.captured

    num_reqs = 9
    perm = (torch.randperm(NUM_PAGES - 1, generator=torch.Generator().manual_seed(0)) + 1).tolist()
    pages = [perm[i * 12 : (i + 1) * 12] for i in range(num_reqs)]  # 192 tokens of room each
    lengths = [0] * num_reqs
    # A ragged prefill (eager in every runner), then decode steps: padded to 4, exactly 8,
    # padded to 8, one request, and 9 requests (above the largest graph: eager).
    steps = [
        (list(range(num_reqs)), [3, 16, 17, 1, 30, 15, 32, 5, 9]),
        ([0, 1, 2], [1] * 3),
        (list(range(8)), [1] * 8),
        ([0, 2, 3, 4, 5, 6], [1] * 6),
        ([1], [1]),
        (list(range(num_reqs)), [1] * num_reqs),
    ] + [([0, 1, 2, 3, 4], [1] * 5)] * 20  # crosses page boundaries and re-plans each replay
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    worst_graph, worst_ref = 0.0, 0.0
    with torch.inference_mode():
        for rows, new in steps:
            reqs = scheduled([lengths[i] for i in rows], new, [pages[i] for i in rows])
            layout = BatchLayout.build(reqs, PAGE)
            ids = torch.tensor([t for r in reqs for t in r.new_token_ids], device="cuda")
            pos = torch.tensor(layout.positions, device="cuda")
            out_graph = graphed(ids, pos, layout).clone()
            out_eager = eager(ids, pos, layout)
            ref_backend.plan(layout)
            out_ref = ref_model(ids, pos)
            e_graph, e_ref = rel_err(out_graph, out_eager), rel_err(out_eager, out_ref)
            assert e_graph < tol, f"graph vs eager {e_graph:.2e} at batch {len(rows)}"
            assert e_ref < tol, f"eager vs reference {e_ref:.2e} at batch {len(rows)}"
            worst_graph, worst_ref = max(worst_graph, e_graph), max(worst_ref, e_ref)
            for i, n in zip(rows, new):
                lengths[i] += n
    assert_request_pages_agree(graph_backend, eager_backend, tol)  # padding rows wrote only page 0
    print(f"ERR graph-vs-eager {worst_graph:.2e}, eager-vs-ref {worst_ref:.2e} ({q_heads}/{KV_HEADS} heads, D={head_dim}, {dtype})")


def test_cascade_decode_from_graphs_matches_eager_cascade_and_flat_attention() -> None:
    """Two groups behind shared pages and a lone request: their own tokens prefilled eagerly,
    then decode steps through cascade graphs (several groups a step, padded, crossing pages)
    against the same steps through eager cascade attention and through the reference, flat."""
    from flashserve.attention.cascade import CascadePolicy

    q_heads, head_dim, dtype = 8, 128, torch.bfloat16
    graph_backend, eager_backend = fi_backend(q_heads, head_dim, dtype), fi_backend(q_heads, head_dim, dtype)
    ref_backend = TorchAttentionBackend(NUM_LAYERS, NUM_PAGES, PAGE, KV_HEADS, head_dim, dtype, "cuda", None)
    graphed = CudaGraphRunner(TinyModel(graph_backend, q_heads, head_dim, dtype), graph_backend, GRAPH_SIZES,
                              cascade=True)
    eager = CudaGraphRunner(TinyModel(eager_backend, q_heads, head_dim, dtype), eager_backend, GRAPH_SIZES)
    ref_model = TinyModel(ref_backend, q_heads, head_dim, dtype)
    with torch.inference_mode():
        graphed.capture()
    eager_plans = []
    plan = graph_backend.plan
    graph_backend.plan = lambda layout: (eager_plans.append(layout), plan(layout))[1]

    perm = (torch.randperm(NUM_PAGES - 1, generator=torch.Generator().manual_seed(1)) + 1).tolist()
    shared_a, shared_b, own = perm[:3], perm[3:5], perm[5:]
    # Requests 0-2 read shared_a (48 tokens), 3-4 shared_b (32), 5 nothing; 6 and 7 write the prefixes.
    prefix = [shared_a] * 3 + [shared_b] * 2 + [[]]
    pages = [p + own[i * 5 : (i + 1) * 5] for i, p in enumerate(prefix)] + [shared_a, shared_b]
    lengths = [0] * 8
    steps = [
        ([6, 7], [48, 32]),  # the shared prefixes
        (list(range(6)), [5, 9, 16, 3, 20, 7]),  # each request's own tokens, after its prefix
        (list(range(6)), [1] * 6),  # 2 groups and a lone request: 4 segments, padded to 8 rows
        ([0, 1, 3, 4], [1] * 4),  # 2 groups, exactly 4 rows
        ([0, 1, 2], [1] * 3),  # 1 group, padded to 4
    ] + [(list(range(6)), [1] * 6)] * 20  # crosses page boundaries
    tol = 2e-2
    with torch.inference_mode():
        for n, (rows, new) in enumerate(steps):
            if n == 1:
                lengths[:5] = [48] * 3 + [32] * 2  # the members start behind the written prefixes
            reqs = scheduled([lengths[i] for i in rows], new, [pages[i] for i in rows])
            cascade, flat = BatchLayout.build(reqs, PAGE, CascadePolicy()), BatchLayout.build(reqs, PAGE)
            ids = torch.tensor([t for r in reqs for t in r.new_token_ids], device="cuda")
            pos = torch.tensor(flat.positions, device="cuda")
            eager_plans.clear()
            out_graph = graphed(ids, pos, cascade).clone()
            if n >= 2:
                assert cascade.prefix is not None and not eager_plans, f"step {n} did not replay a cascade graph"
            out_eager = eager(ids, pos, cascade)
            ref_backend.plan(flat)
            out_ref = ref_model(ids, pos)
            e_graph, e_ref = rel_err(out_graph, out_eager), rel_err(out_graph, out_ref)
            assert e_graph < tol, f"graph vs eager cascade {e_graph:.2e} at step {n}"
            assert e_ref < tol, f"graph vs flat reference {e_ref:.2e} at step {n}"
            for i, k in zip(rows, new):
                lengths[i] += k
    # The graphs appended each token through the request's own pages: the caches agree.
    assert_request_pages_agree(graph_backend, eager_backend, tol)


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]
    assert capture_batch_sizes(1024)[-1] == 512  # larger decode steps run eagerly


def test_a_model_that_cannot_be_captured_decodes_eagerly() -> None:
    from types import SimpleNamespace

    from flashserve.worker.assembly import capture_decode_graphs

    backend = fi_backend(4, 64, torch.bfloat16)
    tiny = TinyModel(backend, 4, 64, torch.bfloat16)

    def syncing(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = tiny(ids, pos)
        return out * (1.0 if out.sum().item() != 0 else 2.0)  # a host sync: illegal under capture

    runner = SimpleNamespace(backend=backend, device=torch.device("cuda"), graphs=None, cascade=None)
    model = SimpleNamespace(decode_logits=lambda b: syncing)
    with torch.inference_mode():
        capture_decode_graphs(runner, model, 4)
        assert runner.graphs is None
        reqs = scheduled([0, 0], [5, 3], [[1, 2], [3, 4]])
        layout = BatchLayout.build(reqs, PAGE)
        backend.plan(layout)
        ids = torch.tensor([t for r in reqs for t in r.new_token_ids], device="cuda")
        out = syncing(ids, torch.tensor(layout.positions, device="cuda"))
    assert out.shape == (8, 4 * 64) and torch.isfinite(out).all()
    torch.randn(4, device="cuda")  # no capture began: the RNG is usable


class _Cycle:
    """An object in a reference cycle: freed by Python's collector, not by its last reference."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph
        self.me = self


def test_piecewise_graphs_capture_while_a_dead_reference_cycle_holds_an_earlier_graph() -> None:
    """A graph held by a dead reference cycle (a runner dropped before the next one is built) is
    reset when the collector frees it, never inside a capture, which the reset would invalidate.
    Here the cycle dies while the pieces are being captured, with the collector set to run at
    nearly every allocation; the pieces still capture, and replay what the eager pieces compute."""
    from flashserve.worker.piecewise_graph import LayerPieces, PiecewiseGraphRunner, run_layer_steps

    gen = torch.Generator("cuda").manual_seed(0)
    hidden, heads, d = 256, 4, 64
    ws = [(torch.randn(hidden, 3 * heads * d, generator=gen, device="cuda") / hidden**0.5).bfloat16() for _ in range(2)]
    tok = torch.randn(VOCAB, hidden, generator=gen, device="cuda").bfloat16()
    earlier = torch.cuda.CUDAGraph()
    x = torch.zeros(8, device="cuda")
    with torch.cuda.graph(earlier):
        x.add_(1)
    held = [earlier]
    del earlier

    def steps(ids: torch.Tensor, pos: torch.Tensor):  # type: ignore[no-untyped-def]
        h = tok[ids]
        for layer, w in enumerate(ws):
            if held and torch.cuda.is_current_stream_capturing():
                _Cycle(held.pop())  # the graph's last reference, now in a dead cycle
            q, k, v = (h @ w).split(heads * d, dim=-1)
            t = h.shape[0]
            attn = yield layer, q.reshape(t, heads, d), k.reshape(t, heads, d), v.reshape(t, heads, d)
            h = h + attn.reshape(t, -1)
        return h

    def attention(pos: torch.Tensor, out: torch.Tensor):  # type: ignore[no-untyped-def]
        return lambda layer, q, k, v: out.copy_(q * k.sigmoid() + v)

    pieces = LayerPieces(steps, attention, lambda h, idx: h.float(), heads, d, torch.bfloat16)
    runner = PiecewiseGraphRunner(pieces, torch.device("cuda"), [16, 32])
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 10, 10)
    try:
        runner.capture()
    finally:
        gc.set_threshold(*thresholds)
    assert not held
    gc.collect()  # the cycle and its graph go now, outside any capture
    ids = torch.randint(0, VOCAB, (20,), device="cuda")
    pos = torch.arange(20, device="cuda")
    with torch.inference_mode():
        replayed = runner(ids, pos, None)
        out = torch.empty(20, heads, d, dtype=torch.bfloat16, device="cuda")
        eager = run_layer_steps(steps(ids, pos), attention(pos, out)).float()
    # Padded to 32 rows, the replayed GEMMs may take other kernels than the eager 20-row ones.
    assert rel_err(replayed, eager) < 1e-2
    torch.randn(4, device="cuda")  # every capture ended: the RNG is usable
