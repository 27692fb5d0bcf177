"""FP8 on the GPU: the scaled GEMM against a dequantized reference per Llama-3.1-8B projection
shape; FlashInfer over an FP8 KV cache against the PyTorch reference over the same pages (prefill,
mixed, decode and cascade steps); and the native model with FP8 weights and with an FP8 KV cache (dummy weights of the
Llama-3.2-1B shape) over a prefill and 32 decode steps, eagerly and from CUDA graphs, against its
own teacher-forced pass (the whole sequences in one prefill) and against the model in bfloat16
with the same (dequantized) weights.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from flashserve.attention.kv_quant import FP8_KV_DTYPE, to_cache
from flashserve.attention.paged_append import Rope, append_paged
from flashserve.layers.fp8 import (
    MIN_SCALE, QuantizedRows, UnscaledRows, dequantize_weight, quantize_rows, quantize_rows_torch, quantize_static,
    quantize_weight_per_channel,
)  # fmt: skip
from flashserve.layers.fp8_fused import add_rmsnorm_quant, silu_and_mul_quant
from flashserve.layers.fp8_gemm import SMALL_M, fp8_gemm_small_m, fp8_linear
from flashserve.layers.linear import gate_up_silu_for, linear, linear_unscaled
from flashserve.layers.ops import rope_cos_sin_cache, rope_inv_freq
from flashserve.model_loader.checkpoint import load_llama
from flashserve.models.hf import model_shape
from flashserve.models.llama import LlamaModel
from flashserve.models.native import NativeCausalLM
from fp8_checkpoints import ct_config, with_quantization, write_fp8_checkpoint
from test_cascade_gpu import scheduled
from test_flashinfer_backend import (
    KV_HEADS, NUM_LAYERS, PAGE, PREFIXES, STEPS, TOL, make_backends, make_requests, run_step,
)  # fmt: skip
from test_native_gpu import DECODE_STEPS, PROMPTS, hf_model, paged_logits, rel_err, row_errs

# (N, K) of the 8B's fused qkv, o, fused gate_up and down projections.
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# Rows of the quantized-activation GEMMs (one row a projection reads unquantized).
ROWS = (7, 64, 300)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gemm_operands(name: str, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, K] bfloat16, the FP8 weight [N, K] of projection `name` and its scale [N], a bias [N]."""
    n, k = SHAPES_8B[name]
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    return x, *quantize_weight_per_channel(w), bias


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(SHAPES_8B))
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_fp8_gemm_matches_the_dequantized_product(name: str, m: int, static: bool) -> None:
    x, wq, ws, bias = gemm_operands(name, m)
    input_scale = x.float().abs().max() / 448.0 if static else None
    xq, xs = quantize_static(x, input_scale) if input_scale is not None else quantize_rows_torch(x)
    ref = (xq.float() * xs) @ dequantize_weight(wq, ws, torch.float32).T + bias.float()
    with torch.inference_mode():
        out = fp8_linear(x, wq, bias, ws.view(1, -1), input_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, wq.shape[0])
    # The same quantized operands: only fp32 accumulation order and the bfloat16 output differ.
    assert rel_err(out.float(), ref) < 8e-3


@pytest.mark.parametrize("name", list(SHAPES_8B))
@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_a_one_row_fp8_projection_multiplies_it_unquantized_by_the_dequantized_weights(name: str, static: bool) -> None:
    x, wq, ws, bias = gemm_operands(name, 1)
    input_scale = x.float().abs().max() / 448.0 if static else None  # not applied: no activation is quantized
    ref = x.float() @ dequantize_weight(wq, ws, torch.float32).T + bias.float()
    with torch.inference_mode():
        out = fp8_linear(x, wq, bias, ws.view(1, -1), input_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (1, wq.shape[0])
    # Only fp32 accumulation order and the bfloat16 output differ.
    assert rel_err(out.float(), ref) < 4e-3


def test_a_one_row_fp8_gate_up_writes_silu_of_the_gate_times_the_up_half() -> None:
    x, wq, ws, bias = gemm_operands("gate_up", 1)
    full = x.float() @ dequantize_weight(wq, ws, torch.float32).T + bias.float()
    inter = wq.shape[0] // 2
    ref = torch.nn.functional.silu(full[:, :inter]) * full[:, inter:]
    with torch.inference_mode():
        out = gate_up_silu_for((wq, None, ws.view(1, -1), None, None), None, x, (wq, bias, ws.view(1, -1), None, None))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (1, inter)
    assert rel_err(out.float(), ref) < 4e-3


@pytest.mark.parametrize("m", (1, 7, 64, SMALL_M))
@pytest.mark.parametrize("name", list(SHAPES_8B))
def test_the_small_batch_fp8_gemm_matches_the_dequantized_product(name: str, m: int) -> None:
    """FlashInfer's bmm_fp8 with unit scales, then the row and channel scales (and bias) in one kernel:
    the path fp8_linear takes up to SMALL_M rows, called directly so that it runs whatever the threshold."""
    pytest.importorskip("flashinfer")
    x, wq, ws, bias = gemm_operands(name, m)
    xq, xs = quantize_rows_torch(x)
    ref = (xq.float() * xs) @ dequantize_weight(wq, ws, torch.float32).T + bias.float()
    with torch.inference_mode():
        out = fp8_gemm_small_m(xq, xs, wq, ws.view(1, -1), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, wq.shape[0])
    # As the row-wise GEMM, plus one more bfloat16 rounding (bmm_fp8's unscaled output).
    assert rel_err(out.float(), ref) < 8e-3


@pytest.mark.parametrize("k", [64, 4096, 14336])
def test_the_fused_row_quantization_kernel_equals_the_torch_one(k: int) -> None:
    x = torch.randn(37, k, device="cuda").bfloat16() * torch.logspace(-3, 3, 37, device="cuda")[:, None].bfloat16()
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_torch(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # At most one e4m3 step apart (the kernel multiplies by the scale's reciprocal, torch divides): a
    # step is at most an eighth of a normal value, and 2**-9 among the subnormals (below 2**-6), where
    # the rows' smallest values land (their amax sits at 448).
    step = (q_ref.float().abs() * 2**-3).clamp(min=2**-9)
    assert (q.float() - q_ref.float()).abs().le(step).all()


def test_row_quantization_does_not_depend_on_the_batch() -> None:
    """A decode step's rows and a prefill's rows are quantized alike: row i of a batch is bit-identical
    to row i quantized alone, so decode and prefill see the same FP8 operands from the same input."""
    x = torch.randn(300, 4096, device="cuda").bfloat16()
    q, s = quantize_rows(x)
    for i in (0, 1, 137, 299):
        qi, si = quantize_rows(x[i : i + 1])
        assert torch.equal(si, s[i : i + 1]) and torch.equal(qi.view(torch.uint8), q[i : i + 1].view(torch.uint8))


def assert_quantized_like(got: QuantizedRows, ref: torch.Tensor, static: torch.Tensor | None = None,
                          ub: float | None = None) -> None:
    """`got` is `ref` (float32 [M, K]) quantized per row (or with the static scale, or with amax bounded
    by `ub`): the scale is amax / 448 (at least quantize_rows' smallest scale) and every value within an e4m3 rounding (half a step: 2^-4
    relative, 2^-10 of the scale below the normal range) of ref / scale, saturated at 448."""
    q, s = got
    assert q.dtype == torch.float8_e4m3fn and s.shape == (ref.shape[0], 1)
    amax = ref.abs().amax(-1, keepdim=True)
    want = static.reshape(1, 1).expand_as(s) if static is not None else (
        (amax.clamp(max=ub) if ub is not None else amax) / 448.0).clamp(min=MIN_SCALE)
    torch.testing.assert_close(s, want, rtol=1e-5, atol=0)
    target = (ref / s).clamp(-448.0, 448.0)
    assert ((q.float() - target).abs() <= target.abs() * 2**-4 * 1.001 + 2**-10 + 1e-3).all()


def norm_reference(x: torch.Tensor | None, residual: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm in float32 of the residual after the add, stored in bfloat16; that residual)."""
    r = residual.float() if x is None else (residual.float() + x).bfloat16().float()
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * w.float(), r


def unscaled_rows(m: int, n: int, bias: bool, seed: int) -> tuple[UnscaledRows, torch.Tensor]:
    """A GEMM output with its scales still to apply (as bmm_fp8 leaves it), and its float32 value."""
    gen = torch.Generator("cuda").manual_seed(seed)
    y = (torch.randn(m, n, device="cuda", generator=gen) * 100).bfloat16()
    xs = torch.rand(m, 1, device="cuda", generator=gen) * 0.05 + 0.05
    ws = torch.rand(1, n, device="cuda", generator=gen) * 0.05 + 0.05
    b = torch.randn(n, device="cuda", generator=gen).bfloat16() if bias else None
    value = y.float() * xs * ws + (b.float() if b is not None else 0.0)
    return UnscaledRows(y, xs, ws, b), value


NORM_INPUTS = ["first-layer", "plain", "unscaled", "unscaled-bias"]


@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
@pytest.mark.parametrize("given", NORM_INPUTS)
def test_the_fused_add_rmsnorm_writes_the_quantized_norm_of_the_updated_residual(given: str, hidden: int, m: int) -> None:
    gen = torch.Generator("cuda").manual_seed(hidden + m)
    residual = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
    w = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    x: torch.Tensor | UnscaledRows | None = None
    value = None
    if given == "plain":
        x = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
        value = x.float()
    elif given.startswith("unscaled"):
        x, value = unscaled_rows(m, hidden, given.endswith("bias"), hidden)
    ref, r = norm_reference(value, residual, w, 1e-5)
    before = residual.clone()
    got, res = add_rmsnorm_quant(x, residual, w, 1e-5)
    assert isinstance(got, QuantizedRows)
    if x is None:
        assert torch.equal(res, before)  # the embedding is left alone
    else:
        assert res.data_ptr() == residual.data_ptr()
        # The kernel may fuse the scaling multiply-adds, so a sum on a rounding tie can land one
        # bfloat16 step (2^-7 relative at most) from the reference's.
        torch.testing.assert_close(res.float(), r, rtol=2**-7, atol=1e-6)
    assert_quantized_like(got, ref)


@pytest.mark.parametrize("bound", ["static", "ub"])
def test_the_fused_add_rmsnorm_takes_a_static_scale_or_a_bound_on_the_dynamic_one(bound: str) -> None:
    gen = torch.Generator("cuda").manual_seed(5)
    residual = torch.randn(9, 4096, device="cuda", generator=gen).bfloat16()
    x = torch.randn(9, 4096, device="cuda", generator=gen).bfloat16()
    w = (torch.rand(4096, device="cuda", generator=gen) + 0.5).bfloat16()
    ref, _ = norm_reference(x.float(), residual, w, 1e-5)
    static = torch.tensor(0.004, device="cuda") if bound == "static" else None
    ub = 1.5 if bound == "ub" else None
    got, _ = add_rmsnorm_quant(x, residual, w, 1e-5, True, static, ub)
    assert isinstance(got, QuantizedRows)
    assert_quantized_like(got, ref, static, ub)


def test_the_fused_add_rmsnorm_applies_deferred_scales_for_a_dense_reader() -> None:
    """The final norm (before a bfloat16 LM head) reads down_proj's unscaled output too."""
    x, value = unscaled_rows(5, 4096, False, 3)
    gen = torch.Generator("cuda").manual_seed(4)
    residual = torch.randn(5, 4096, device="cuda", generator=gen).bfloat16()
    w = (torch.rand(4096, device="cuda", generator=gen) + 0.5).bfloat16()
    ref, _ = norm_reference(value, residual, w, 1e-5)
    got, _ = add_rmsnorm_quant(x, residual, w, 1e-5, quantize=False)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("inter", [1024, 14336, 28672])
@pytest.mark.parametrize("given", ["plain", "unscaled", "unscaled-bias"])
def test_the_fused_silu_and_mul_writes_its_product_quantized(given: str, inter: int, m: int) -> None:
    if given == "plain":
        gen = torch.Generator("cuda").manual_seed(inter + m)
        x: torch.Tensor | UnscaledRows = (torch.randn(m, 2 * inter, device="cuda", generator=gen) * 3).bfloat16()
        value = x.float()
    else:
        x, value = unscaled_rows(m, 2 * inter, given.endswith("bias"), inter + m)
    ref = torch.nn.functional.silu(value[:, :inter]) * value[:, inter:]
    assert_quantized_like(silu_and_mul_quant(x), ref)


@pytest.mark.parametrize("name", list(SHAPES_8B))
def test_an_fp8_projection_leaves_its_scales_to_the_reader_from_two_rows_in_cuda_graphs(name: str) -> None:
    """Under capture, 2 rows or more go through bmm_fp8 and leave their scales to the reader (up to
    prefill sizes: the piecewise graphs of FP8 models reach 2,304 tokens); an eager step takes
    `_scaled_mm` at every size (bmm_fp8's host cost would dominate it). Both give the same product
    up to bfloat16 rounding (two roundings: 2e-2 relative to the output's largest)."""
    pytest.importorskip("flashinfer")
    for m in (1, 2, SMALL_M, SMALL_M + 1, 2048):
        x, wq, ws, bias = gemm_operands(name, m)
        with torch.inference_mode():
            eager = linear_unscaled(x, wq, bias, ws.view(1, -1))
            whole = linear(x, wq, bias, ws.view(1, -1))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = linear_unscaled(x, wq, bias, ws.view(1, -1))
                got = out.scaled() if isinstance(out, UnscaledRows) else out
            graph.replay()
            torch.cuda.synchronize()
        assert not isinstance(eager, UnscaledRows)
        assert isinstance(out, UnscaledRows) == (m >= 2)
        torch.testing.assert_close(got.float(), whole.float(), rtol=0, atol=2e-2 * whole.abs().max().item())


def dequantized_copy(hf: torch.nn.Module) -> torch.nn.Module:
    """`hf` with every projection weight rounded to FP8 per channel, as `--quantization fp8` does."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".weight") and name.removesuffix(".weight").endswith(PROJECTIONS):
                p.copy_(dequantize_weight(*quantize_weight_per_channel(p), p.dtype))
    return ref


def teacher_forced(shape: tuple[int, int, int, int], native: LlamaModel, seqs: list[list[int]],
                   kv_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Every position's logits from one prefill of the whole sequences."""
    full = tuple(len(s) for s in seqs)
    return paged_logits(shape, NativeCausalLM(native).decode_logits, seqs, False, kv_dtype, full, 0)


CASES = [("fp8-weights", "fp8", None), ("fp8-kv", None, FP8_KV_DTYPE), ("fp8-both", "fp8", FP8_KV_DTYPE)]


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]], ids=["two-sequences", "one-sequence"])
@pytest.mark.parametrize("mode", ["eager", "cuda_graph", "piecewise"])
@pytest.mark.parametrize(("case", "quantization", "kv_dtype"), CASES, ids=[c[0] for c in CASES])
def test_fp8_decode_matches_its_teacher_forced_pass_and_stays_near_bf16(
    case: str, quantization: str | None, kv_dtype: torch.dtype | None, mode: str, prompts: tuple[int, ...]
) -> None:
    """Two sequences decode through the FP8 GEMMs of quantized rows, one through the one-row GEMV
    (piecewise: every step from the piecewise graphs, whose steps of up to 128 rows take bmm_fp8)."""
    pytest.importorskip("flashinfer")
    hf, config = hf_model("llama-3.2-1b", None)
    shape = model_shape(config)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (p + DECODE_STEPS,), generator=gen).tolist() for p in prompts]
    with torch.inference_mode():
        native = LlamaModel.from_hf(hf, config, torch.bfloat16, "cuda", consume=False, max_positions=4096,
                                    quantization=quantization)
        step_model = NativeCausalLM(native)
        got = paged_logits(shape, step_model.decode_logits, seqs, mode == "cuda_graph", kv_dtype, prompts,
                           pieces_for=step_model.layer_pieces if mode == "piecewise" else None)
        forced = teacher_forced(shape, native, seqs, kv_dtype)
        del native
        ref_hf = dequantized_copy(hf) if quantization else hf
        bf16 = LlamaModel.from_hf(ref_hf, config, torch.bfloat16, "cuda", consume=False, max_positions=4096)
        base = teacher_forced(shape, bf16, seqs, None)
        base_decoded = paged_logits(shape, NativeCausalLM(bf16).decode_logits, seqs, False, None, prompts)
    e_forced = rel_err(torch.cat(got), torch.cat(forced))
    e_bf16 = rel_err(torch.cat(got), torch.cat(base))
    worst = max(row_errs(a, r).max().item() for a, r in zip(got, base))
    agree = sum(int((a.argmax(-1) == r.argmax(-1)).sum()) for a, r in zip(got, base)) / sum(len(s) for s in seqs)
    # The bound, from two measurements on the same weights: e_path, the bfloat16 model's decode against
    # its own teacher-forced pass (decode and prefill kernels accumulate in different orders, so each
    # layer's input moves by bfloat16 roundings), and e_quant, the FP8 model's teacher-forced logits
    # against the bfloat16 model's (all of FP8's rounding noise: weights and activations). Decode and
    # prefill quantize identical rows identically (test_row_quantization_does_not_depend_on_the_batch);
    # a decode step of one sequence reads its rows unquantized, which moves it from its teacher-forced
    # pass by the activations' share of that noise, less than all of it. An e4m3 rounding is a step of
    # 1/8 to 1/16 relative: an input moved by a bfloat16 rounding crosses a rounding boundary now and
    # then and jumps a whole step, so the FP8 model's path difference is many times e_path (7.9e-2 on
    # an H100 against 1.3e-2 for the FP8-KV model, e_quant ~ 0.21). The bound lets it reach all of
    # e_quant plus e_path; a wrong scale or operand is O(1).
    e_path = rel_err(torch.cat(base_decoded), torch.cat(base))
    e_quant = rel_err(torch.cat(forced), torch.cat(base))
    bound = e_path + e_quant
    print(f"FP8 {case} {mode} {len(prompts)} seq: vs own teacher-forced {e_forced:.2e} (bound {bound:.2e}: bf16 decode vs its "
          f"teacher-forced {e_path:.2e}, FP8 noise {e_quant:.2e}); vs bf16 (same weights) {e_bf16:.2e} "
          f"(worst row {worst:.2e}), greedy agreement {agree:.3f}")
    assert e_forced < bound
    # e4m3 keeps 3 mantissa bits (about 3% per value): a bound that a wrong scale or layout (errors
    # of order 1) cannot meet; the printed figures are the measurement.
    assert e_bf16 < 0.25


CHECKPOINTS = {
    "ct-tensor-static": (lambda: ct_config("tensor", False), False, True),
    "ct-channel-dynamic": (lambda: ct_config("channel", True), True, False),
    "fbgemm": (lambda: {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, True, False),
}


@pytest.mark.parametrize("fmt", list(CHECKPOINTS))
def test_an_fp8_checkpoint_runs_fp8_gemms_near_its_dequantized_model(fmt: str, tmp_path) -> None:
    pytest.importorskip("flashinfer")
    from transformers import LlamaConfig

    from test_native_llama import hf_model as small_hf_model

    qconfig, per_channel, static = CHECKPOINTS[fmt]
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    path, reference = write_fp8_checkpoint(tmp_path, small_hf_model(config), config, qconfig(), per_channel,
                                           static_input=static)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (p + DECODE_STEPS,), generator=gen).tolist() for p in PROMPTS]
    shape = model_shape(config)
    with torch.inference_mode():
        fp8 = load_llama(path, with_quantization(config, qconfig()), torch.bfloat16, "cuda")
        assert fp8.layers[0].qkv_proj.weight.dtype == torch.float8_e4m3fn
        assert (fp8.layers[0].qkv_proj.input_scale is not None) == static
        got = paged_logits(shape, NativeCausalLM(fp8).decode_logits, seqs, True)
        bf16 = LlamaModel.from_hf(reference.to(torch.bfloat16), config, torch.bfloat16, "cuda")
        base = paged_logits(shape, NativeCausalLM(bf16).decode_logits, seqs, True)
    err = rel_err(torch.cat(got), torch.cat(base))
    print(f"FP8 checkpoint {fmt}: logits vs the dequantized bf16 model {err:.2e}")
    assert err < 0.25


def fp8_cache_backends(q_heads: int, head_dim: int) -> tuple[Any, Any]:
    """A FlashInfer backend and the reference, both bfloat16 attention over an FP8 cache holding
    the same random pages."""
    return make_backends(q_heads, head_dim, torch.bfloat16, kv_cache_dtype=FP8_KV_DTYPE)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_flashinfer_reads_an_fp8_cache_as_the_reference_does(group: int, head_dim: int) -> None:
    # Prefills, chunks over cached prefixes mixed with decodes, and decode-only steps.
    pytest.importorskip("flashinfer")
    fi, ref = fp8_cache_backends(KV_HEADS * group, head_dim)
    reqs = make_requests(PREFIXES, seed=group * head_dim)
    errs = [run_step(fi, ref, reqs, new, TOL[torch.bfloat16], torch.bfloat16, seed=s) for s, new in enumerate(STEPS)]
    print(f"FP8 KV group={group} D={head_dim}: " + " ".join(f"{e:.2e}" for e in errs))


@pytest.mark.parametrize("new", [[1] * 6, [5, 1, 9, 12, 1, 3]], ids=["decode", "mixed"])
def test_a_cascade_step_over_an_fp8_cache_matches_flat_attention(new: list[int]) -> None:
    pytest.importorskip("flashinfer")
    from flashserve.attention.base import BatchLayout
    from flashserve.attention.cascade import CascadePolicy

    fi, ref = fp8_cache_backends(8, 128)
    requests = scheduled(new)
    cascade = BatchLayout.build(requests, PAGE, CascadePolicy())
    assert cascade.prefix is not None
    fi.plan(cascade)
    ref.plan(BatchLayout.build(requests, PAGE))
    gen = torch.Generator("cuda").manual_seed(len(new))
    for layer in range(NUM_LAYERS):
        q, k, v = (torch.randn(cascade.num_tokens, h, 128, generator=gen, device="cuda").bfloat16()
                   for h in (8, KV_HEADS, KV_HEADS))
        assert rel_err(fi.forward(layer, q, k, v), ref.forward(layer, q, k, v)) < TOL[torch.bfloat16]


APPEND_PAGE, APPEND_HEADS, APPEND_DIM, APPEND_PAGES = 16, 8, 128, 40


def append_step(scale: float) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, tuple[torch.Tensor, ...]]:
    """Three requests whose new tokens cross page boundaries, on shuffled pages: FlashInfer's
    append arguments (batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len), and q,
    k, v as column slices of a fused bfloat16 qkv output (4 q heads a KV head) of random values
    times `scale`."""
    page, heads, dim = APPEND_PAGE, APPEND_HEADS, APPEND_DIM
    new, before = [1, 19, 40], [5, 14, 0]  # tokens appended per request, tokens already cached
    gen = torch.Generator("cuda").manual_seed(0)
    table = torch.randperm(APPEND_PAGES, generator=gen, device="cuda").int()
    lens = [b + n for b, n in zip(before, new)]
    counts = [(n + page - 1) // page for n in lens]
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    indices = table[: int(indptr[-1])].contiguous()
    last = torch.tensor([n - (c - 1) * page for n, c in zip(lens, counts)], dtype=torch.int32, device="cuda")
    batch = torch.repeat_interleave(torch.arange(3, device="cuda"), torch.tensor(new, device="cuda")).int()
    pos = torch.cat([torch.arange(b, b + n, device="cuda") for b, n in zip(before, new)]).int()
    qkv = (torch.randn(sum(new), (4 + 2) * heads * dim, generator=gen, device="cuda") * scale).bfloat16()
    q = qkv[:, : 4 * heads * dim].view(-1, 4 * heads, dim)
    k = qkv[:, 4 * heads * dim : 5 * heads * dim].view(-1, heads, dim)
    v = qkv[:, 5 * heads * dim :].view(-1, heads, dim)
    return (batch, pos, indices, indptr, last), qkv, (q, k, v)


def empty_cache(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (APPEND_PAGES, APPEND_PAGE, APPEND_HEADS, APPEND_DIM)
    return tuple(torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(2))  # type: ignore[return-value]


def steps_apart(a: torch.Tensor, b: torch.Tensor, mantissa_bits: int, min_spacing: float = 0.0) -> float:
    """The largest |a - b| in units of the format's spacing at b (`mantissa_bits` stored bits; at
    least `min_spacing`, the subnormals' spacing)."""
    a, b = a.float(), b.float()
    spacing = torch.ldexp(torch.ones_like(b), torch.frexp(b).exponent - 1 - mantissa_bits).clamp_min(min_spacing)
    return float(((a - b).abs() / spacing).max())


def test_the_fused_fp8_append_writes_the_bytes_flashinfer_writes() -> None:
    """K and V saturated (some beyond +-448), appended to three requests: the same cache bytes as
    `to_cache` and FlashInfer's append_paged_kv_cache."""
    flashinfer = pytest.importorskip("flashinfer")
    (batch, pos, indices, indptr, last), _, (q, k, v) = append_step(200.0)
    fused, ref = empty_cache(FP8_KV_DTYPE), empty_cache(FP8_KV_DTYPE)
    assert append_paged(q, k, v, batch, pos, indices, indptr, fused)
    flashinfer.append_paged_kv_cache(to_cache(k, FP8_KV_DTYPE), to_cache(v, FP8_KV_DTYPE), batch, pos, ref, indices,
                                     indptr, last, kv_layout="NHD")
    for f, r in zip(fused, ref):
        assert torch.equal(f.view(torch.uint8), r.view(torch.uint8))


def rope_then_append(cache_dtype: torch.dtype, rope_pos: torch.Tensor, cos_sin: torch.Tensor) -> tuple:
    """FlashInfer's two kernels on `append_step`: RoPE in place, then the append. (q, cache)."""
    import flashinfer

    (batch, pos, indices, indptr, last), qkv, (q, k, v) = append_step(3.0)
    t, d = q.shape[0], q.shape[-1]
    flashinfer.apply_rope_with_cos_sin_cache_inplace(rope_pos, q.reshape(t, -1), k.reshape(t, -1), d, cos_sin,
                                                     is_neox=True)  # fmt: skip
    cache = empty_cache(cache_dtype)
    flashinfer.append_paged_kv_cache(to_cache(k, cache_dtype), to_cache(v, cache_dtype), batch, pos, cache, indices,
                                     indptr, last, kv_layout="NHD")  # fmt: skip
    return q, cache


def fused_rope_append(cache_dtype: torch.dtype, rope_pos: torch.Tensor, cos_sin: torch.Tensor) -> tuple:
    """`append_paged` with the same RoPE on `append_step`. (q, cache)."""
    (batch, pos, indices, indptr, _), _, (q, k, v) = append_step(3.0)
    cache = empty_cache(cache_dtype)
    assert append_paged(q, k, v, batch, pos, indices, indptr, cache, Rope(rope_pos, cos_sin))
    return q, cache


def rope_table() -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions 1000 past the append's (as a cascade step's) and Llama-3.1's table."""
    (_, pos, *_), _, _ = append_step(3.0)
    inv_freq = rope_inv_freq({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, APPEND_DIM)  # fmt: skip
    return pos.long() + 1000, rope_cos_sin_cache(inv_freq, 2048, "cuda")


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_KV_DTYPE], ids=["bf16-cache", "fp8-cache"])
def test_the_rope_append_rotates_q_as_flashinfer_rope_does(cache_dtype: torch.dtype) -> None:
    pytest.importorskip("flashinfer")
    rope = rope_table()
    want, _ = rope_then_append(cache_dtype, *rope)
    got, _ = fused_rope_append(cache_dtype, *rope)
    assert steps_apart(got, want, 7) <= 1.0  # the float32 rotation may contract into FMAs differently


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_KV_DTYPE], ids=["bf16-cache", "fp8-cache"])
def test_the_rope_append_writes_the_cache_flashinfer_rope_and_append_write(cache_dtype: torch.dtype) -> None:
    pytest.importorskip("flashinfer")
    rope = rope_table()
    _, want = rope_then_append(cache_dtype, *rope)
    _, got = fused_rope_append(cache_dtype, *rope)
    bits, subnormal = (3, 2.0**-9) if cache_dtype == FP8_KV_DTYPE else (7, 0.0)
    for g, w in zip(got, want):
        assert steps_apart(g.float(), w.float(), bits, subnormal) <= 1.0
        assert (g.view(torch.uint8) == w.view(torch.uint8)).float().mean().item() > 0.99


def test_an_fp8_engine_replays_a_2000_token_prompt_from_piecewise_graphs_as_near_bf16_as_its_eager_step() -> None:
    """With FP8 projections, steps of up to 2,304 tokens replay piecewise graphs by default
    (`config.FP8_PIECEWISE_GRAPH_TOKENS`): a 2,000-token prompt, padded to the 2,048-token graphs
    (whose projections take bmm_fp8, the eager step's row-wise `_scaled_mm`), stays as near the
    bfloat16 model with the same (unquantized) weights at every sampled row as its eager step does."""
    pytest.importorskip("flashinfer")
    import random

    from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
    from flashserve.entrypoints.llm import LLM
    from flashserve.message.sampling_params import SamplingParams

    rng = random.Random(3)
    ids = [rng.randrange(1, 128000) for _ in range(2000)]
    pages = list(range(1, 2 + len(ids) // 16))
    rows = list(range(0, 2000, 37))  # prompt-logprob rows across the prompt, after the sampled one

    def logits(runner: Any, request_id: str) -> torch.Tensor:
        request = ScheduledRequest(request_id, ids, 0, pages, True, SamplingParams(temperature=0.0), ids, [])
        out = runner.forward(SchedulerOutput([request]), rows).float()
        runner.execute(SchedulerOutput([], finished_ids=[request_id]))
        return out

    # The same dummy weights (drawn by name and seed), in bfloat16 and quantized to FP8 at load.
    kwargs: dict[str, Any] = {"load_format": "dummy", "num_pages": 300, "max_num_seqs": 8, "max_model_len": 4096}
    reference = LLM("llama-3.2-1b", cuda_graph=False, **kwargs)
    try:
        base = logits(reference.engine.executor, "bf16")
    finally:
        reference.close()
    llm = LLM("llama-3.2-1b", quantization="fp8", **kwargs)
    try:
        runner = llm.engine.executor
        pieces = runner.piecewise_graphs
        assert pieces is not None and pieces.covers(2304) and not pieces.covers(2305)
        graphed = logits(runner, "graphs")
        runner.piecewise_graphs = None
        try:
            eager = logits(runner, "eager")
        finally:
            runner.piecewise_graphs = pieces
    finally:
        llm.close()
    assert graphed.shape == eager.shape == base.shape == (1 + len(rows), base.shape[1])
    e_graph, e_eager = rel_err(graphed, base), rel_err(eager, base)
    worst_graph, worst_eager = row_errs(graphed, base).max().item(), row_errs(eager, base).max().item()
    print(f"FP8 2,000-token prompt against bf16: graphs {e_graph:.2e} (worst row {worst_graph:.2e}), eager "
          f"{e_eager:.2e} (worst row {worst_eager:.2e}); graphs against eager {rel_err(graphed, eager):.2e}")
    # Both are FP8's rounding noise over random weights, which a change in where the GEMMs round moves
    # by chance, row by row (e4m3 rounds to steps of 1/8-1/16 relative); a wrong row, scale or padding
    # adds an error of order one.
    assert e_graph < 1.25 * e_eager
    assert worst_graph < 1.25 * worst_eager
