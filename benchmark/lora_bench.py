"""LoRA adapters on one GPU: what they cost a decode step and a prefill, and which kernel applies them.

1. Decode steps of the Llama-3.1-8B shape (dummy bf16 weights, FlashInfer, CUDA graphs): `--batch`
   rows (32) at `--kv-len` (1024), base model alone (LoRA off: the model holds no adapter slots),
   LoRA on (4 slots) with every row on the base model (the graph captured without the adapters,
   as the runner replays it for such steps), every row on one adapter, and the rows
   spread over 4 adapters, of rank `--rank` (16); and one adapter in a stack of one slot
   (`--max-loras 1`: the masked GEMMs' cost grows with the slots, not with the adapters used). The ratios to the base step are the issue's targets (<= 1.1x
   with one adapter, <= 1.2x with four). The steps apply the adapters as `LoRAStack.apply` chooses
   (the Triton kernels on a GPU: column `kernel`); the one- and four-adapter steps run once more
   with the masked GEMMs forced, for the comparison.
2. Prefill: `--prompts` x `--prompt-len` tokens (4 x 512), eager, base against rows spread over 4
   adapters.
3. The adapters' two GEMMs of each projection (fused qkv, o, fused gate_up, down) at 1..512 rows
   over 4 adapters, GPU time from CUDA graphs: the masked torch path (`LoRAStack._apply_masked`:
   every slot's shrink, a mask, every slot's expand), the Triton kernels (`lora/triton_lora.py`,
   which decode steps of up to `TRITON_MAX_TOKENS` rows (per projection) run; measured here at every row count,
   for the threshold), a gather + bmm of each row's adapter, and FlashInfer's `SegmentGEMMWrapper`
   (one segment a row, as a decode step under a graph has them); on a CPU also the per-segment
   path (`LoRAStack._apply_by_segment`). Each adds into the projection's output, as the model does.

    python -m benchmark.lora_bench [--out-dir DIR]        # on a GPU
    python -m benchmark.lora_bench --smoke                # a small model on the CPU, eager

Prints a table and writes lora_bench.json to --out-dir (default: benchmark/results/local/<gpu name>/lora/;
the smoke run: benchmark/results/local/cpu/lora/).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any, Callable

import torch

from benchmark import LOCAL_RESULTS
from benchmark.floor import median_time_s

PAGE = 16
SHAPE = "llama-3.1-8b"
NUM_ADAPTERS = 4


def small_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096)  # fmt: skip


def build_model(device: str, smoke: bool) -> Any:
    from flashserve.model_loader.checkpoint import DummyCheckpoint, load_llama
    from flashserve.model_loader.loader import dummy_hf_config

    config = small_config() if smoke else dummy_hf_config(SHAPE)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return load_llama(DummyCheckpoint(0), config, dtype, device, max_positions=4096, ops="auto" if device == "cuda"
                      else "torch")  # fmt: skip


def random_adapter(spec: Any, lid: int, rank: int) -> Any:
    from flashserve.lora.adapter import LoRAAdapter, module_shapes

    gen = torch.Generator().manual_seed(lid)
    weights = {(layer, m): (torch.randn(rank, i, generator=gen) * 0.02, torch.randn(o, rank, generator=gen) * 0.02)
               for layer in range(spec.num_layers) for m, (o, i) in module_shapes(spec).items()}  # fmt: skip
    return LoRAAdapter(lid, f"a{lid}", rank, 2.0, weights)


def attach(model: Any, rank: int, slots: int = NUM_ADAPTERS, fuse: bool = True) -> Any:
    """A stack of `slots` random adapters on `model`; with `fuse`, as `enable_lora` builds it (on a
    GPU the shrink joins each projection's GEMM: `LoRAStack.fuse_shrink`), else kept apart."""
    from flashserve.lora.layers import LoRAStack

    weight = model.embed_tokens["weight"]
    stack = LoRAStack(model.spec, model.shard, slots, rank, weight.dtype, weight.device)
    for slot in range(slots):
        stack.write_slot(slot, random_adapter(model.spec, slot + 1, rank))
    if fuse and max(stack.triton_rows.values()):
        stack.fuse_shrink(model.layers)
    model.lora = stack
    return stack


def backend_for(model: Any, num_pages: int, device: str) -> Any:
    from flashserve.attention import get_backend_cls

    s = model.spec

    name = "flashinfer" if device == "cuda" else "torch"
    dtype = model.embed_tokens["weight"].dtype
    return get_backend_cls(name)(s.num_layers, num_pages, PAGE, s.num_kv_heads, s.head_dim, dtype, device, None,
                                 num_qo_heads=s.num_heads)  # fmt: skip


def slots_of(rows: int, case: str, device: str) -> torch.Tensor:
    """Each row's slot + 1 for a case: base (0), one adapter (1), four (1..4 in turn)."""
    if case == "base rows":
        values = [0] * rows
    elif case.startswith("1 adapter"):
        values = [1] * rows
    else:
        values = [1 + i % NUM_ADAPTERS for i in range(rows)]
    return torch.tensor(values, dtype=torch.long, device=device)


def bench_decode(model: Any, args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    """Every case's step built first (its stack, KV and graphs kept), then timed in `--rounds`
    interleaved rounds: each case's time is its median over rounds and its ratio the median of
    each round's ratio to that round's base step (a GPU's clocks drift by a few percent)."""
    from benchmark.decode_bench import decode_layout
    from flashserve.models.native import NativeCausalLM

    b = args.batch
    num_pages = 1 + b * ((args.kv_len + PAGE - 1) // PAGE)
    layout = decode_layout(b, args.kv_len)
    ids = torch.randint(0, model.spec.vocab_size, (b,), device=device)
    pos = torch.tensor(layout.positions, device=device)
    four = f"{NUM_ADAPTERS} adapters"
    # (stack: None for LoRA off, else (slots, fused, masked)), then its cases.
    setups = [(None, ("base model, LoRA off",)), ((NUM_ADAPTERS, True, False), ("base rows", "1 adapter", four)),
              ((1, True, False), ("1 adapter, 1 slot",)),
              ((NUM_ADAPTERS, False, False), ("1 adapter, apart", f"{four}, apart")),
              ((NUM_ADAPTERS, False, True), ("1 adapter, masked", f"{four}, masked"))]  # fmt: skip
    built = []  # (case, kernel, stack, run, what the graphs read: kept alive)
    for config, cases in setups:
        model.lora = stack = None
        if config is not None:
            slots, fuse, masked = config
            stack = attach(model, args.rank, slots, fuse=fuse)
            if masked:
                stack.set_triton_rows({})  # as a stack without Triton: the masked GEMMs at every size
        keep = [p for layer in model.layers for p in layer.parameters()]
        backend = backend_for(model, num_pages, device)
        native = NativeCausalLM(model)
        step = native.decode_logits(backend)
        graphs = None
        if device == "cuda":  # as the runner captures them: with the adapters, and without for base rows
            from flashserve.worker.cuda_graph import CudaGraphRunner

            graphs = CudaGraphRunner(step, backend, [b], plain_forward=native.plain_decode_logits(backend))
            graphs.capture()
        for case in cases:
            plain = case == "base rows"
            if graphs is not None:
                run: Callable[[], Any] = functools.partial(graphs, ids, pos, layout, plain=plain)
            else:
                eager = native.plain_decode_logits(backend) if plain else step
                assert eager is not None
                run = functools.partial(lambda f, be: (be.plan(layout), f(ids, pos)), eager, backend)
            kernel = "none"
            if stack is not None and not plain:
                triton = sorted(k for k, n in stack.triton_rows.items() if b <= n)
                kernel = f"triton: {', '.join(triton)}" if triton else "torch"
                kernel += ", shrink in the GEMM" if stack.fused is not None else ""
            built.append((case, kernel, stack, run, (keep, backend, graphs)))
    times: dict[str, list[float]] = {case: [] for case, *_ in built}
    for _ in range(args.rounds):
        for case, _, stack, run, _ in built:
            if stack is not None:
                stack.set_step(slots_of(b, case, device), True)
            times[case].append(median_time_s(run, device, args.warmup, args.iters) * 1e3)
    base = times[built[0][0]]
    rows = []
    for case, kernel, *_ in built:
        rows.append({"case": case, "kernel": kernel, "batch": b, "kv_len": args.kv_len, "rank": args.rank,
                     "step_ms": statistics.median(times[case]), "rounds_ms": times[case],
                     "x_base": statistics.median(t / t0 for t, t0 in zip(times[case], base))})  # fmt: skip
    model.lora = None
    return rows


def bench_prefill(model: Any, args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    from benchmark.decode_bench import prefill_layout

    n, length = args.prompts, args.prompt_len
    layout = prefill_layout(n, length)
    num_pages = 1 + n * ((length + PAGE - 1) // PAGE)
    ids = torch.randint(0, model.spec.vocab_size, (n * length,), device=device)
    pos = torch.tensor(layout.positions, device=device)
    rows = []
    for case in ("base model, LoRA off", f"{NUM_ADAPTERS} adapters"):
        model.lora = None
        if case != "base model, LoRA off":
            attach(model, args.rank).set_step(slots_of(n * length, case, device), True)
        backend = backend_for(model, num_pages, device)
        last = torch.arange(length - 1, n * length, length, device=device)

        def run() -> Any:
            backend.plan(layout)
            return model.compute_logits(model(ids, pos, backend)[last])

        with torch.inference_mode():
            ms = median_time_s(run, device, max(1, args.warmup // 4), max(3, args.iters // 4)) * 1e3
        rows.append({"case": case, "prompts": n, "prompt_len": length, "rank": args.rank, "prefill_ms": ms})
    rows[1]["x_base"] = rows[1]["prefill_ms"] / rows[0]["prefill_ms"]
    model.lora = None
    return rows


def segment_gemm() -> Any:
    try:
        import flashinfer
    except ImportError:
        return None
    workspace = torch.empty(128 << 20, dtype=torch.int8, device="cuda")
    return flashinfer.SegmentGEMMWrapper(workspace)


def graph_or_eager_us(fn: Callable[[], Any], device: str, args: argparse.Namespace) -> float:
    if device != "cuda":
        return median_time_s(fn, device, args.warmup, args.iters) * 1e6
    from benchmark.fp8_bench import graph_us

    return graph_us(fn, args.warmup, args.iters)


def bench_kernels(model: Any, args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    """The adapters' GEMMs of layer 0's projections, four ways."""
    from flashserve.lora import triton_lora
    from flashserve.lora.layers import PROJECTION

    stack = attach(model, args.rank)
    if max(stack.triton_rows.values()):  # the kernels at every row count here, beyond the thresholds too
        stack.set_triton_rows(dict.fromkeys(stack.shapes, max(args.kernel_rows)))
    layer0 = model.layers[0]
    seg = segment_gemm() if device == "cuda" and not args.no_segment_gemm else None
    rows = []
    for kind, (in_f, outs) in stack.shapes.items():
        n = len(outs)
        width = n * stack.max_rank
        a_all, b_all = stack.a[kind][0], stack.b[kind][0]
        # Per slot, plus an all-zero slot for base rows: A [S+1, n*R, in], B [S+1, out, n*R].
        a_w = torch.cat([a_all.view(NUM_ADAPTERS, width, in_f), a_all.new_zeros(1, width, in_f)])
        b_w = torch.cat([b_all.view(sum(outs), NUM_ADAPTERS, width).permute(1, 0, 2),
                         b_all.new_zeros(1, sum(outs), width)]).contiguous()  # fmt: skip
        for t in args.kernel_rows:
            x = torch.randn(t, in_f, dtype=a_all.dtype, device=device)
            slots = slots_of(t, f"{NUM_ADAPTERS} adapters", device)
            stack.set_step(slots, True)
            stack.segments = None  # the masked GEMMs, as on a GPU
            stack.mask = stack._build_mask(t)  # once a forward, as `begin` builds it for the masked GEMMs
            index = stack.token_slots(t) - 1  # 0..S-1 here (no base rows)
            r: dict[str, Any] = {"projection": kind, "rows": t, "rank": args.rank, "adapters": NUM_ADAPTERS}
            y = torch.zeros(t, sum(outs), dtype=a_all.dtype, device=device)
            r["torch_masked_us"] = graph_or_eager_us(lambda: stack._apply_masked(0, kind, x, y), device, args)
            if stack.fused is not None:  # the shrink in the projection's GEMM: what the adapters add to it
                proj = getattr(layer0, PROJECTION[kind]).args
                base_us = graph_or_eager_us(lambda: torch.nn.functional.linear(x, proj[0]), device, args)
                r["fused_triton_us"] = graph_or_eager_us(lambda: stack.project(0, kind, x, proj), device, args) - base_us
                keep, stack.triton_rows[kind] = stack.triton_rows[kind], 0
                r["fused_masked_us"] = graph_or_eager_us(lambda: stack.project(0, kind, x, proj), device, args) - base_us
                stack.triton_rows[kind] = keep
                if kind == "gate_up":  # with SiLU-and-mul after it (the expand's own, or the model's kernel)
                    silu = model.ops.silu_and_mul
                    base_act_us = graph_or_eager_us(lambda: silu(torch.nn.functional.linear(x, proj[0])), device, args)
                    r["fused_silu_us"] = graph_or_eager_us(lambda: stack.project(0, kind, x, proj, silu), device,
                                                           args) - base_act_us  # fmt: skip
                torch.testing.assert_close(stack.project(0, kind, x, proj).float(),
                                           stack._apply_masked(0, kind, x, torch.nn.functional.linear(x, proj[0])).float(),
                                           atol=2e-2, rtol=2e-2)  # fmt: skip
            if stack.uses_triton(x, y, kind):
                try:
                    y.zero_()
                    torch.testing.assert_close(stack._apply_triton(0, kind, x, y).float(),
                                               stack._apply_masked(0, kind, x, torch.zeros_like(y)).float(),
                                               atol=2e-2, rtol=2e-2)  # fmt: skip
                    r["triton_us"] = graph_or_eager_us(lambda: stack._apply_triton(0, kind, x, y), device, args)
                except Exception as exc:  # noqa: BLE001 - one failing path must not end the benchmark
                    r["triton_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if device == "cpu":  # each adapter's rows through its own slot (the CPU's choice for longer steps)
                segs = [(s, (slots == s + 1).nonzero().squeeze(1)) for s in range(NUM_ADAPTERS)]
                r["torch_per_segment_us"] = graph_or_eager_us(lambda: stack._apply_by_segment(0, kind, x, y, segs),
                                                              device, args)  # fmt: skip

            def gather_bmm() -> Any:
                u = torch.bmm(a_w.index_select(0, index), x.unsqueeze(-1))  # [T, nR, 1]
                return y + torch.bmm(b_w.index_select(0, index), u).squeeze(-1)

            r["torch_gather_bmm_us"] = graph_or_eager_us(gather_bmm, device, args)
            if seg is not None:
                indptr = torch.arange(t + 1, dtype=torch.int64, device=device)

                def segmented() -> Any:
                    u = seg.run(x, a_w, t, True, seg_indptr=indptr, weight_indices=index)
                    return y + seg.run(u, b_w, t, True, seg_indptr=indptr, weight_indices=index)

                try:
                    y.zero_()
                    torch.testing.assert_close(segmented().float(), stack.delta(0, kind, x).float(), atol=2e-2,
                                               rtol=2e-2)  # fmt: skip
                    r["segment_gemm_us"] = graph_or_eager_us(segmented, device, args)
                except Exception as exc:  # noqa: BLE001 - one failing path must not end the benchmark
                    r["segment_gemm_error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(r)
            print("  kernels " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}),
                  flush=True)  # fmt: skip
    model.lora = None
    return rows


def table(results: dict[str, Any]) -> str:
    lines = [f"LoRA on {results['device']} ({results['model']}), rank {results['rank']}", "",
             "decode step                        ms     x base  kernel"]  # fmt: skip
    for r in results["decode"]:
        lines.append(f"  {r['case']:<30} {r['step_ms']:8.3f}   {r['x_base']:.3f}  {r.get('kernel', '')}")
    lines += ["", "prefill                      ms     x base"]
    for r in results["prefill"]:
        lines.append(f"  {r['case']:<24} {r['prefill_ms']:8.3f}   {r.get('x_base', 1.0):.3f}")
    lines += ["", "the shrink in the projection's GEMM: what the adapters add to it (us)", "  projection   rows  expand kernel  mask + addmm"]
    for r in results["kernels"]:
        if "fused_triton_us" in r:
            silu = f"   (with SiLU-and-mul: {r['fused_silu_us']:.1f})" if "fused_silu_us" in r else ""
            lines.append(f"  {r['projection']:<12} {r['rows']:4d} {r['fused_triton_us']:14.1f} {r['fused_masked_us']:12.1f}{silu}")
    lines += ["", "adapter GEMMs apart (us)   rows  masked  triton  gather+bmm  segment_gemm  per_segment (CPU)"]
    for r in results["kernels"]:
        seg, per = r.get("segment_gemm_us", r.get("segment_gemm_error")), r.get("torch_per_segment_us")
        tri = f"{r['triton_us']:7.1f}" if "triton_us" in r else "  error" if "triton_error" in r else "      -"
        lines.append(f"  {r['projection']:<18} {r['rows']:4d} {r['torch_masked_us']:8.1f} {tri} {r['torch_gather_bmm_us']:10.1f}"
                     f"  {seg if not isinstance(seg, float) else round(seg, 1)}  {per if per is None else round(per, 1)}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a small model on the CPU (eager)")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--kv-len", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--kernel-rows", type=int, nargs="+", default=[1, 8, 32, 128, 256, 512])
    parser.add_argument("--no-segment-gemm", action="store_true",
                        help="leave FlashInfer's SegmentGEMMWrapper out (its module builds for minutes on a fresh machine)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the decode steps")
    args = parser.parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        args.batch, args.kv_len, args.prompts, args.prompt_len = min(args.batch, 8), min(args.kv_len, 64), 2, 64
        args.kernel_rows, args.warmup, args.iters, args.rounds = [1, 8, 32], 2, 5, 2
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    default_dir = LOCAL_RESULTS / (re.sub(r"[^A-Za-z0-9._-]+", "_", gpu) if device == "cuda" else "cpu") / "lora"
    out_dir = Path(args.out_dir) if args.out_dir else default_dir
    model = build_model(device, args.smoke or device == "cpu")
    results: dict[str, Any] = {"device": gpu, "model": SHAPE if device == "cuda" else "small (smoke)",
                               "rank": args.rank, "adapters": NUM_ADAPTERS, "args": vars(args)}  # fmt: skip
    with torch.inference_mode():
        results["decode"] = bench_decode(model, args, device)
        results["prefill"] = bench_prefill(model, args, device)
        results["kernels"] = bench_kernels(model, args, device)
    text = table(results)
    print(text)
    os.makedirs(out_dir, exist_ok=True)
    path = out_dir / "lora_bench.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
