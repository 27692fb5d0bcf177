"""FP8 checkpoints and `--quantization fp8` on a CPU: the loader reads each published format and
the model computes with the dequantized weights, matching a float32 model given those weights.

Checkpoints are written by the tests from a random model, in the formats' exact tensor names,
dtypes and shapes: compressed-tensors (per-tensor weights with static input scales; per-channel
bfloat16 scales with dynamic activations), fbgemm_fp8 (per-channel, dynamic) and modules kept
unquantized by the config's ignore list.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from flashserve.distributed.sharding import ShardLayout
from flashserve.layers.fp8 import (
    FP8_DTYPE, dequantize_weight, quantize_rows_torch, quantize_weight_per_channel, scale_rows_cols,
)  # fmt: skip
from flashserve.layers.quantization import ProjectionLoader, UnsupportedQuantizationError, fp8_scheme
from flashserve.model_loader.checkpoint import load_llama, read_llama_shard
from flashserve.models.llama import LlamaModel, LlamaSpec, WeightMismatchError
from fp8_checkpoints import PROJECTIONS, ct_config, with_quantization, write_fp8_checkpoint
from test_native_llama import SMALL, hf_model, native_teacher_forced

SEQS = [[3, 17, 40, 2, 9, 100, 33, 7, 81, 5, 6, 12, 200, 150, 1, 8, 44, 45, 46], [11, 12, 13, 14, 15, 90, 91]]
SCHEDULE = [[(0, 16), (0, 5)], [(16, 17), (5, 7)], [(17, 18), (7, 7)], [(18, 19), (7, 7)]]


def assert_same_logits(a: LlamaModel, b: LlamaModel, atol: float = 1e-5) -> None:
    for x, y in zip(native_teacher_forced(a, SEQS, SCHEDULE), native_teacher_forced(b, SEQS, SCHEDULE)):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-4)


@pytest.fixture(scope="module")
def model_and_config() -> tuple[torch.nn.Module, LlamaConfig]:
    config = LlamaConfig(**SMALL, attention_bias=True)  # q/k/v/o biases stay dense beside FP8 weights
    return hf_model(config), config


@pytest.mark.parametrize(("strategy", "dynamic", "scale_dtype"), [
    ("tensor", False, torch.float32), ("channel", True, torch.bfloat16), ("channel", False, torch.float32),
])  # fmt: skip
def test_compressed_tensors_fp8_checkpoint_matches_the_dequantized_model(
    tmp_path: Path, model_and_config: Any, strategy: str, dynamic: bool, scale_dtype: torch.dtype
) -> None:
    hf, config = model_and_config
    qconfig = ct_config(strategy, dynamic)
    path, reference = write_fp8_checkpoint(tmp_path, hf, config, qconfig, strategy == "channel", scale_dtype,
                                           static_input=not dynamic)
    loaded = load_llama(path, with_quantization(config, qconfig), torch.float32, "cpu")
    expected = LlamaModel.from_hf(reference, config, torch.float32, "cpu", consume=False)
    assert_same_logits(loaded, expected)


def test_fbgemm_fp8_checkpoint_matches_the_dequantized_model(tmp_path: Path, model_and_config: Any) -> None:
    hf, config = model_and_config
    qconfig = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    path, reference = write_fp8_checkpoint(tmp_path, hf, config, qconfig, per_channel=True)
    loaded = load_llama(path, with_quantization(config, qconfig), torch.float32, "cpu")
    assert_same_logits(loaded, LlamaModel.from_hf(reference, config, torch.float32, "cpu", consume=False))


def test_modules_in_the_ignore_list_load_unquantized(tmp_path: Path, model_and_config: Any) -> None:
    hf, config = model_and_config
    qconfig = ct_config("channel", True, ignore=["re:.*down_proj"])
    path, reference = write_fp8_checkpoint(tmp_path, hf, config, qconfig, True, skip=("down_proj",))
    loaded = load_llama(path, with_quantization(config, qconfig), torch.float32, "cpu")
    assert_same_logits(loaded, LlamaModel.from_hf(reference, config, torch.float32, "cpu", consume=False))


def test_quantization_fp8_rounds_each_weight_row_to_fp8(model_and_config: Any) -> None:
    hf, config = model_and_config
    reference = copy.deepcopy(hf)
    for name, p in reference.named_parameters():
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(PROJECTIONS):
            p.data.copy_(dequantize_weight(*quantize_weight_per_channel(p.data), torch.float32))
    quantized = LlamaModel.from_hf(hf, config, torch.float32, "cpu", consume=False, quantization="fp8")
    assert_same_logits(quantized, LlamaModel.from_hf(reference, config, torch.float32, "cpu", consume=False))


def test_quantization_fp8_stays_close_to_the_full_precision_model(model_and_config: Any) -> None:
    hf, config = model_and_config
    quantized = LlamaModel.from_hf(hf, config, torch.float32, "cpu", consume=False, quantization="fp8")
    full = LlamaModel.from_hf(hf, config, torch.float32, "cpu", consume=False)
    for x, y in zip(native_teacher_forced(quantized, SEQS, SCHEDULE), native_teacher_forced(full, SEQS, SCHEDULE)):
        # e4m3 keeps 3 mantissa bits: about 3% relative error per weight, far less on the logits.
        assert (x - y).abs().max() <= 0.05 * y.abs().max()


def test_a_rank_reads_its_slice_of_an_fp8_checkpoint_with_its_scales(tmp_path: Path, model_and_config: Any) -> None:
    hf, config = model_and_config
    qconfig = ct_config("channel", True)
    path, _ = write_fp8_checkpoint(tmp_path, hf, config, qconfig, per_channel=True)
    cfg = with_quantization(config, qconfig)
    spec = LlamaSpec.from_hf_config(cfg)
    loader = ProjectionLoader(fp8_scheme(cfg), False, torch.float32, torch.device("cpu"))
    whole = read_llama_shard(path, spec, torch.float32, "cpu", None, loader)
    shard = ShardLayout.for_spec(spec, 1, 2)
    part = read_llama_shard(path, spec, torch.float32, "cpu", shard, loader)
    d, inter = spec.head_dim, shard.intermediate_size
    q_rows = slice(shard.q_head_start * d, (shard.q_head_start + shard.num_heads) * d)
    torch.testing.assert_close(part["layers.0.qkv_proj.weight"][: shard.num_heads * d],
                               whole["layers.0.qkv_proj.weight"][q_rows])
    torch.testing.assert_close(part["layers.0.down_proj.weight"], whole["layers.0.down_proj.weight"][:, inter:])


def test_an_fp8_checkpoint_without_its_scales_is_a_weight_mismatch(tmp_path: Path, model_and_config: Any) -> None:
    hf, config = model_and_config
    qconfig = ct_config("tensor", False)
    path, _ = write_fp8_checkpoint(tmp_path, hf, config, qconfig, per_channel=False, static_input=False)
    with pytest.raises(WeightMismatchError, match="input_scale"):
        load_llama(path, with_quantization(config, qconfig), torch.float32, "cpu")


@pytest.mark.parametrize(("qconfig", "message"), [
    ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({**ct_config("channel", True), "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8},
                                                            "input_activations": None}}}, "only FP8"),
    ({**ct_config("channel", True), "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]},
        "input_activations": {"type": "float", "num_bits": 8, "dynamic": True}}}}, "per-tensor and per-channel"),
    ({**ct_config("channel", True), "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}, "input_activations": None}}}, "W8A16"),
])  # fmt: skip
def test_unsupported_quantization_configs_are_refused(qconfig: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match=message):
        fp8_scheme(LlamaConfig(**SMALL, quantization_config=qconfig))


def test_an_unknown_quantization_flag_is_refused() -> None:
    with pytest.raises(UnsupportedQuantizationError, match="'int4' is not supported"):
        fp8_scheme(LlamaConfig(**SMALL), "int4")


def test_per_token_activation_scales_map_each_row_s_absmax_to_448() -> None:
    x = torch.randn(6, 64) * torch.arange(1, 7)[:, None]
    q, scale = quantize_rows_torch(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (6, 1)
    torch.testing.assert_close(q.float().abs().amax(-1), torch.full((6,), 448.0))
    assert ((q.float() * scale - x).abs() <= x.abs() * 2**-4 + 1e-6).all()  # half an e4m3 step


def test_an_activation_bound_saturates_rows_beyond_it() -> None:
    x = torch.tensor([[1.0, -2000.0, 3.0]])
    q, scale = quantize_rows_torch(x, scale_ub=1200.0)
    assert float(scale) == pytest.approx(1200.0 / 448.0)
    assert float(q.float()[0, 1] * scale) == pytest.approx(-1200.0)


@pytest.mark.parametrize("static", [False, True], ids=["per-token", "static"])
def test_an_fp8_linear_computes_the_product_of_its_quantized_operands(static: bool) -> None:
    # Row-wise torch._scaled_mm also runs on a CPU: the layer's GEMM path, checked here on the
    # same operands the GPU gets (tests/gpu/test_fp8_gpu.py measures the CUDA kernels).
    from flashserve.layers.fp8 import quantize_static
    from flashserve.layers.linear import Linear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    w, bias = torch.randn(48, 64, generator=gen) * 0.05, torch.randn(48, generator=gen).bfloat16()
    layer = Linear(48, 64, bias=True, fp8=True, static_input=static)
    wq, ws = quantize_weight_per_channel(w)
    input_scale = torch.tensor(x.float().abs().max().item() / 448.0) if static else None
    layer.load_state_dict({"weight": wq, "bias": bias, "weight_scale": ws.view(1, -1),
                           **({"input_scale": input_scale} if static else {})}, assign=True)
    xq, xs = quantize_static(x, input_scale) if input_scale is not None else quantize_rows_torch(x)
    expected = (xq.float() * xs) @ dequantize_weight(wq, ws, torch.float32).T + bias.float()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


def test_the_engine_serves_an_fp8_checkpoint_as_its_dequantized_model(tmp_path: Path, model_and_config: Any) -> None:
    from flashserve.message.sampling_params import SamplingParams
    from flashserve.entrypoints.llm import LLM

    hf, config = model_and_config
    (tmp_path / "fp8").mkdir()
    path, reference = write_fp8_checkpoint(tmp_path / "fp8", hf, config, ct_config("channel", True), per_channel=True)
    reference.save_pretrained(tmp_path / "ref", safe_serialization=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for source in (path, tmp_path / "ref"):
        llm = LLM(str(source), num_pages=32, cuda_graph=False)
        try:
            tokens.append(llm.generate([[5, 6, 7, 8, 9]], params)[0].token_ids)
        finally:
            llm.stack.close()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


def test_fp8_weights_on_a_gpu_before_compute_capability_8_9_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashserve.layers.fp8 import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*A100 is 8.0"):
        check_fp8_device(torch.device("cuda"))


def test_an_fp8_checkpoint_on_the_generic_hf_path_is_refused(tmp_path: Path, model_and_config: Any) -> None:
    from flashserve.config import ModelConfig
    from flashserve.model_loader.loader import load_model

    hf, config = model_and_config
    path, _ = write_fp8_checkpoint(tmp_path, hf, config, ct_config("channel", True), per_channel=True)
    with pytest.raises(ValueError, match="FP8 checkpoints load from a local directory .* native model path"):
        load_model(ModelConfig(model=str(path), model_impl="hf"), "cpu")


def test_the_small_batch_gemm_epilogue_scales_rows_and_columns_and_adds_the_bias() -> None:
    y = torch.randn(3, 5).bfloat16()
    xs, ws, bias = torch.rand(3, 1) + 0.5, torch.rand(1, 5) + 0.5, torch.randn(5).bfloat16()
    out = scale_rows_cols(y, xs, ws, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (y.float() * xs * ws + bias.float()).bfloat16().float())
