"""Decode step time and prefill throughput of each model path, against the physical floor.

Paths: the native Llama forward replayed from CUDA graphs and run eagerly, the same with its
non-attention pieces through `torch.compile` (`--torch-compile`), the generic HF path (the
transformers model with our paged FlashInfer attention) from graphs and eagerly, and
transformers' own `generate`. Dummy
bf16 weights of the Llama-3.1-8B and Llama-3.2-1B shapes; every decode request attends over a KV
of `--kv-len` tokens. The floor is measured in the same run: bytes read per step (weights + KV)
over the device-to-device copy bandwidth, or FLOPs over the bf16 matmul rate, whichever is longer.
Times are CUDA-event medians after warm-up; a step includes its host work (plan, launch).

    python -m benchmark.decode_bench [--shapes llama-3.2-1b] [--batches 1 8] [--torch-compile] [--profile]

Prints a table; writes decode_bench.json, decode_bench.png (and profile_*.txt) to --out-dir.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
from typing import Any, Callable

import torch

from benchmark import LOCAL_RESULTS
from benchmark.floor import measure_rates, median_time_s

PAGE = 16


def time_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median over `iters` calls of the GPU time between events recorded around each call."""
    return median_time_s(fn, "cuda", warmup, iters) * 1e3


def decode_layout(batch: int, kv_len: int, first_page: int = 1) -> Any:
    """A decode step of `batch` requests, each at position kv_len - 1 over kv_len cached tokens."""
    from flashserve.attention.base import BatchLayout, last_page_len

    pages = (kv_len + PAGE - 1) // PAGE
    return BatchLayout(
        page_size=PAGE,
        qo_indptr=list(range(batch + 1)),
        kv_indptr=[i * pages for i in range(batch + 1)],
        kv_indices=list(range(first_page, first_page + batch * pages)),
        kv_last_page_len=[last_page_len(kv_len, PAGE)] * batch,
        positions=[kv_len - 1] * batch,
    )


def prefill_layout(prompts: int, length: int) -> Any:
    from flashserve.attention.base import BatchLayout

    pages = (length + PAGE - 1) // PAGE
    return BatchLayout(
        page_size=PAGE,
        qo_indptr=[i * length for i in range(prompts + 1)],
        kv_indptr=[i * pages for i in range(prompts + 1)],
        kv_indices=list(range(1, 1 + prompts * pages)),
        kv_last_page_len=[(length - 1) % PAGE + 1] * prompts,
        positions=list(range(length)) * prompts,
    )


def guarded(results: dict[str, Any], key: str, fn: Callable[[], float]) -> None:
    """Records fn()'s time under key, or the error: one failing path must not end the benchmark."""
    try:
        results[key] = round(fn(), 4)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        results[key] = None
        results.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize()


def hf_generate_ms(hf: torch.nn.Module, batch: int, kv_len: int, new_tokens: int) -> float:
    """Per-token time of transformers' generate (its own cache, sdpa): (t(1 + n) - t(1)) / n."""
    ids = torch.randint(0, hf.config.vocab_size, (batch, kv_len), device="cuda")

    def run(n: int) -> Callable[[], Any]:
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        return lambda: hf.generate(ids, **kw)

    return (time_ms(run(1 + new_tokens), 1, 3) - time_ms(run(1), 1, 3)) / new_tokens


def bench_shape(shape: str, args: argparse.Namespace, bw: float, rate: float) -> dict[str, Any]:
    from flashserve.attention.flashinfer import FlashInferAttentionBackend
    from flashserve.config import ModelConfig
    from flashserve.model_loader.loader import load_model
    from flashserve.models.hf import HFCausalLM
    from flashserve.models.llama import LlamaModel

    loaded = load_model(ModelConfig(model=shape, load_format="dummy", dtype="bfloat16"), "cuda")
    hf, config = loaded.model, loaded.hf_config
    if args.layers:
        hf.model.layers = hf.model.layers[: args.layers]
        config.num_hidden_layers = hf.config.num_hidden_layers = args.layers
    native = LlamaModel.from_hf(hf, config, torch.bfloat16, "cuda", consume=False, max_positions=args.prefill_len + args.kv_len)
    spec = native.spec
    kv_token_bytes = 2 * spec.num_layers * spec.kv_size * 2
    matmul_params = sum(p.numel() for n, p in native.named_parameters() if n.endswith("proj.weight"))
    head_params = spec.vocab_size * spec.hidden_size
    weight_bytes = 2 * (matmul_params + head_params + sum(p.numel() for n, p in native.named_parameters() if "norm" in n))
    max_batch = max(args.batches)
    num_pages = 1 + max(max_batch * ((args.kv_len + PAGE - 1) // PAGE), max(args.prefill_prompts, default=0) * args.prefill_len // PAGE + 1)
    backend = FlashInferAttentionBackend(
        spec.num_layers, num_pages, PAGE, spec.num_kv_heads, spec.head_dim, torch.bfloat16, "cuda", None,
        num_qo_heads=spec.num_heads,
    )  # fmt: skip
    out: dict[str, Any] = {"layers": spec.num_layers, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token_bytes}

    def logits_fn(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return native.compute_logits(native(ids, pos, backend))

    generate = {b: None for b in args.generate_batches}
    if not args.no_hf:
        for b in args.generate_batches:
            res: dict[str, Any] = {}
            guarded(res, "ms", lambda: hf_generate_ms(hf, b, args.kv_len, args.generate_tokens))
            generate[b] = res["ms"]
            print(f"  {shape} hf_generate b={b}: {res.get('ms')} {res.get('errors', '')}", flush=True)
    graphs = None
    try:
        from flashserve.worker.cuda_graph import CudaGraphRunner

        graphs = CudaGraphRunner(logits_fn, backend, args.batches)
        graphs.capture()
    except Exception as exc:  # noqa: BLE001
        out["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        graphs = None
    hf_path = None if args.no_hf else HFCausalLM(hf)
    rows = []
    for b in args.batches:
        layout = decode_layout(b, args.kv_len)
        ids = torch.randint(0, spec.vocab_size, (b,), device="cuda")
        pos = torch.tensor(layout.positions, device="cuda")
        floor_bw = (weight_bytes + b * args.kv_len * kv_token_bytes) / bw * 1e3
        flops = 2 * b * (matmul_params + head_params) + 4 * b * args.kv_len * spec.q_size * spec.num_layers
        r: dict[str, Any] = {"batch": b, "floor_bw_ms": floor_bw, "floor_flops_ms": flops / rate * 1e3}
        r["floor_ms"] = max(r["floor_bw_ms"], r["floor_flops_ms"])

        def eager(fn: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: (backend.plan(layout), fn())

        if graphs is not None:
            guarded(r, "native_graph_ms", lambda: time_ms(lambda: graphs(ids, pos, layout), args.warmup, args.iters))
        guarded(r, "native_eager_ms", lambda: time_ms(eager(lambda: logits_fn(ids, pos)), args.warmup, args.iters))
        if hf_path is not None:
            rows_idx = torch.arange(b, device="cuda")
            guarded(r, "hf_path_ms", lambda: time_ms(eager(lambda: hf_path.forward(ids, pos, backend, rows_idx)), 2, max(3, args.iters // 2)))
        r["hf_generate_ms"] = generate.get(b)
        rows.append(r)
        print("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
        if args.profile and b in (min(args.batches), max_batch):
            step = (lambda: graphs(ids, pos, layout)) if graphs is not None else eager(lambda: logits_fn(ids, pos))
            profile_step(step, os.path.join(args.out_dir, f"profile_{shape}_b{b}.txt"), r)
    out["decode"] = rows
    # Each further graph set re-initialises the backend's graph buffers: one set at a time.
    del graphs
    graphs = None
    if hf_path is not None:
        time_graphs("hf_path", hf_path.decode_logits(backend), backend, rows, args, eager=False)
    compiled = None
    if args.torch_compile:
        compiled = compiled_copy(native)
        time_graphs("compiled", lambda ids, pos: compiled.compute_logits(compiled(ids, pos, backend)), backend, rows, args,
                    eager=True)  # fmt: skip
    out["prefill"] = []
    for n in args.prefill_prompts:
        layout = prefill_layout(n, args.prefill_len)
        t = n * args.prefill_len
        ids = torch.randint(0, spec.vocab_size, (t,), device="cuda")
        pos = torch.tensor(layout.positions, device="cuda")
        last = torch.tensor(layout.qo_indptr[1:], device="cuda") - 1
        flops = 2 * t * matmul_params + 2 * n * head_params + 2 * n * args.prefill_len**2 * spec.q_size * spec.num_layers
        r = {"prompts": n, "tokens": t, "floor_tok_s": t / (flops / rate)}
        guarded(r, "native_ms", lambda: time_ms(lambda: (backend.plan(layout), native.compute_logits(native(ids, pos, backend)[last])), 2, 3))
        if compiled is not None:
            guarded(r, "compiled_ms", lambda: time_ms(lambda: (backend.plan(layout), compiled.compute_logits(compiled(ids, pos, backend)[last])), 2, 3))
        if hf_path is not None:
            guarded(r, "hf_path_ms", lambda: time_ms(lambda: (backend.plan(layout), hf_path.forward(ids, pos, backend, last)), 1, 2))
        for key in ("native", "compiled", "hf_path"):
            if r.get(f"{key}_ms"):
                r[f"{key}_tok_s"] = t / (r[f"{key}_ms"] / 1e3)
        out["prefill"].append(r)
        print("  " + json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    del graphs, compiled, hf_path, backend, native, hf, loaded
    gc.collect()
    torch.cuda.empty_cache()
    return out


def compiled_copy(native: Any) -> Any:
    """The native model with `torch.compile`d pieces, sharing `native`'s weights."""
    from flashserve.layers.ops import torch_ops
    from flashserve.models.llama import LlamaModel

    with torch.device("meta"):
        compiled = LlamaModel(native.spec, torch_ops(), compile=True)
    compiled.load_state_dict(native.state_dict(), assign=True)  # shares the tensors
    compiled.cos_sin_cache = native.cos_sin_cache
    return compiled


def time_graphs(key: str, logits_fn: Callable[..., Any], backend: Any, rows: list[dict[str, Any]],
                args: argparse.Namespace, *, eager: bool) -> None:  # fmt: skip
    """Adds `{key}_graph_ms` (and `{key}_eager_ms`) to every decode row: `logits_fn` replayed from
    CUDA graphs captured here (which first runs each size once: compiled pieces compile then)."""
    from flashserve.worker.cuda_graph import CudaGraphRunner

    graphs = CudaGraphRunner(logits_fn, backend, args.batches)
    try:
        graphs.capture()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        for r in rows:
            r.setdefault("errors", {})[f"{key}_graph_ms"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize()
        return
    for r in rows:
        b = r["batch"]
        layout = decode_layout(b, args.kv_len)
        ids = torch.randint(0, 1000, (b,), device="cuda")
        pos = torch.tensor(layout.positions, device="cuda")
        guarded(r, f"{key}_graph_ms", lambda: time_ms(lambda: graphs(ids, pos, layout), args.warmup, args.iters))
        if eager:
            guarded(r, f"{key}_eager_ms", lambda: time_ms(lambda: (backend.plan(layout), logits_fn(ids, pos)),
                                                          args.warmup, args.iters))  # fmt: skip
        print(f"  {key} b={b}: graph {r.get(f'{key}_graph_ms')} eager {r.get(f'{key}_eager_ms')}", flush=True)


def profile_step(step: Callable[[], Any], path: str, row: dict[str, Any]) -> None:
    """Kernel table of 20 steps, and how much of the step the GPU spends in kernels."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    sort = "self_cuda_time_total" if hasattr(events[0], "self_cuda_time_total") else "self_device_time_total"
    # Kernels only: a CPU op's self device time repeats the time of the kernels it launched.
    kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
    kernel_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in kernels) / 20
    row["profile_kernel_ms_per_step"] = kernel_us / 1e3
    with open(path, "w") as f:
        f.write(f"GPU kernel time per step: {kernel_us / 1e3:.3f} ms (step {row.get('native_graph_ms') or row.get('native_eager_ms')} ms)\n")
        f.write(events.table(sort_by=sort, row_limit=30, max_name_column_width=90))


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{results['gpu']}: copy {results['copy_GBps']:.0f} GB/s, bf16 matmul {results['matmul_TFLOPs']:.0f} TFLOP/s")
    keys = ["native_graph_ms", "native_eager_ms", "compiled_graph_ms", "compiled_eager_ms", "hf_path_graph_ms", "hf_path_ms",
            "hf_generate_ms"]  # fmt: skip
    names = ["graph", "eager", "compiled graph", "compiled eager", "hf path graph", "hf path", "hf generate"]
    shown = [k for k in keys if any(r.get(k) for res in results["shapes"].values() for r in res["decode"])]
    head = f"{'shape':14} {'batch':>5} {'floor':>7} " + " ".join(f"{names[keys.index(k)]:>14}" for k in shown) + "  (ms, x floor)"
    for shape, res in results["shapes"].items():
        print(head)
        for r in res["decode"]:
            cells = []
            for k in shown:
                v = r.get(k)
                cells.append(f"{v:7.3f} {v / r['floor_ms']:4.2f}x" if v else "-")
            print(f"{shape:14} {r['batch']:5d} {r['floor_ms']:7.3f} " + " ".join(f"{c:>14}" for c in cells))
        for r in res["prefill"]:
            nat, comp, hfp = r.get("native_tok_s"), r.get("compiled_tok_s"), r.get("hf_path_tok_s")
            print(f"{shape:14} prefill {r['prompts']:2d}x{r['tokens'] // r['prompts']}: floor {r['floor_tok_s']:9.0f} tok/s, native "
                  f"{nat or 0:9.0f} ({(nat or 0) / r['floor_tok_s']:.2f} of floor), compiled {comp or 0:9.0f}, hf path {hfp or 0:9.0f}")


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(results["shapes"])
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 4.5 * len(shapes)), squeeze=False)
    for (ax_d, ax_p), shape in zip(axes, shapes):
        res = results["shapes"][shape]
        batches = [r["batch"] for r in res["decode"]]
        for key, style in (("floor_ms", "k--"), ("native_graph_ms", "o-"), ("native_eager_ms", "s-"), ("compiled_graph_ms", "d-"),
                           ("hf_path_graph_ms", "v-"), ("hf_path_ms", "^-"), ("hf_generate_ms", "x-")):  # fmt: skip
            pts = [(b, r[key]) for b, r in zip(batches, res["decode"]) if r.get(key)]
            if pts:
                ax_d.plot(*zip(*pts), style, label=key.removesuffix("_ms"))
        ax_d.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode step (ms)", title=f"{shape}: decode, KV {results['kv_len']}")
        ax_d.grid(True, which="both", alpha=0.3)
        ax_d.legend()
        pre = res["prefill"]
        xs = range(len(pre))
        bars = [(k, label) for k, label in (("floor_tok_s", "floor"), ("native_tok_s", "native"), ("compiled_tok_s", "compiled"),
                                             ("hf_path_tok_s", "hf path")) if any(r.get(k) for r in pre)]  # fmt: skip
        width = 0.8 / max(1, len(bars))
        for i, (key, label) in enumerate(bars):
            ax_p.bar([x + width * (i - (len(bars) - 1) / 2) for x in xs], [r.get(key) or 0 for r in pre], width, label=label)
        ax_p.set_xticks(list(xs), [f"{r['prompts']}x{r['tokens'] // r['prompts']}" for r in pre])
        ax_p.set(ylabel="prefill tokens/s", title=f"{shape}: prefill")
        ax_p.legend()
    fig.suptitle(f"{results['gpu']} (bf16, dummy weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--generate-batches", nargs="*", type=int, default=[1, 8, 32])
    p.add_argument("--generate-tokens", type=int, default=32)
    p.add_argument("--prefill-prompts", nargs="*", type=int, default=[1, 4, 16])
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--kv-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=0, help="keep only this many layers (0: all)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--torch-compile", action="store_true", help="also time the torch.compile'd native model")
    p.add_argument("--no-hf", action="store_true", help="skip the HF path and HF generate")
    p.add_argument("--profile", action="store_true", help="kernel tables of the smallest and largest batch")
    p.add_argument("--out-dir", default=None, help="default: benchmark/results/local/<gpu name>/")
    args = p.parse_args()
    gpu = torch.cuda.get_device_name()
    args.out_dir = args.out_dir or os.path.join(LOCAL_RESULTS, re.sub(r"[^A-Za-z0-9._-]+", "_", gpu))
    os.makedirs(args.out_dir, exist_ok=True)
    results: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__, "kv_len": args.kv_len, "shapes": {}}
    with torch.inference_mode():
        rates = measure_rates("cuda")  # the same measurement as the serving suite's floor
        bw, rate = rates.copy_bytes_per_s, rates.matmul_flop_per_s
        results.update(copy_GBps=bw / 1e9, matmul_TFLOPs=rate / 1e12)
        for shape in args.shapes:
            print(f"{shape} ...", flush=True)
            results["shapes"][shape] = bench_shape(shape, args, bw, rate)
            with open(os.path.join(args.out_dir, "decode_bench.json"), "w") as f:  # after each shape
                json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out_dir, "decode_bench.png"))
    print_table(results)


if __name__ == "__main__":
    main()
