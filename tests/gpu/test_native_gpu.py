"""On a GPU, in bf16 through the FlashInfer backend and ops, the native forward matches HF eager.

Dummy weights of the Llama-3.2-1B shape (all 16 layers) and the Llama-3.1-8B shape (8 of its 32
layers, to keep an fp32 reference beside two bf16 copies within memory and time), teacher forced
over a ragged prefill of two requests and 32 decode steps. Both bf16 forwards are measured against
HF eager in float32 on the same weights: the native one must be about as close as HF's own bf16
forward (relative error, overall and per row). The decode steps run eagerly, from CUDA graphs,
every step from piecewise graphs (the pieces between attention calls, attention eager),
and (1B shape) from graphs of the `torch.compile`d model and eagerly from the model read straight
from a saved checkpoint's safetensors files; the generic HF path (the transformers
model with our paged attention) is held to the same bound, eagerly and from graphs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashserve.attention.base import BatchLayout
from flashserve.engine.outputs import ScheduledRequest
from flashserve.message.sampling_params import SamplingParams
from flashserve.model_loader.checkpoint import load_llama
from flashserve.model_loader.loader import dummy_hf_config
from flashserve.models.hf import HFCausalLM, model_shape
from flashserve.models.llama import LlamaModel
from flashserve.models.native import NativeCausalLM

PAGE = 16
# Token counts of the piecewise graphs: prefills of 100 + 37 and 100 tokens replay 160's, with padding.
PIECEWISE_COUNTS = [16, 64, 160]
PROMPTS = (100, 37)  # unaligned lengths; decode crosses page boundaries
DECODE_STEPS = 32
SHAPES = {"llama-3.2-1b": None, "llama-3.1-8b": 8}  # shape -> layers kept (None: all)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def row_errs(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)


def hf_model(shape: str, layers: int | None) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM

    config = dummy_hf_config(shape)
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():  # norms are initialised to 1: random ones make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model.eval(), config


def paged_logits(
    shape: tuple[int, int, int, int], forward_for: Any, seqs: list[list[int]], use_graphs: bool,
    kv_cache_dtype: torch.dtype | None = None, prompts: tuple[int, ...] = PROMPTS, decode_steps: int = DECODE_STEPS,
    fused_decode: bool = False, pieces_for: Any = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Teacher-forced float32 logits [len(seq), V] per request: its prefill rows (`prompts`), then
    one row per decode step. `shape` is (layers, heads, kv heads, head_dim); `forward_for(backend)`
    gives the step function `(ids, positions) -> logits of every row`. `pieces_for(backend)`: the
    model's layer pieces, and every step (prefill and decode) replays them from piecewise graphs
    of `PIECEWISE_COUNTS` tokens, padded."""
    from flashserve.attention.flashinfer import FlashInferAttentionBackend

    num_layers, num_heads, num_kv_heads, head_dim = shape
    pages_per_seq = [(len(s) + PAGE - 1) // PAGE for s in seqs]
    num_pages = 1 + sum(pages_per_seq)
    backend = FlashInferAttentionBackend(
        num_layers, num_pages, PAGE, num_kv_heads, head_dim, torch.bfloat16, "cuda", None, num_qo_heads=num_heads,
        kv_cache_dtype=kv_cache_dtype, fused_decode=fused_decode,
    )  # fmt: skip
    pages, nxt = [], 1  # page 0 is the scratch page
    for n in pages_per_seq:
        pages.append(list(range(nxt, nxt + n))[::-1])  # reversed: non-contiguous order in the cache
        nxt += n
    forward = forward_for(backend)
    graphs = None
    if use_graphs:
        from flashserve.worker.cuda_graph import CudaGraphRunner

        graphs = CudaGraphRunner(forward, backend, [1, 2, 4])
        graphs.capture()
    pieces = None
    if pieces_for is not None:
        from flashserve.worker.piecewise_graph import PiecewiseGraphRunner

        pieces = PiecewiseGraphRunner(pieces_for(backend), backend.device, PIECEWISE_COUNTS)
        pieces.capture()
    params = SamplingParams()
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    steps = [[(0, p) for p in prompts]] + [[(p + k, p + k + 1) for p in prompts] for k in range(decode_steps)]
    for step in steps:
        reqs = [ScheduledRequest(str(i), seqs[i][a:b], a, pages[i], True, params) for i, (a, b) in enumerate(step)]
        layout = BatchLayout.build(reqs, PAGE)
        ids = torch.tensor([t for r in reqs for t in r.new_token_ids], device="cuda")
        pos = torch.tensor(layout.positions, device="cuda")
        if graphs is not None:
            logits = graphs(ids, pos, layout).clone()
        elif pieces is not None:
            assert pieces.covers(len(ids))
            backend.plan(layout)
            logits = pieces(ids, pos, None)
        else:
            backend.plan(layout)
            logits = forward(ids, pos)
        for i in range(len(reqs)):
            rows[i].append(logits[layout.qo_indptr[i] : layout.qo_indptr[i + 1]])
    return [torch.cat(r) for r in rows]


MODES = [(shape, mode) for shape in SHAPES for mode in ("eager", "cuda_graph")]
MODES += [("llama-3.2-1b", mode) for mode in ("compiled", "hf_path", "hf_path_cuda_graph", "safetensors")]
# `--fused-decode`: RoPE in the KV append, and the two-request decode steps through the Triton decode.
MODES += [(shape, "fused_decode_cuda_graph") for shape in SHAPES] + [("llama-3.2-1b", "fused_decode")]
# Every step from piecewise graphs (the pieces between attention calls), RoPE by the model or in the KV append.
MODES += [(shape, "piecewise") for shape in SHAPES] + [("llama-3.2-1b", "fused_decode_piecewise")]
# The prefill's fresh prompts attended apart (the ragged pass over the step's own K/V, below its
# default size), then decode from graphs; also from piecewise graphs, and with RoPE left to the KV append.
MODES += [(shape, "fresh_apart") for shape in SHAPES]
MODES += [("llama-3.2-1b", mode) for mode in ("fresh_apart_piecewise", "fused_decode_fresh_apart")]


@pytest.mark.parametrize(("shape", "mode"), MODES, ids=[f"{s}-{m}" for s, m in MODES])
def test_bf16_forward_matches_hf_eager_over_prefill_and_32_decode_steps(shape: str, mode: str, tmp_path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    pytest.importorskip("flashinfer")
    if "fresh_apart" in mode:
        from flashserve.attention import flashinfer as flashinfer_backend

        monkeypatch.setattr(flashinfer_backend, "RAGGED_MIN_TOKENS", 1)
    hf, config = hf_model(shape, SHAPES[shape])
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (p + DECODE_STEPS,), generator=gen).tolist() for p in PROMPTS]
    use_graphs = mode not in ("eager", "hf_path", "fused_decode") and not mode.endswith("piecewise")
    with torch.inference_mode():
        if mode.startswith("hf_path"):
            # The generic path: the transformers model itself, its attention on our paged backend.
            step_model = HFCausalLM(hf)
            got = paged_logits(model_shape(config), step_model.decode_logits, seqs, use_graphs)
            hf.set_attn_implementation("eager")
        elif mode == "safetensors":
            # The checkpoint's files read straight onto the GPU, with no transformers model built.
            hf.save_pretrained(tmp_path, safe_serialization=True)
            native = load_llama(tmp_path, config, torch.bfloat16, "cuda", max_positions=4096)
            got = paged_logits(model_shape(config), NativeCausalLM(native).decode_logits, seqs, False)
            del native
        else:
            compiled = mode == "compiled"
            native = LlamaModel.from_hf(hf, config, torch.bfloat16, "cuda", consume=False, max_positions=4096, compile=compiled)
            # Compiled: Inductor fuses the PyTorch ops (decode steps replay graphs of the compiled model).
            assert native.ops.name == ("torch" if compiled else "flashinfer")
            step_model = NativeCausalLM(native)
            got = paged_logits(model_shape(config), step_model.decode_logits, seqs, use_graphs,
                               fused_decode=mode.startswith("fused_decode"),
                               pieces_for=step_model.layer_pieces if mode.endswith("piecewise") else None)  # fmt: skip
            del native
        hf16 = [hf(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs]
        hf.float()
        ref = [hf(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs]
    hf16_all, ref_all = torch.cat(hf16), torch.cat(ref)
    e_ours, e_hf = rel_err(torch.cat(got), ref_all), rel_err(hf16_all, ref_all)
    row_ours = max(row_errs(a, r).max().item() for a, r in zip(got, ref))
    row_hf = max(row_errs(a, r).max().item() for a, r in zip(hf16, ref))
    print(f"ERR {shape} {mode}: bf16 {e_ours:.2e} (worst row {row_ours:.2e}), "
          f"hf-bf16 {e_hf:.2e} (worst row {row_hf:.2e}) vs hf-fp32")
    # bf16 tolerance is what HF's own bf16 forward achieves on these weights (measured on an H100:
    # 2.9e-2 for the 1B shape, 3.8e-2 for the 8B one); ours must do about as well, overall and at
    # its worst position (a decode step, say).
    assert e_ours <= 1.5 * e_hf + 2e-3
    assert row_ours <= 1.5 * row_hf + 2e-3
