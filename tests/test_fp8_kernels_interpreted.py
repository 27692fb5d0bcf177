"""The Triton kernels (fused norm, SiLU-and-mul, KV append with and without RoPE, split-KV decode attention, the FP8-weight GEMV) checked on a CPU through Triton's
interpreter, in a subprocess of their own (`triton_interpreted.py`): their indexing, saturation,
residual update and scales, which the GPU tests check with the float8 roundings as well."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "triton_interpreted.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_fp8_append_writes_each_token_saturated_into_its_page_and_slot(measured: dict[str, Any]) -> None:
    assert measured["append_ran"] and measured["append_bytes_equal"]


def test_the_rope_append_rotates_q_in_place_as_the_torch_rope_does(measured: dict[str, Any]) -> None:
    assert measured["rope_append_ran"] and measured["rope_q_ulps"] <= 1.0  # the interpreter truncates to bfloat16


def test_the_rope_append_writes_rotated_k_and_plain_v_into_their_pages(measured: dict[str, Any]) -> None:
    assert measured["rope_k_cache_ulps"] <= 1.0 and measured["rope_v_cache_equal"]


def test_the_rope_append_leaves_the_k_input_unrotated(measured: dict[str, Any]) -> None:
    assert measured["rope_k_left_alone"]


@pytest.mark.parametrize("cache", ["f32", "fp8"])
@pytest.mark.parametrize("splits", [2, 8])
def test_the_split_decode_attention_matches_float32_attention(measured: dict[str, Any], cache: str, splits: int) -> None:
    assert measured[f"decode_{cache}_{splits}_splits_err"] < 1e-5


def test_the_split_decode_attention_of_a_bfloat16_q_over_an_fp8_cache_matches_float32_attention(
        measured: dict[str, Any]) -> None:
    # q and the products in float16 (the cache widened to it), the output rounded to bfloat16 once
    assert measured["decode_fp8_bf16_q_err"] < 2**-7


def test_the_fused_norm_adds_the_scaled_gemm_output_into_the_residual(measured: dict[str, Any]) -> None:
    assert measured["norm_residual_err"] < 1e-6


def test_the_fused_norm_normalizes_the_updated_residual(measured: dict[str, Any]) -> None:
    assert measured["norm_out_err"] < 1e-6


def test_the_fused_norm_leaves_the_embedding_alone_in_the_first_layer(measured: dict[str, Any]) -> None:
    assert measured["norm_first_layer_residual_untouched"]


def test_the_fused_norm_quantizes_each_row_with_its_absmax_scale(measured: dict[str, Any]) -> None:
    assert measured["norm_quantized_shape"] and measured["norm_scale_err"] < 1e-6


def test_the_fused_norm_keeps_a_static_scale_and_bounds_a_dynamic_one(measured: dict[str, Any]) -> None:
    assert measured["norm_static_scale_kept"] and measured["norm_bounded_scale_err"] < 1e-6


def test_the_fused_silu_and_mul_scales_its_rows_by_their_absmax(measured: dict[str, Any]) -> None:
    assert measured["silu_scale_err"] < 1e-6 and measured["silu_plain_scale_err"] < 1e-6


def gemv_errs(measured: dict[str, Any], kind: str) -> dict[str, float]:
    return {k: v for k, v in measured.items() if k.startswith(kind) and ("gated" in kind) == ("gated" in k)}


def test_the_weight_gemv_multiplies_a_row_by_the_dequantized_weights_and_adds_the_bias(measured: dict[str, Any]) -> None:
    errs = gemv_errs(measured, "gemv_")
    # float32 exactly; bfloat16 within its output rounding.
    assert len(errs) == 6 and max(errs.values()) < 8e-3 and min(errs.values()) < 1e-5, errs


def test_the_gated_weight_gemv_writes_silu_of_the_gate_times_the_up_half(measured: dict[str, Any]) -> None:
    errs = gemv_errs(measured, "gemv_gated_")
    assert len(errs) == 3 and max(errs.values()) < 8e-3 and min(errs.values()) < 1e-5, errs
