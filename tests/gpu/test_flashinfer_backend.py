"""The FlashInfer backend attends like the PyTorch reference on the same pages, on a GPU.

Both backends start from the same random cache contents (a request's cached prefix is whatever
its pages hold) and run the same steps: ragged prefills, chunks over page-aligned and unaligned
prefixes mixed with decodes, decode-only steps (tensor-core path), on shuffled pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from flashserve.attention import flashinfer as flashinfer_backend
from flashserve.attention.base import BatchLayout
from flashserve.attention.flashinfer import FlashInferAttentionBackend
from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.engine.outputs import ScheduledRequest
from flashserve.message.sampling_params import SamplingParams

PAGE = 16
NUM_PAGES = 96
NUM_LAYERS = 2
KV_HEADS = 2
# Relative error (norm of the difference over norm of the reference) allowed per dtype.
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass
class Req:
    cached: int  # tokens already in the cache (random contents, the same in both backends)
    pages: list[int] = field(default_factory=list)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def make_backends(
    q_heads: int, head_dim: int, dtype: torch.dtype, model_dtype: torch.dtype | None = None,
    num_pages: int = NUM_PAGES, kv_cache_dtype: torch.dtype | None = None, **fi_kwargs,
) -> tuple[FlashInferAttentionBackend, TorchAttentionBackend]:  # fmt: skip
    """A FlashInfer backend in `dtype` and a reference in the model dtype, with equal caches (of
    `kv_cache_dtype`, default `dtype`, in both)."""
    model_dtype = model_dtype or dtype
    fi = FlashInferAttentionBackend(
        NUM_LAYERS, num_pages, PAGE, KV_HEADS, head_dim, dtype, "cuda", None,
        **{"num_qo_heads": q_heads, "kv_cache_dtype": kv_cache_dtype, **fi_kwargs},
    )  # fmt: skip
    ref = TorchAttentionBackend(NUM_LAYERS, num_pages, PAGE, KV_HEADS, head_dim, model_dtype, "cuda", None,
                                kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    gen = torch.Generator("cuda").manual_seed(0)
    for (fk, fv), (rk, rv) in zip(fi.kv_cache, ref.kv_cache):
        for f, r in ((fk, rk), (fv, rv)):
            f.copy_(torch.randn(f.shape, generator=gen, device="cuda"))
            r.copy_(f)
    return fi, ref


def make_requests(prefixes: list[int], seed: int, room: int = 70, num_pages: int = NUM_PAGES) -> list[Req]:
    """Requests on shuffled pages, with pages for `room` more tokens each (page 0 is the scratch
    page, never handed out)."""
    pool = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    reqs = [Req(p) for p in prefixes]
    for r in reqs:
        r.pages = [pool.pop() for _ in range(-(-(r.cached + room) // PAGE))]
    return reqs


def layout_for(reqs: list[Req], new: list[int]) -> BatchLayout:
    params = SamplingParams()
    scheduled = [
        ScheduledRequest(str(i), [1] * n, r.cached, r.pages, True, params) for i, (r, n) in enumerate(zip(reqs, new))
    ]
    return BatchLayout.build(scheduled, PAGE)


def run_step(
    fi: FlashInferAttentionBackend,
    ref: TorchAttentionBackend,
    reqs: list[Req],
    new: list[int],
    tol: float,
    model_dtype: torch.dtype,
    seed: int,
) -> float:
    """Plans and runs one step on every layer of both backends; returns the worst relative error."""
    layout = layout_for(reqs, new)
    fi.plan(layout)
    ref.plan(layout)
    gen = torch.Generator("cuda").manual_seed(seed)
    tokens, q_heads, head_dim = layout.num_tokens, fi.num_qo_heads, fi.head_dim
    worst = 0.0
    for layer in range(NUM_LAYERS):
        q = torch.randn(tokens, q_heads, head_dim, generator=gen, device="cuda").to(model_dtype)
        k = torch.randn(tokens, KV_HEADS, head_dim, generator=gen, device="cuda").to(model_dtype)
        v = torch.randn(tokens, KV_HEADS, head_dim, generator=gen, device="cuda").to(model_dtype)
        out = fi.forward(layer, q, k, v)
        expected = ref.forward(layer, q, k, v)
        assert out.shape == q.shape and out.dtype == model_dtype
        err = rel_err(out, expected)
        assert err < tol, f"layer {layer}: relative error {err:.2e} >= {tol:.0e} for new={new}"
        worst = max(worst, err)
    for (fk, fv), (rk, rv) in zip(fi.kv_cache, ref.kv_cache):
        # The appended K/V land in the same slots: equal up to the cache dtype's rounding.
        torch.testing.assert_close(fk.float(), rk.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(fv.float(), rv.float(), atol=tol, rtol=tol)
    for r, n in zip(reqs, new):
        r.cached += n
    return worst


# Prefixes: none, unaligned, page-aligned (16, 32), long enough for split-KV decode.
PREFIXES = [0, 0, 5, 16, 32, 21, 150, 0]
STEPS = [
    [1, 7, 16, 11, 1, 9, 30, 33],  # ragged: fresh prefills, chunks over cached prefixes
    [16, 1, 1, 5, 1, 1, 1, 32],  # mixed prefill chunks and decodes
    [1] * 8,  # decode only: tensor-core decode
    [1] * 8,
]


@pytest.fixture(params=["triton-decode", "flashinfer-decode"])
def decode_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """The backend's keywords: `fused_decode` with every decode-only step through `triton_decode`
    (by default those of up to `TRITON_DECODE_MAX_BATCH` requests), or the default, every decode
    step through FlashInfer's."""
    if request.param == "flashinfer-decode":
        return {}
    monkeypatch.setattr(flashinfer_backend, "TRITON_DECODE_MAX_BATCH", 64)
    return {"fused_decode": True}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_steps_match_the_reference(group: int, head_dim: int, dtype: torch.dtype, decode_kernel: dict) -> None:
    fi, ref = make_backends(KV_HEADS * group, head_dim, dtype, **decode_kernel)
    reqs = make_requests(PREFIXES, seed=group * head_dim)
    errs = [run_step(fi, ref, reqs, new, TOL[dtype], dtype, seed=s) for s, new in enumerate(STEPS)]
    print(f"ERR group={group} D={head_dim} {dtype}: " + " ".join(f"{e:.2e}" for e in errs))


@pytest.mark.parametrize("apart", [False, True], ids=["one-pass", "fresh-apart"])
@pytest.mark.parametrize("attn_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_float32_model_is_downcast_and_the_output_upcast(attn_dtype: torch.dtype, apart: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    if apart:  # the first step's last request, a fresh prompt, through the ragged pass
        monkeypatch.setattr(flashinfer_backend, "RAGGED_MIN_TOKENS", 1)
    fi, ref = make_backends(KV_HEADS * 3, 64, attn_dtype, model_dtype=torch.float32)
    reqs = make_requests(PREFIXES, seed=7)
    errs = [run_step(fi, ref, reqs, new, TOL[attn_dtype], torch.float32, seed=s) for s, new in enumerate(STEPS)]
    print(f"ERR fp32 model, {attn_dtype} attention: " + " ".join(f"{e:.2e}" for e in errs))


def test_llama_8b_heads_long_decode() -> None:
    fi, ref = make_backends(32, 128, torch.bfloat16)
    reqs = make_requests([700, 1, 300, 16], seed=3)
    errs = [run_step(fi, ref, reqs, new, TOL[torch.bfloat16], torch.bfloat16, seed=s) for s, new in
            enumerate([[1, 40, 1, 1], [1, 1, 1, 1]])]
    print("ERR 32/8 heads D=128 bf16 long: " + " ".join(f"{e:.2e}" for e in errs))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16-cache", "fp8-cache"])
def test_one_long_sequence_decodes_as_the_reference_does(cache_dtype: torch.dtype) -> None:
    """One request of 3,000 cached tokens (the Triton decode's most splits), GQA of 4; an FP8
    cache against the reference over an FP8 cache of the same contents."""
    pages = 200
    fi, ref = make_backends(KV_HEADS * 4, 128, torch.bfloat16, num_pages=pages, kv_cache_dtype=cache_dtype,
                            fused_decode=True)  # fmt: skip
    assert fi.triton_decodes(1)
    reqs = make_requests([3000], seed=11, room=40, num_pages=pages)
    errs = [run_step(fi, ref, reqs, [1], TOL[torch.bfloat16], torch.bfloat16, seed=s) for s in range(3)]
    print(f"ERR one sequence of 3000, {cache_dtype} cache: " + " ".join(f"{e:.2e}" for e in errs))


def test_graph_batch_size_padding_and_eligibility() -> None:
    fi, _ = make_backends(8, 64, torch.bfloat16)
    fi.init_cuda_graph([1, 2, 4, 8])
    reqs = make_requests([3, 40, 16], seed=2)
    assert fi.cuda_graph_batch_size(layout_for(reqs, [1, 1, 1])) == 4
    assert fi.cuda_graph_batch_size(layout_for(reqs[:1], [1])) == 1
    assert fi.cuda_graph_batch_size(layout_for(reqs, [2, 1, 1])) is None  # a prefill chunk
    many = make_requests([1] * 9, seed=4)
    assert fi.cuda_graph_batch_size(layout_for(many, [1] * 9)) is None  # above the largest size


@pytest.mark.parametrize("new", [[1, 1, 1], [9, 1, 30]], ids=["decode", "mixed"])
def test_layer_loop_does_not_synchronise_with_the_host(new: list[int]) -> None:
    fi, _ = make_backends(8, 64, torch.bfloat16)
    reqs = make_requests([40, 0, 16], seed=5)
    layout = layout_for(reqs, new)
    fi.plan(layout)
    q = torch.randn(layout.num_tokens, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(layout.num_tokens, KV_HEADS, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fi.forward(0, q, k, v)  # the first run may initialise lazily
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in range(NUM_LAYERS):
            fi.forward(layer, q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture
def fresh_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's trailing fresh prompts, and the continued prompts just before them, attended
    apart, however few their tokens."""
    monkeypatch.setattr(flashinfer_backend, "RAGGED_MIN_TOKENS", 1)
    monkeypatch.setattr(flashinfer_backend, "CONTINUED_MIN_TOKENS", 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_fresh_prompts_attended_apart_match_the_reference(group: int, head_dim: int, dtype: torch.dtype,
                                                          fresh_apart: None) -> None:  # fmt: skip
    """A fresh prompt and a decode, then a chunk after its prefix and fresh prompts (those four
    apart); then only fresh prompts (no row over pages); then decodes over what they appended."""
    fi, ref = make_backends(KV_HEADS * group, head_dim, dtype)
    reqs = make_requests([0, 40, 21, 0, 0, 0], seed=group + head_dim)
    run_step(fi, ref, reqs, [9, 1, 30, 17, 1, 45], TOL[dtype], dtype, seed=1)
    assert fi._step is not None and (fi._step.ragged_from, fi._step.continued_to) == (9 + 1, 9 + 1 + 30)
    for s, new in enumerate([[1, 1, 1, 1, 1, 1], [2, 1, 1, 1, 1, 1]]):
        run_step(fi, ref, reqs, new, TOL[dtype], dtype, seed=2 + s)
    fresh = make_requests([0, 0, 0], seed=9)
    run_step(fi, ref, fresh, [5, 16, 40], TOL[dtype], dtype, seed=5)
    assert fi._step is not None and fi._step.ragged is not None and fi._step.wrapper is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4])
def test_continued_prompts_attended_apart_match_the_reference(group: int, dtype: torch.dtype,
                                                              fresh_apart: None) -> None:  # fmt: skip
    """Prompts continued after cached tokens (an unaligned prefix, a page-aligned one) attend their
    own tokens in the ragged pass and their cached ones in a second pass, merged: beside decodes
    and a fresh prompt, then alone, as the reference attends them."""
    fi, ref = make_backends(KV_HEADS * group, 128, dtype)
    reqs = make_requests([40, 21, 32, 150, 0], seed=7 + group, room=120)
    run_step(fi, ref, reqs[:4], [1, 30, 18, 1], TOL[dtype], dtype, seed=11)
    # A decode last: nothing apart, every row in the paged pass.
    assert fi._step is not None and fi._step.ragged is None
    run_step(fi, ref, [*reqs[:3], reqs[4]], [1, 30, 18, 25], TOL[dtype], dtype, seed=12)
    assert fi._step is not None and fi._step.continued is not None
    assert (fi._step.ragged_from, fi._step.continued_to) == (1, 1 + 30 + 18)
    run_step(fi, ref, reqs[1:3], [40, 33], TOL[dtype], dtype, seed=13)
    assert fi._step is not None and fi._step.wrapper is None and fi._step.continued_to == 73


def test_continued_prompts_over_an_fp8_cache_attend_their_new_keys_unquantized(fresh_apart: None) -> None:
    """Over an FP8 cache a continued prompt attends its cached tokens' FP8 copies and the K/V it
    computes in the step as computed: as a reference over a bf16 cache that holds those FP8 values."""
    fi, _ = make_backends(KV_HEADS * 4, 128, torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)
    _, ref = make_backends(KV_HEADS * 4, 128, torch.bfloat16)
    for (fk, fv), (rk, rv) in zip(fi.kv_cache, ref.kv_cache):
        rk.copy_(fk.to(torch.bfloat16))
        rv.copy_(fv.to(torch.bfloat16))
    reqs = make_requests([40, 21, 0], seed=13)
    layout = layout_for(reqs, [1, 48, 30])
    fi.plan(layout)
    ref.plan(layout)
    assert fi._step is not None and fi._step.continued is not None
    gen = torch.Generator("cuda").manual_seed(4)
    q = torch.randn(79, KV_HEADS * 4, 128, generator=gen, device="cuda").bfloat16()
    k, v = (torch.randn(79, KV_HEADS, 128, generator=gen, device="cuda").bfloat16() for _ in range(2))
    err = rel_err(fi.forward(0, q, k, v), ref.forward(0, q, k, v))
    assert err < TOL[torch.bfloat16] / 2, f"relative error {err:.2e}"


def test_fresh_prompts_over_an_fp8_cache_attend_their_own_keys_unquantized(fresh_apart: None) -> None:
    """With an FP8 KV cache a fresh prompt attends the K/V it computed, not their FP8 copies:
    as a reference over a bf16 cache does, within bf16's tolerance."""
    fi, _ = make_backends(KV_HEADS * 4, 128, torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)
    _, ref = make_backends(KV_HEADS * 4, 128, torch.bfloat16)
    reqs = make_requests([0, 0], seed=12)
    layout = layout_for(reqs, [33, 64])
    fi.plan(layout)
    ref.plan(layout)
    gen = torch.Generator("cuda").manual_seed(3)
    q = torch.randn(97, KV_HEADS * 4, 128, generator=gen, device="cuda").bfloat16()
    k, v = (torch.randn(97, KV_HEADS, 128, generator=gen, device="cuda").bfloat16() for _ in range(2))
    err = rel_err(fi.forward(0, q, k, v), ref.forward(0, q, k, v))
    # Attending FP8 copies of K/V instead errs by several 1e-2 (e4m3 keeps 3 mantissa bits).
    assert err < TOL[torch.bfloat16] / 2, f"relative error {err:.2e}"
