"""On a GPU, LoRA adapters of ranks 8, 16 and 64 on dummy Llama-3.1-8B weights (bf16, FlashInfer,
decode steps from CUDA graphs) give the logits of the model whose weights hold the adapter merged
(W + scaling * B @ A).

One runner is built as the server builds it (`build_runner` with a `LoRAConfig` of 3 slots of rank
64: warm-up and decode graphs captured with the adapters' GEMMs inside). A mixed prefill step, then
a decode step replayed from a graph, run rows of the three adapters and of the base model at once.
Then, per adapter, its weights are merged into the model's own projections and the same rows run
as base rows (no adapter) through the same runner, whose decode steps of base rows alone replay
the graphs captured without the adapters: the reference. Tolerance: bf16 on both sides, and the
merged weights are themselves rounded to bf16, which over 32 layers of dummy weights moves the
logits by several percent; so the same merge is also rounded a second way (the product rounded to
bf16 before it is added) and the distance between the two merged runs is the reference's noise.
Per row the relative error of the adapter path against the merged one must be under 5e-2 or twice
that noise, whichever is larger, and under a fifth of the adapter's own effect (merged against
base), which dummy weights put near 1.
Base rows in the mixed step must be exact (a zero mask adds exact zeros).

Two short tests check the Triton kernels that decode-sized steps run (`lora/triton_lora.py`) by
themselves, on one layer of the 8B's shapes: against the masked GEMMs of a float32 stack, and
replayed from a CUDA graph with other steps' slots.

Smoke-runnable on a CPU with a small model: `python tests/gpu/test_lora_gpu.py` (float32, the
PyTorch attention, eager; bf16, since float32 weights are packed for oneDNN on a CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Any

import torch

from flashserve.config import CacheConfig, LoRAConfig, ModelConfig
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.lora.adapter import module_shapes
from flashserve.lora.layers import FUSED, PROJECTION
from flashserve.message.lora import LoRARequest
from flashserve.message.sampling_params import SamplingParams

RANKS = (8, 16, 64)
PAGE = 16
ROWS = [1, 2, 3, 0, 3, 1, 2, 0]  # adapter ids of the step's rows (0: base), 8 rows: a captured batch size
PROMPT_LENS = [37, 16, 5, 64, 21, 9, 48, 33]


def write_adapter(folder: str, spec: Any, rank: int, seed: int, modules: tuple[str, ...] | None = None,
                  std: float = 0.02, alpha: float | None = None) -> str:  # fmt: skip
    """A PEFT-format adapter of random A and B (non-zero) for every layer of `spec`."""
    from safetensors.torch import save_file

    modules = modules or tuple(m for ms in FUSED.values() for m in ms)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, (out_f, in_f) in module_shapes(spec).items():
            if module not in modules:
                continue
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * std
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
              "target_modules": list(modules), "bias": "none"}  # fmt: skip
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def rows_of(lids: list[int], tag: str, first_page: int) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
    """(prefill rows, decode rows) of the step's requests with adapter ids `lids` (ROWS' order)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 32000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prefill, decode, page = [], [], first_page
    for i, (p, lid) in enumerate(zip(prompts, lids)):
        n_pages = (len(p) + 1 + PAGE - 1) // PAGE
        pages = list(range(page, page + n_pages))
        page += n_pages
        prefill.append(ScheduledRequest(f"{tag}{i}", p, 0, pages, True, SamplingParams(), p, [], lora_int_id=lid))
        decode.append(ScheduledRequest(f"{tag}{i}", [11], len(p), [], True))
    return prefill, decode


@torch.inference_mode()
def run(runner: Any, lids: list[int], tag: str) -> tuple[torch.Tensor, torch.Tensor]:
    prefill, decode = rows_of(lids, tag, 1)
    runner.batch.clear()
    first = runner.forward(SchedulerOutput(prefill)).clone()
    second = runner.forward(SchedulerOutput(decode)).clone()  # decode-only, every row samples: a graph
    return first, second


@torch.inference_mode()
def merge(runner: Any, lid: int, rounded_first: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Adds adapter `lid`'s scaling * B @ A into the model's fused projections, computed in float32
    from its host weights and the sum rounded to the weights' dtype (`rounded_first`: the product
    rounded to that dtype first, then added in it: the same merge, rounded otherwise); returns each
    changed weight with a copy of what it held, for `restore` (subtracting the product again would
    leave the weights rounded twice)."""
    native = runner.model.model
    adapter = runner.lora.cache[lid]
    shapes = module_shapes(native.spec)
    saved = []
    for layer, proj in enumerate(native.layers):
        for kind, modules in FUSED.items():
            weight = getattr(proj, PROJECTION[kind]).weight
            saved.append((weight, weight.clone()))
            row = 0
            for module in modules:
                out_f = shapes[module][0]
                ab = adapter.weights.get((layer, module))
                if ab is not None:
                    a, b = (t.to(weight.device) for t in ab)
                    part = weight[row : row + out_f]
                    if rounded_first:
                        part.add_((b @ a).to(weight.dtype))
                    else:
                        part.copy_((part.float() + b @ a).to(weight.dtype))
                row += out_f
    return saved


@torch.inference_mode()
def restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for weight, original in saved:
        weight.copy_(original)


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)


def mixed_and_base(model_config: ModelConfig, cache_config: CacheConfig, base_through_adapters: bool = False,
                   **build: Any) -> tuple[Any, tuple, tuple]:  # fmt: skip
    """Builds the runner, loads one adapter per rank of RANKS, and runs the mixed rows and the same
    rows on the base model: (runner, mixed (prefill, decode) logits, base ones). The base run takes
    the forward without adapters (decode from the graphs captured without them), or with
    `base_through_adapters` the forward with them, every row's slot empty. Base rows of the mixed
    step must be exactly those of the forward with adapters and no slot used: other rows' adapters
    do not reach them (a zero mask adds exact zeros; the kernels write base rows' output as the
    projection gave it). Against the forward without adapters they agree to rounding only: on a
    GPU the adapters' forward stacks every slot's A under each projection's weight
    (`LoRAStack.fuse_shrink`), a wider GEMM whose base columns may accumulate in another order."""
    from flashserve.executor.build import build_runner

    runner, _, _ = build_runner(model_config, cache_config, **build)
    spec = runner.model.model.spec
    with tempfile.TemporaryDirectory() as root:
        for lid, rank in enumerate(RANKS, start=1):
            folder = write_adapter(os.path.join(root, f"r{rank}"), spec, rank, seed=lid)
            runner.add_lora(LoRARequest(f"rank-{rank}", lid, folder))
    mixed = run(runner, ROWS, "mixed")
    stack = runner.lora.stack
    set_step = stack.set_step
    stack.set_step = lambda slots, active: set_step(slots, True)  # every step as if some row had an adapter
    try:
        through = run(runner, [0] * len(ROWS), "base through the adapters")
    finally:
        stack.__dict__.pop("set_step", None)
    for phase in (0, 1):
        rows = [i for i, lid in enumerate(ROWS) if lid == 0]
        torch.testing.assert_close(mixed[phase][rows], through[phase][rows], atol=0, rtol=0)
    base = through if base_through_adapters else run(runner, [0] * len(ROWS), "base")
    return runner, mixed, base


def check_against_merged(model_config: ModelConfig, cache_config: CacheConfig, tol: float, **build: Any) -> dict:
    """The mixed step (`mixed_and_base`) against the adapters merged into the weights; returns the
    per-adapter (largest error, smallest effect)."""
    runner, mixed, base = mixed_and_base(model_config, cache_config, **build)
    found = {}
    for lid, rank in enumerate(RANKS, start=1):
        runner.lora.slots_for([lid])  # its weights stay in the host cache (3 adapters, 3 entries)
        saved = merge(runner, lid)
        merged = run(runner, [0] * len(ROWS), f"merged{lid}")
        restore(saved)
        saved = merge(runner, lid, rounded_first=True)
        merged_otherwise = run(runner, [0] * len(ROWS), f"merged{lid}b")
        restore(saved)
        rows = [i for i, x in enumerate(ROWS) if x == lid]
        for phase, name in ((0, "prefill"), (1, "decode")):
            err = rel(mixed[phase][rows], merged[phase][rows])
            effect = rel(merged[phase][rows], base[phase][rows])
            # How far two roundings of the same merged weights land apart: the reference's own noise.
            noise = rel(merged_otherwise[phase][rows], merged[phase][rows]).max().item()
            found[f"rank {rank} {name}"] = (err.max().item(), effect.min().item(), noise)
            assert (err < max(tol, 2 * noise)).all(), (rank, name, err, effect, noise)
            assert (err < effect / 5).all(), (rank, name, err, effect, noise)
            # Base rows of the mixed step against the forward without adapters: as close as the adapter rows.
            base_rows = [i for i, x in enumerate(ROWS) if x == 0]
            drift = rel(mixed[phase][base_rows], base[phase][base_rows]).max().item()
            found[f"base rows {name}"] = drift
            assert drift < max(tol, 2 * noise), (name, drift, noise)
    return found


def test_adapters_of_ranks_8_16_64_on_dummy_8b_under_cuda_graphs_match_the_merged_weights() -> None:
    lora = LoRAConfig(max_loras=len(RANKS), max_lora_rank=max(RANKS))
    config = ModelConfig(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                         attention_backend="flashinfer", lora=lora)  # fmt: skip
    found = check_against_merged(config, CacheConfig(num_pages=256, page_size=PAGE), 5e-2, max_batch_size=16)
    print(json.dumps(found))


def test_adapters_on_fp8_weights_move_the_logits_as_on_bf16_weights() -> None:
    """FP8 projections (quantized at load) with adapters: the delta runs in bf16 beside them. Each
    adapter row of the FP8 model is as close to the bf16 model's row as the FP8 base model is to
    the bf16 base model (twice its largest row error, plus 1e-2). Base rows of the mixed step are
    those of the forward with adapters and no slot used, exactly: with adapters the norms write
    bf16 rows, which the FP8 projections quantize themselves, instead of quantizing them in the
    norm kernel, and that rounds otherwise (on dummy 8B weights, whose flat logits amplify any
    rounding over 32 layers, the two base forwards measured 0.46-0.50 apart on an H200), so the
    FP8 base model is taken through the same forward."""
    lora = LoRAConfig(max_loras=len(RANKS), max_lora_rank=max(RANKS))
    cache = CacheConfig(num_pages=256, page_size=PAGE)
    found = {}
    for quantization in (None, "fp8"):
        config = ModelConfig(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16", device="cuda",
                             attention_backend="flashinfer", quantization=quantization, lora=lora)  # fmt: skip
        runner, mixed, base = mixed_and_base(config, cache, quantization is not None, max_batch_size=16)
        found[quantization] = (mixed, base)
        del runner
        torch.cuda.empty_cache()
    (bf_mixed, bf_base), (fp_mixed, fp_base) = found[None], found["fp8"]
    adapter_rows = [i for i, lid in enumerate(ROWS) if lid]
    for phase in (0, 1):
        fp8_error = rel(fp_base[phase], bf_base[phase]).max().item()
        err = rel(fp_mixed[phase][adapter_rows], bf_mixed[phase][adapter_rows])
        assert (err <= 2 * fp8_error + 1e-2).all(), (phase, err, fp8_error)


def lora_stack(dtype: torch.dtype, device: str, ranks: tuple[int, ...] = (16, 8, 16, 4)) -> Any:
    """A `LoRAStack` of one layer of the Llama-3.1-8B shapes whose slots hold random adapters of
    `ranks` (padded to the largest), the same weights for every dtype."""
    from flashserve.distributed.sharding import ShardLayout
    from flashserve.lora.adapter import LoRAAdapter
    from flashserve.lora.layers import LoRAStack
    from flashserve.model_loader.loader import dummy_hf_config
    from flashserve.models.llama_weights import LlamaSpec

    spec = dataclasses.replace(LlamaSpec.from_hf_config(dummy_hf_config("llama-3.1-8b")), num_layers=1)
    stack = LoRAStack(spec, ShardLayout.for_spec(spec, 0, 1), len(ranks), max(ranks), dtype, device)
    for slot, rank in enumerate(ranks):
        gen = torch.Generator().manual_seed(slot)
        weights = {(0, m): (torch.randn(rank, i, generator=gen) * 0.02, torch.randn(o, rank, generator=gen) * 0.02)
                   for m, (o, i) in module_shapes(spec).items()}  # fmt: skip
        stack.write_slot(slot, LoRAAdapter(slot + 1, f"a{slot}", rank, 1.0, weights))
    return stack


# Each step's slot + 1 per row (0: the base model), over the 4 slots of `lora_stack`.
KERNEL_STEPS = {1: [2], 7: [1, 0, 3, 2, 0, 4, 1], 32: [i % 5 for i in range(32)]}


def test_triton_lora_kernels_give_the_float32_masked_delta_and_leave_base_rows_alone() -> None:
    """The Triton kernels a decode-sized bfloat16 step runs, against the masked GEMMs of a float32
    stack of the same adapters (the reference), for every fused projection at 1, 7 and 32 rows
    over 4 slots and base rows. Tolerance: per adapter row, the delta's relative error under 1e-2
    (x, A, B and the output in bfloat16, 2^-9 each rounding; u in TF32); added into a projection's
    output y it is y + delta to 1e-2, and base rows of y keep their bits."""
    fast, ref = lora_stack(torch.bfloat16, "cuda"), lora_stack(torch.float32, "cuda")
    fast.set_triton_rows(dict.fromkeys(fast.shapes, max(KERNEL_STEPS)))  # every projection, beyond its threshold too
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, slots in KERNEL_STEPS.items():
        token_slots = torch.tensor(slots, device="cuda")
        adapted, base = token_slots > 0, token_slots == 0
        for stack in (fast, ref):
            stack.set_step(token_slots, True)
            stack.begin(rows)
        for kind, (in_f, outs) in fast.shapes.items():
            x = torch.randn(rows, in_f, device="cuda", generator=gen).to(torch.bfloat16)
            y = torch.randn(rows, sum(outs), device="cuda", generator=gen).to(torch.bfloat16)
            assert fast.uses_triton(x, y, kind)
            expected = ref.delta(0, kind, x.float())
            err = rel(fast.delta(0, kind, x)[adapted], expected[adapted])
            assert (err < 1e-2).all(), (kind, rows, err)
            out = fast.apply(0, kind, x, y.clone())
            torch.testing.assert_close(out[base], y[base], atol=0, rtol=0)
            torch.testing.assert_close(out[adapted].float(), (y.float() + expected)[adapted], atol=1e-2, rtol=1e-2)


def test_triton_lora_kernels_in_a_cuda_graph_replay_with_each_steps_slots() -> None:
    """Captured once over the persistent slot buffer, the kernels' graph gives each later step's
    delta (other slots, base rows only, one adapter) bit for bit as the kernels run eagerly."""
    stack = lora_stack(torch.bfloat16, "cuda")
    in_f, outs = stack.shapes["qkv"]
    x = torch.randn(32, in_f, device="cuda").to(torch.bfloat16)
    y = torch.empty(32, sum(outs), device="cuda", dtype=torch.bfloat16)
    stack.set_step(torch.tensor(KERNEL_STEPS[32], device="cuda"), True)
    stack.begin(32)
    assert stack.uses_triton(x, y, "qkv")

    def step() -> None:
        y.zero_()
        stack.apply(0, "qkv", x, y)

    step()  # builds the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slots in ([4 - i % 5 for i in range(32)], [0] * 32, [3] * 32):
        stack.set_step(torch.tensor(slots, device="cuda"), True)
        graph.replay()
        torch.testing.assert_close(y, stack.delta(0, "qkv", x), atol=0, rtol=0)


if __name__ == "__main__":  # a CPU smoke run on a small model
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as d:
        small = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                     max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)  # fmt: skip
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(small, f)
        cpu = ModelConfig(model=os.path.join(d, "config.json"), load_format="dummy", dtype="bfloat16", device="cpu",
                          lora=LoRAConfig(max_loras=len(RANKS), max_lora_rank=max(RANKS)))  # fmt: skip
        print(json.dumps(check_against_merged(cpu, CacheConfig(num_pages=64, page_size=PAGE), 2e-2), indent=1))
