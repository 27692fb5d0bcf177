"""The native Llama-family forward equals transformers' eager forward on the same weights.

Teacher forced through the paged reference backend: a prefill step, a mixed step (one request's
prefill beside the others' decode tokens) and several decode steps, with page-aligned and
unaligned lengths, against HF's logits over each full sequence in float64: our float32 forward
within the tolerance, or no further off than HF's own float32 forward.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from flashserve.attention.base import BatchLayout
from flashserve.attention.torch_ref import TorchAttentionBackend
from flashserve.engine.outputs import ScheduledRequest
from flashserve.layers.ops import apply_rope_torch
from flashserve.message.sampling_params import SamplingParams
from flashserve.model_loader.loader import embedded_gguf_path
from flashserve.models.llama import LlamaModel, UnsupportedModelError, WeightMismatchError

PAGE = 16
NUM_PAGES = 48
SMALL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """HF initialises norms to 1 and biases to 0; random ones make those paths visible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)


def hf_model(config: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize(model)
    return model.eval()


def native_teacher_forced(
    model: LlamaModel, seqs: list[list[int]], schedule: list[list[tuple[int, int]]], backend: Any = None
) -> list[torch.Tensor]:
    """Runs each step's chunks [a, b) of every listed sequence; returns logits per sequence and
    position. backend: one of NUM_PAGES pages of PAGE tokens (default: the float32 reference)."""
    spec = model.spec
    if backend is None:
        backend = TorchAttentionBackend(spec.num_layers, NUM_PAGES, PAGE, spec.num_kv_heads, spec.head_dim,
                                        torch.float32, "cpu")
    pool = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(1)).tolist()
    pages = [[pool.pop() for _ in range((len(s) + PAGE - 1) // PAGE)] for s in seqs]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    params = SamplingParams()
    for step in schedule:
        reqs = [ScheduledRequest(str(i), seqs[i][a:b], a, pages[i], True, params) for i, (a, b) in enumerate(step) if b > a]
        owners = [i for i, (a, b) in enumerate(step) if b > a]
        layout = BatchLayout.build(reqs, PAGE)
        backend.plan(layout)
        ids = torch.tensor([t for r in reqs for t in r.new_token_ids], dtype=torch.long)
        hidden = model(ids, torch.tensor(layout.positions, dtype=torch.long), backend)
        logits = model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        for r, owner in enumerate(owners):
            rows[owner].append(logits[layout.qo_indptr[r] : layout.qo_indptr[r + 1]])
    return [torch.cat(r) for r in rows]


def assert_matches_hf(
    config: Any, hf: torch.nn.Module | None = None, atol: float = 1e-5, rtol: float = 1e-4, compile: bool = False
) -> None:
    hf = hf if hf is not None else hf_model(config)
    native = LlamaModel.from_hf(hf, config, torch.float32, "cpu", consume=False, compile=compile)
    gen = torch.Generator().manual_seed(2)
    lengths = [16 + 5, 5 + 5, 21 + 4]  # prompts 16 (page-aligned), 5 and 21, then decode steps
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    # Step 1: prefill A and B. Step 2: C's prefill beside A's and B's decode. Then decode all.
    schedule = [[(0, 16), (0, 5), (0, 0)], [(16, 17), (5, 6), (0, 21)]]
    schedule += [[(16 + k, 17 + k), (5 + k, 6 + k), (20 + k, 21 + k)] for k in range(1, 5)]
    got = native_teacher_forced(native, seqs, schedule)
    # The reference is HF's forward in float64. A float32 forward differs from it by its GEMMs'
    # rounding, which depends on their blocking (oneDNN's on a CPU, BLAS's in HF): ours must be
    # within the tolerance of it, or no further from it than HF's own float32 forward is. The
    # absolute part scales with the size of the row's logits: a float32 product's rounding error
    # grows with the magnitude of what it computes, so a logit near zero in a row of logits near
    # 20 carries the row's absolute error, not one of its own size.
    hf64 = copy.deepcopy(hf).double()
    for seq, logits in zip(seqs, got):
        ids = torch.tensor([seq])
        reference = hf64(ids).logits[0, : logits.shape[0]]
        hf_error = (hf(ids).logits[0, : logits.shape[0]].double() - reference).abs().max().item()
        error = (logits.double() - reference).abs()
        scale = reference.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)
        bound = atol * scale + rtol * reference.abs()
        assert (error <= torch.maximum(bound, torch.full_like(error, 2 * hf_error))).all(), (
            f"max error {error.max().item():.2e} against float64; HF's float32 forward {hf_error:.2e}"
        )


CONFIGS = {
    "llama_gqa_untied": LlamaConfig(**SMALL, tie_word_embeddings=False),
    "llama_gqa_tied": LlamaConfig(**SMALL, tie_word_embeddings=True),
    "llama_biases": LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True),
    "llama3_rope_scaling": LlamaConfig(
        **SMALL,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),  # fmt: skip
    "linear_rope_scaling": LlamaConfig(**SMALL, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mistral_head_dim_32": MistralConfig(**SMALL, head_dim=32),
    "qwen2_qkv_biases": Qwen2Config(**SMALL),
    "qwen3_qk_norm": Qwen3Config(**SMALL, head_dim=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_native_matches_hf_eager_over_prefill_mixed_and_decode_steps(name: str) -> None:
    assert_matches_hf(CONFIGS[name])


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen3_qk_norm"])
@torch.inference_mode()
def test_torch_compiled_native_matches_hf_eager(name: str) -> None:
    assert_matches_hf(CONFIGS[name], compile=True)


@torch.inference_mode()
def test_llama3_scaled_rope_differs_from_unscaled() -> None:
    # Guards the test above: the llama3 table really changes positions beyond the short context.
    from flashserve.layers.ops import rope_inv_freq

    plain = rope_inv_freq({"rope_type": "default", "rope_theta": 500000.0}, 16)
    scaled = rope_inv_freq(dict(CONFIGS["llama3_rope_scaling"].rope_parameters), 16)
    assert not torch.equal(plain, scaled)


@torch.inference_mode()
def test_consuming_the_hf_model_releases_its_weights() -> None:
    config = CONFIGS["llama_gqa_tied"]
    hf = hf_model(config)
    LlamaModel.from_hf(hf, config, torch.float32, "cpu")
    assert all(p.is_meta for p in hf.parameters())


def test_missing_tensor_is_named_in_the_error() -> None:
    config = CONFIGS["llama_gqa_untied"]
    state = dict(hf_model(config).state_dict())
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightMismatchError, match=r"missing \(1\): model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaModel.from_hf(state, config, torch.float32, "cpu")


def test_unexpected_tensor_is_named_in_the_error() -> None:
    config = CONFIGS["llama_gqa_untied"]
    state = dict(hf_model(config).state_dict())
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(WeightMismatchError, match=r"unexpected \(1\): model\.layers\.0\.self_attn\.q_proj\.bias"):
        LlamaModel.from_hf(state, config, torch.float32, "cpu")


def test_wrong_shape_is_named_in_the_error() -> None:
    config = CONFIGS["llama_gqa_untied"]
    state = dict(hf_model(config).state_dict())
    state["model.norm.weight"] = torch.ones(32)
    with pytest.raises(WeightMismatchError, match=r"wrong shape \(1\): model\.norm\.weight"):
        LlamaModel.from_hf(state, config, torch.float32, "cpu")


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        LlamaConfig(**SMALL, hidden_act="gelu"),
        Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=0),
    ],
    ids=["dynamic_rope", "gelu", "qwen2_sliding_window"],
)
def test_unsupported_configs_raise_an_error_that_names_the_fallback(config: Any) -> None:
    with pytest.raises(UnsupportedModelError, match="--model-impl hf"):
        LlamaModel.from_hf({}, config, torch.float32, "cpu")


def test_unsupported_architecture_raises_an_error_that_names_the_fallback() -> None:
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="GPT2"):
        LlamaModel.from_hf({}, GPT2Config(architectures=["GPT2LMHeadModel"]), torch.float32, "cpu")


# --- the embedded SmolLM2-135M-Instruct (a real checkpoint: Q4_1 GGUF, dequantised) ---------


@pytest.fixture(scope="module")
def smollm2() -> torch.nn.Module:
    path = embedded_gguf_path()  # `make test` installs the package; missing, it is an error
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.mark.slow
@torch.inference_mode()
def test_embedded_smollm2_matches_hf_eager(smollm2: torch.nn.Module) -> None:
    assert_matches_hf(smollm2.config, smollm2, atol=1e-4, rtol=1e-4)


def test_float32_projections_on_a_cpu_are_packed_for_onednn_and_a_tied_head_keeps_a_dense_embedding() -> None:
    config = CONFIGS["llama_gqa_untied"]
    tied = LlamaConfig(**SMALL, tie_word_embeddings=True)
    untied = LlamaModel.from_hf(hf_model(config), config, torch.float32, "cpu")
    model = LlamaModel.from_hf(hf_model(tied), tied, torch.float32, "cpu")
    assert all(p.weight.is_mkldnn for layer in untied.layers
               for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))  # fmt: skip
    assert untied.lm_head_weight.is_mkldnn
    assert model.lm_head_weight.is_mkldnn and not model.embed_tokens["weight"].is_mkldnn


def test_a_float32_model_on_a_gpu_runs_the_pytorch_ops() -> None:
    # FlashInfer's norm, RoPE and activation kernels take float16 and bfloat16 only.
    from flashserve.layers.ops import select_ops

    assert select_ops("cuda", "auto", torch.float32).name == "torch"


def test_the_flashinfer_ops_refuse_a_float32_model() -> None:
    from flashserve.layers.ops import select_ops

    with pytest.raises(ValueError, match="float16 or bfloat16"):
        select_ops("cuda", "flashinfer", torch.float32)


class RotatingBackend(TorchAttentionBackend):
    """The reference backend taking RoPE as FlashInfer's does with `fused_decode`: q and k come
    unrotated with the step's `Rope`, and it rotates them before appending and attending."""

    calls_with_rope = 0

    def takes_rope(self, cos_sin: torch.Tensor, head_dim: int) -> bool:
        return True

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Any = None) -> torch.Tensor:
        assert rope is not None
        RotatingBackend.calls_with_rope += 1
        t, d = q.shape[0], q.shape[-1]
        q, k = apply_rope_torch(rope.positions, q.reshape(t, -1), k.reshape(t, -1), d, rope.cos_sin)
        return super().forward(layer, q.view(t, -1, d), k.view(t, -1, d), v)


@pytest.mark.parametrize("name", ["llama3_rope_scaling", "qwen3_qk_norm"])
@torch.inference_mode()
def test_a_backend_that_takes_rope_gets_q_and_k_unrotated_and_gives_the_same_logits(name: str) -> None:
    config = CONFIGS[name]
    native = LlamaModel.from_hf(hf_model(config), config, torch.float32, "cpu")
    spec = native.spec
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (21, 9)]
    schedule = [[(0, 17), (0, 5)]] + [[(17 + k, 18 + k), (5 + k, 6 + k)] for k in range(4)]
    plain = native_teacher_forced(native, seqs, schedule)
    RotatingBackend.calls_with_rope = 0
    backend = RotatingBackend(spec.num_layers, NUM_PAGES, PAGE, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    rotated = native_teacher_forced(native, seqs, schedule, backend)
    assert RotatingBackend.calls_with_rope == len(schedule) * spec.num_layers
    for a, b in zip(rotated, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
