"""FP8 against bfloat16 on one GPU, with the floors measured in the same run.

1. GEMMs: each Llama-3.1-8B projection shape (fused qkv, o, fused gate_up, down) at 1..512 rows,
   GPU time per call replayed from CUDA graphs: bfloat16 `F.linear`, the FP8 layer (per-token
   activation quantization + row-wise `torch._scaled_mm`), `_scaled_mm` alone on quantized
   operands, the quantization alone, and the weight-read floors; the FP8 layer eagerly as well.
   The one-row GEMV (`--skip` it as `gemv`): each 8B and 70B (TP 2, TP 4) per-rank projection at
   one row, FP8 weights times the unquantized bfloat16 row (gate_up also with SiLU-and-mul
   fused), against the quantize + bmm_fp8 + scale path it replaces, bfloat16 and the floor;
   `--sweep` times its configurations.
2. Decode steps of the Llama-3.1-8B shape (dummy weights) from CUDA graphs: bfloat16, FP8 weights,
   FP8 weights + FP8 KV cache, against the weight(+KV)-read floors of bfloat16 (~16 GB) and FP8
   (~8 GB) at the measured copy bandwidth. `--kernels`: the smallest batch's step kernel by kernel
   (torch.profiler over graph replays: launches and GPU time per kernel name).
3. Accuracy on the same shape (`--accuracy-layers` of its layers): FP8 weights against the
   bfloat16 model holding the same dequantized weights, per layer (each layer's attention output)
   and final logits over a teacher-forced sequence, with greedy (argmax) agreement; and an FP8 KV
   cache against a bfloat16 one (prefill, then decode steps). Dummy weights: the figures measure
   the numerics, not a trained model's quality.

    python -m benchmark.fp8_bench [--out-dir DIR] [--batches 1 8 32]

Writes fp8_bench.json to --out-dir (default: benchmark/results/local/<gpu name>/) and prints a summary.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from benchmark import LOCAL_RESULTS
from benchmark.decode_bench import decode_layout, prefill_layout, time_ms
from benchmark.floor import measure_rates

SHAPE = "llama-3.1-8b"
GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PAGE = 16


def graph_us(fn: Callable[[], Any], warmup: int, iters: int, reps: int = 20) -> float:
    """GPU time of one call, from a CUDA graph of `reps` calls: no launch overhead (a decode step
    replays its projections from a graph too)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return time_ms(graph.replay, warmup, iters) * 1e3 / reps


def bench_gemms(bw: float, warmup: int, iters: int, gemm_rows: Sequence[int] = GEMM_ROWS) -> list[dict[str, Any]]:
    from flashserve.layers.fp8 import quantize_rows, quantize_weight_per_channel, scale_rows_cols
    from flashserve.layers.fp8_gemm import SMALL_M, fp8_gemm_small_m, fp8_linear

    rows: list[dict[str, Any]] = []
    bmm_fp8 = flashinfer_bmm_fp8()
    for name, (n, k) in GEMM_SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight_per_channel(w)
        ws = ws.view(1, -1)
        for m in gemm_rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            r: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m,
                                 "floor_bf16_us": 2 * n * k / bw * 1e6, "floor_fp8_us": n * k / bw * 1e6}
            r["bf16_us"] = graph_us(lambda: F.linear(x, w), warmup, iters)
            r["fp8_layer_us"] = graph_us(lambda: fp8_linear(x, wq, None, ws, None), warmup, iters)
            r["scaled_mm_us"] = graph_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                                                  out_dtype=torch.bfloat16), warmup, iters)
            r["quantize_us"] = graph_us(lambda: quantize_rows(x), warmup, iters)
            # Both layer paths at every m (fp8_linear takes bmm_fp8 up to SMALL_M rows, _scaled_mm above;
            # the latter as the sum of its two kernels).
            r["layer_scaled_mm_us"] = r["quantize_us"] + r["scaled_mm_us"]
            if bmm_fp8 is not None:
                try:
                    y = bmm_fp8(xq, wq)
                    r["epilogue_us"] = graph_us(lambda: scale_rows_cols(y, xs, ws, None), warmup, iters)
                    r["layer_bmm_fp8_us"] = graph_us(lambda: fp8_gemm_small_m(*quantize_rows(x), wq, ws, None),
                                                     warmup, iters)
                except Exception as exc:  # noqa: BLE001 - recorded; the other columns stand
                    r["layer_bmm_fp8_error"] = f"{type(exc).__name__}: {exc}"[:200]
            r["layer_path"] = "bmm_fp8" if m <= SMALL_M and bmm_fp8 is not None else "scaled_mm"
            r["fp8_layer_eager_us"] = time_ms(lambda: fp8_linear(x, wq, None, ws, None), warmup, iters) * 1e3
            if bmm_fp8 is not None:  # per-tensor scales: the speed of FlashInfer's (cuBLASLt) FP8 GEMM
                try:
                    r["flashinfer_bmm_fp8_us"] = graph_us(lambda: bmm_fp8(xq, wq), warmup, iters)
                except Exception as exc:  # noqa: BLE001 - recorded; the other columns stand
                    r["flashinfer_bmm_fp8_error"] = f"{type(exc).__name__}: {exc}"[:200]
                    bmm_fp8 = None
            r["speedup"] = r["bf16_us"] / r["fp8_layer_us"]
            rows.append(r)
            print("  gemm " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
        del w, wq
    return rows


# Per-rank projection shapes (N, K) the one-row FP8-weight GEMV serves at decode: the 8B on one GPU,
# the 70B's at TP 2 and TP 4.
GEMV_SHAPES = {
    "8b": GEMM_SHAPES,
    "70b-tp2": {"qkv": (5120, 8192), "o": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)},
    "70b-tp4": {"qkv": (2560, 8192), "o": (8192, 2048), "gate_up": (14336, 8192), "down": (8192, 7168)},
}


def gemv_configs() -> list[tuple[int, int, int]]:
    """The (BLOCK_N, BLOCK_K, warps) `--sweep` times (the float32 partial products [BLOCK_N,
    BLOCK_K], two of them gated, must fit the registers)."""
    return [(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024, 2048) for w in (2, 4, 8)
            if 32 * w <= bn * bk <= 64 * 32 * w]


def gemv_fits(cfg: tuple[int, int, int], gated: bool) -> bool:
    return not gated or cfg[0] * cfg[1] <= 32 * 32 * cfg[2]


def gemv_table(rows: list[dict[str, Any]]) -> tuple[dict[tuple[int, int, bool], tuple], tuple]:
    """From a sweep: the fastest configuration per (N, K, gated), and the default for other shapes,
    the configuration (valid gated too) whose worst slowdown against a shape's fastest is least."""
    table, slowdowns = {}, {}
    for r in rows:
        timed = [(t["us"], tuple(t["config"])) for t in r.get("timed", [])]
        if not timed:
            continue
        best = timed[0][0]
        table[(r["n"], r["k"], r["shape"].endswith("+silu"))] = timed[0][1]
        for us, cfg in timed:
            slowdowns.setdefault(cfg, []).append(us / best)
    full = [c for c, v in slowdowns.items() if len(v) == len(table) and gemv_fits(c, True)]
    default = min(full, key=lambda c: max(slowdowns[c])) if full else ()
    return table, default


def write_gemv_table(rows: list[dict[str, Any]], gpu: str) -> str:
    """Writes the sweep's table into `layers/fp8_gemm.py` (`_GEMV_TUNED`, `_GEMV_DEFAULT`); returns it."""
    table, default = gemv_table(rows)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "flashserve", "layers",
                        "fp8_gemm.py")
    lines = "".join(f"    {key}: {cfg},\n" for key, cfg in sorted(table.items()))
    src = open(path).read()
    src = re.sub(r"(_GEMV_TUNED: dict\[tuple\[int, int, bool\], WeightGemvConfig\] = )\{.*?\}\n",
                 lambda m: m.group(1) + "{\n" + lines + "}\n", src, count=1, flags=re.S)
    src = re.sub(r"_GEMV_DEFAULT: WeightGemvConfig = .*\n", f"_GEMV_DEFAULT: WeightGemvConfig = {default}\n", src,
                 count=1)
    src = re.sub(r"(# --sweep` on )an? [^\n]*?( for each per-rank)", rf"\1{gpu}\2", src, count=1)
    with open(path, "w") as f:
        f.write(src)
    return lines + f"default {default}"


def bench_weight_gemv(bw: float, warmup: int, iters: int, sweep: bool) -> list[dict[str, Any]]:
    """One row through each decode projection shape: the FP8-weight GEMV (`weight_gemv_config`; for
    gate_up also gated, writing silu(gate) * up) against the weight-read floor, bfloat16 `F.linear`
    and the quantizing layer path (quantize, bmm_fp8, scale); `sweep`: every configuration of
    `gemv_configs`, all kept, fastest first. Each call of a captured run reads the next of enough
    weight copies to exceed twice the L2 cache, so that weights come from HBM, as in a decode step
    (one copy replayed would stay in L2 for shapes under its size and beat the HBM floor)."""
    from flashserve.layers.fp8 import quantize_rows, quantize_weight_per_channel
    from flashserve.layers.fp8_gemm import fp8_gemm_small_m, fp8_weight_gemv, weight_gemv_config

    rows: list[dict[str, Any]] = []
    bmm_fp8 = flashinfer_bmm_fp8()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for model, shapes in GEMV_SHAPES.items():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            wq, ws = quantize_weight_per_channel(w)
            ws = ws.view(1, -1)
            copies = 2 * l2 // (n * k) + 2
            wqs, bf16s = [wq] + [wq.clone() for _ in range(copies - 1)], [w] + [w.clone() for _ in range(copies - 1)]
            turn = itertools.count()

            def rotating(fn: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> Callable[[], Any]:
                return lambda: fn(weights[next(turn) % len(weights)])

            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            for gated in (False, True) if name == "gate_up" else (False,):
                r: dict[str, Any] = {"model": model, "shape": name + ("+silu" if gated else ""), "n": n, "k": k,
                                     "floor_fp8_us": n * k / bw * 1e6, "config": weight_gemv_config(n, k, gated),
                                     "weight_copies": copies}
                r["gemv_us"] = graph_us(rotating(lambda q: fp8_weight_gemv(x, q, ws, None, gated), wqs), warmup, iters)
                r["x_floor"] = r["gemv_us"] / r["floor_fp8_us"]
                if not gated:
                    r["bf16_us"] = graph_us(rotating(lambda b: F.linear(x, b), bf16s), warmup, iters)
                    if bmm_fp8 is not None:
                        r["layer_bmm_fp8_us"] = graph_us(
                            rotating(lambda q: fp8_gemm_small_m(*quantize_rows(x), q, ws, None), wqs), warmup, iters)
                if sweep:
                    timed = [(graph_us(rotating(lambda q: fp8_weight_gemv(x, q, ws, None, gated, cfg), wqs), 2, 5), cfg)
                             for cfg in gemv_configs() if gemv_fits(cfg, gated)]
                    r["timed"] = [{"us": t, "config": c} for t, c in sorted(timed)]
                rows.append(r)
                print("  gemv " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()
                                              if k != "timed"}), flush=True)
            del w, wq, wqs, bf16s
    return rows


def flashinfer_bmm_fp8() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """`(x_q [M, K], w_q [N, K]) -> [M, N]` through `flashinfer.bmm_fp8` with unit per-tensor
    scales, or None without FlashInfer."""
    try:
        import flashinfer
    except ImportError:
        return None
    one = torch.ones((), dtype=torch.float32, device="cuda")
    return lambda xq, wq: flashinfer.bmm_fp8(xq[None], wq.t()[None], one, one, torch.bfloat16)[0]


def build(quantization: str | None, layers: int = 0) -> Any:
    from flashserve.model_loader.checkpoint import DummyCheckpoint, load_llama
    from flashserve.model_loader.loader import dummy_hf_config

    config = dummy_hf_config(SHAPE)
    if layers:
        config.num_hidden_layers = layers
    return load_llama(DummyCheckpoint(0), config, torch.bfloat16, "cuda", max_positions=4096, quantization=quantization)


def weight_bytes(model: Any) -> int:
    """Bytes a decode step reads: every projection and the LM head, norms (not the embedding)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("embed_tokens")) + (
        model.lm_head_weight.numel() * model.lm_head_weight.element_size() if model.spec.tie_word_embeddings else 0)


def backend_for(model: Any, num_pages: int, kv_dtype: torch.dtype | None, fused_decode: bool = False) -> Any:
    from flashserve.attention.flashinfer import FlashInferAttentionBackend

    s = model.spec
    return FlashInferAttentionBackend(s.num_layers, num_pages, PAGE, s.num_kv_heads, s.head_dim, torch.bfloat16, "cuda",
                                      None, num_qo_heads=s.num_heads, kv_cache_dtype=kv_dtype, fused_decode=fused_decode)


def bench_decode(model: Any, label: str, kv_dtype: torch.dtype | None, args: argparse.Namespace, bw: float) -> list[dict]:
    from flashserve.worker.cuda_graph import CudaGraphRunner

    spec = model.spec
    num_pages = 1 + max(args.batches) * ((args.kv_len + PAGE - 1) // PAGE)
    backend = backend_for(model, num_pages, kv_dtype, args.fused_decode)
    graphs = CudaGraphRunner(lambda ids, pos: model.compute_logits(model(ids, pos, backend)), backend, args.batches)
    graphs.capture()
    kv_token_bytes = 2 * spec.num_layers * spec.kv_size * (1 if kv_dtype is not None else 2)
    wbytes = weight_bytes(model)
    rows = []
    for b in args.batches:
        layout = decode_layout(b, args.kv_len)
        ids = torch.randint(0, spec.vocab_size, (b,), device="cuda")
        pos = torch.tensor(layout.positions, device="cuda")
        floor = (wbytes + b * args.kv_len * kv_token_bytes) / bw * 1e3
        ms = time_ms(lambda: graphs(ids, pos, layout), args.warmup, args.iters)
        rows.append({"model": label, "fused_decode": args.fused_decode, "batch": b, "kv_len": args.kv_len,
                     "graph_ms": ms, "floor_ms": floor,
                     "x_floor": ms / floor, "weight_bytes": wbytes})
        if args.kernels and b == min(args.batches):
            rows[-1]["kernels"] = step_kernels(lambda: graphs(ids, pos, layout))
        print("  decode " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}),
              flush=True)
    del graphs, backend
    return rows


def step_kernels(step: Callable[[], Any], replays: int = 5) -> dict[str, Any]:
    """The kernels of one step replayed from its CUDA graph (torch.profiler): per kernel name, launches
    and GPU us a step, largest first, and their sum against the step's time."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        if us > 0 and e.count:
            kernels.append({"name": e.key[:120], "launches": e.count / replays, "us": us / replays})
    kernels.sort(key=lambda k: -k["us"])
    total = sum(k["us"] for k in kernels)
    print(f"  kernels of one step: {sum(k['launches'] for k in kernels):.0f} launches, {total / 1e3:.3f} ms of GPU time")
    for k in kernels[:25]:
        print(f"    {k['us']:9.1f} us  {k['launches']:6.0f}x  {k['name']}")
    return {"launches": sum(k["launches"] for k in kernels), "gpu_ms": total / 1e3, "by_name": kernels}


class Recorder:
    """A backend that records each layer's attention output (float32, on the device)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.outputs = inner, []

    def plan(self, layout: Any) -> None:
        self.outputs = []
        self.inner.plan(layout)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.inner.forward(layer, q, k, v)
        self.outputs.append(out.float())
        return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def forced(model: Any, kv_dtype: torch.dtype | None, tokens: torch.Tensor, prompt: int) -> tuple[torch.Tensor, list]:
    """Logits of every position of `tokens`: a prefill of `prompt` tokens then one decode step per
    further token; and the per-layer attention outputs of the prefill."""
    n = tokens.numel()
    backend = Recorder(backend_for(model, 2 + n // PAGE, kv_dtype))
    layout = prefill_layout(1, prompt)
    backend.plan(layout)
    logits = [model.compute_logits(model(tokens[:prompt], torch.arange(prompt, device="cuda"), backend))]
    layers = backend.outputs
    for t in range(prompt, n):
        step = decode_layout(1, t + 1)
        backend.plan(step)
        logits.append(model.compute_logits(model(tokens[t : t + 1], torch.tensor([t], device="cuda"), backend)))
    return torch.cat(logits), layers


def dequantized(model: Any) -> Any:
    """A bfloat16 copy of an FP8 model with the same (dequantized) projection weights."""
    from flashserve.layers.fp8 import dequantize_weight
    from flashserve.models.llama import LlamaModel

    state = {}
    for name, t in model.state_dict().items():
        if name.endswith("weight_scale") or name.endswith("input_scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_weight(t, model.state_dict()[name + "_scale"].view(-1), torch.bfloat16)
        state[name] = t
    with torch.device("meta"):
        dense = LlamaModel(model.spec, model.ops)
    dense.load_state_dict(state, assign=True)
    dense.cos_sin_cache = model.cos_sin_cache
    return dense


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    fp8 = build("fp8", args.accuracy_layers)
    bf16 = dequantized(fp8)
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, fp8.spec.vocab_size, (args.accuracy_len,), device="cuda", generator=gen)
    prompt = args.accuracy_len - args.accuracy_decode
    out: dict[str, Any] = {"layers": fp8.spec.num_layers, "tokens": args.accuracy_len, "decode_steps": args.accuracy_decode}
    base, base_layers = forced(bf16, None, tokens, prompt)
    for label, model, kv in (("fp8_weights", fp8, None), ("fp8_kv", bf16, torch.float8_e4m3fn),
                             ("fp8_weights_and_kv", fp8, torch.float8_e4m3fn)):
        logits, layers = forced(model, kv, tokens, prompt)
        out[label] = {
            "final_logits_rel_err": rel(logits, base),
            "worst_row_rel_err": ((logits - base).norm(dim=-1) / base.norm(dim=-1)).max().item(),
            "greedy_agreement": (logits.argmax(-1) == base.argmax(-1)).float().mean().item(),
            "per_layer_attention_rel_err": [round(rel(a, b), 5) for a, b in zip(layers, base_layers)],
        }
        print(f"  accuracy {label}: " + json.dumps({k: v for k, v in out[label].items() if k != "per_layer_attention_rel_err"}),
              flush=True)
    del fp8, bf16
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--gemm-rows", nargs="+", type=int, default=list(GEMM_ROWS),
                   help="rows of the GEMM table (prefill sizes, e.g. 2048 8192, compare its two layer paths there)")
    p.add_argument("--kv-len", type=int, default=512)
    p.add_argument("--fused-decode", action="store_true",
                   help="the decode steps with the backend's fused_decode (RoPE in the KV append, Triton decode)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--accuracy-layers", type=int, default=8, help="layers of the 8B shape in the accuracy report (0: all)")
    p.add_argument("--accuracy-len", type=int, default=384)
    p.add_argument("--accuracy-decode", type=int, default=64)
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["gemm", "gemv", "decode_bf16", "decode_fp8", "decode_fp8+fp8kv", "accuracy"])
    p.add_argument("--sweep", action="store_true",
                   help="gemv: time every configuration of the one-row FP8-weight GEMV")
    p.add_argument("--write-gemv-table", action="store_true",
                   help="with --sweep: write its fastest configurations into src/flashserve/layers/fp8_gemm.py")
    p.add_argument("--kernels", action="store_true",
                   help="profile the smallest batch's decode step: its kernels, launches and GPU time by name")
    p.add_argument("--out-dir", default=None, help="default: benchmark/results/local/<gpu name>/")
    args = p.parse_args()
    gpu = torch.cuda.get_device_name()
    args.out_dir = args.out_dir or os.path.join(LOCAL_RESULTS, re.sub(r"[^A-Za-z0-9._-]+", "_", gpu))
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "fp8_bench.json")
    results: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__}

    def save() -> None:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    def section(name: str, fn: Callable[[], Any]) -> None:
        if name in args.skip:
            return
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failing section must not lose the others
            results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:500]
            print(f"  {name} failed: {results['errors'][name]}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        save()

    with torch.inference_mode():
        rates = measure_rates("cuda")
        bw = rates.copy_bytes_per_s
        results.update(copy_GBps=bw / 1e9, matmul_TFLOPs=rates.matmul_flop_per_s / 1e12)
        print(f"{results['gpu']}: copy {bw / 1e9:.0f} GB/s", flush=True)
        section("gemm", lambda: bench_gemms(bw, args.warmup, args.iters, args.gemm_rows))
        section("gemv", lambda: bench_weight_gemv(bw, args.warmup, args.iters, args.sweep))
        if args.sweep and args.write_gemv_table and results.get("gemv"):
            print("gemv table written:\n" + write_gemv_table(results["gemv"], gpu), flush=True)

        for label, quant, kv in (("bf16", None, None), ("fp8", "fp8", None), ("fp8+fp8kv", "fp8", torch.float8_e4m3fn)):
            section(f"decode_{label}", lambda: bench_decode(build(quant), label, kv, args, bw))
        section("accuracy", lambda: accuracy(args))
    summary(results)


def summary(results: dict[str, Any]) -> None:
    print(f"\n{results['gpu']}, copy {results.get('copy_GBps', 0):.0f} GB/s")
    for r in results.get("gemm", []):
        print(f"gemm {r['shape']:8} m={r['m']:4d}: bf16 {r['bf16_us']:8.1f} us  fp8 {r['fp8_layer_us']:8.1f} us "
              f"(scaled_mm {r['scaled_mm_us']:7.1f}, quantize {r['quantize_us']:5.1f}, flashinfer bmm_fp8 "
              f"{r.get('flashinfer_bmm_fp8_us') or 0:7.1f}, epilogue {r.get('epilogue_us') or 0:5.1f}; layer via "
              f"bmm_fp8 {r.get('layer_bmm_fp8_us') or 0:6.1f} / scaled_mm {r['layer_scaled_mm_us']:6.1f}, runs "
              f"{r['layer_path']})  x{r['speedup']:.2f}  "
              f"floors bf16 {r['floor_bf16_us']:.1f} / fp8 {r['floor_fp8_us']:.1f} us")
    for r in results.get("gemv", []):
        print(f"gemv {r['model']:8} {r['shape']:13}: {r['gemv_us']:6.1f} us ({r['x_floor']:.2f}x floor "
              f"{r['floor_fp8_us']:5.1f}), bf16 {r.get('bf16_us') or 0:6.1f}, quantize + bmm_fp8 + scale "
              f"{r.get('layer_bmm_fp8_us') or 0:5.1f}, config {r['config']}"
              + (f", fastest {r['timed'][0]['us']:.1f} {tuple(r['timed'][0]['config'])}" if r.get("timed") else ""))
    for r in [r for key in ("decode_bf16", "decode_fp8", "decode_fp8+fp8kv") for r in results.get(key) or []]:
        print(f"decode {r['model']:10} b={r['batch']:4d}: {r['graph_ms']:7.3f} ms, floor {r['floor_ms']:6.3f} ms "
              f"({r['x_floor']:.2f}x), weights {r['weight_bytes'] / 1e9:.2f} GB")
    for label, acc in (results.get("accuracy") or {}).items():
        if isinstance(acc, dict):
            print(f"accuracy {label}: logits rel err {acc['final_logits_rel_err']:.3e} (worst row "
                  f"{acc['worst_row_rel_err']:.3e}), greedy agreement {acc['greedy_agreement']:.3f}")
    if results.get("errors"):
        print("errors:", json.dumps(results["errors"], indent=1))


if __name__ == "__main__":
    main()
