"""Decode attention alone: FlashInfer's tensor-core decode (the prefill kernel, what flashserve
uses), the same with its KV split off, its CUDA-core decode kernel and flashserve's Triton decode
(`attention/triton_decode.py`), per layer call, with the KV-read floor beside them; over a cache in
bfloat16 or FP8 (e4m3, q in bfloat16), in FlashInfer's NHD layout (flashserve's) or HND.

At small batches a decode step's attention is a few microseconds per layer, and the tensor-core
path pads each KV head's query group (4 rows in Llama-3's shapes) to a 16-row tile and splits the
KV over CTAs with a merge kernel after it. This measures whether the CUDA-core kernel is faster
there (`PERFORMANCE.md`: small kernels add ~0.85 ms to the 8B batch-1 step).

    python -m benchmark.decode_attention [--batches 1,8,64,256] [--kv-lens 512,4096]
        [--shapes llama-3.2-1b,llama-3.1-8b] [--kv-dtypes bf16,fp8] [--layouts NHD,HND]

Kernel time per call from torch.profiler (device time of every kernel a `run` launches: the
attention and, when the KV is split, the merge), median over rounds. The floor is the layer's KV
bytes over the copy bandwidth measured in the same run. Prints a table; writes
`decode_attention.json` under `benchmark/results/local/<GPU>/`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS
from benchmark.floor import measure_rates

PAGE = 16
SHAPES = {"llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128)}  # q heads, kv heads, head dim


def kernel_us_per_call(run: Any, calls: int, rounds: int) -> float:
    """Median over `rounds` of the device time of the kernels `calls` runs launch, per run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                run()
            torch.cuda.synchronize()
        total = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"
                    and not e.key.startswith("Memcpy") and not e.key.startswith("Memset"))
        per_round.append(total / calls)
    return statistics.median(per_round)


KV_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}


def make_cache(shape: tuple[int, int, int], batch: int, kv_len: int, kv_dtype: str, layout: str) -> Any:
    """A cache of `batch` requests of `kv_len` tokens on pages of their own, FlashInfer's 5-D
    [pages, 2, ...] in `layout`, random values in `kv_dtype`."""
    import torch

    _, kv_heads, dim = shape
    pages = (kv_len + PAGE - 1) // PAGE
    dims = (PAGE, kv_heads, dim) if layout == "NHD" else (kv_heads, PAGE, dim)
    cache = torch.randn(batch * pages, 2, *dims, dtype=torch.bfloat16, device="cuda")
    return cache.to(getattr(torch, KV_DTYPES[kv_dtype]))


def page_table(batch: int, kv_len: int) -> tuple[Any, Any, Any]:
    """FlashInfer's kv_indptr (host), kv_indices (device) and kv_last_page_len (host)."""
    import torch

    pages = (kv_len + PAGE - 1) // PAGE
    indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32)
    indices = torch.arange(batch * pages, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), (kv_len - 1) % PAGE + 1, dtype=torch.int32)
    return indptr, indices, last


def measure(shape: tuple[int, int, int], batch: int, kv_len: int, tensor_cores: bool, split: bool = True,
            kv_dtype: str = "bf16", layout: str = "NHD", q_fp16: bool = False) -> float:
    """Kernel time per call; `split=False` plans the tensor-core kernel with FlashInfer's KV split
    off (one CTA per request and KV head over all its pages, no merge kernel after it). `q_fp16`
    (an FP8 cache): q cast to float16 before the kernel (the cast counted), which then widens the
    FP8 K/V to float16 rather than bfloat16; the output stays bfloat16."""
    import flashinfer
    import torch

    qo_heads, kv_heads, dim = shape
    cache = make_cache(shape, batch, kv_len, kv_dtype, layout)
    q = torch.randn(batch, qo_heads, dim, dtype=torch.bfloat16, device="cuda")
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, use_tensor_cores=tensor_cores,
                                                            backend="fa2")
    indptr, indices, last = page_table(batch, kv_len)
    wrapper.plan(indptr, indices, last, qo_heads, kv_heads, dim, PAGE,
                 q_data_type=torch.float16 if q_fp16 else torch.bfloat16, kv_data_type=cache.dtype,
                 o_data_type=torch.bfloat16, **({} if split else {"disable_split_kv": True}))
    if q_fp16:
        return kernel_us_per_call(lambda: wrapper.run(q.to(torch.float16), cache), 50, 5)
    return kernel_us_per_call(lambda: wrapper.run(q, cache), 50, 5)


def measure_triton(shape: tuple[int, int, int], batch: int, kv_len: int, kv_dtype: str = "bf16",
                   config: dict[str, int] | None = None) -> float:
    """flashserve's Triton decode (NHD), with the splits and launch the backend would give it, or
    `config` (`split_factor` times those splits, and `decode_attention`'s block_t, num_warps and
    num_stages)."""
    import torch

    from flashserve.attention import triton_decode

    qo_heads, kv_heads, dim = shape
    cache = make_cache(shape, batch, kv_len, kv_dtype, "NHD")
    q = torch.randn(batch, qo_heads, dim, dtype=torch.bfloat16, device="cuda")
    indptr, indices, last = page_table(batch, kv_len)
    indptr, last = indptr.cuda(), last.cuda()
    config = dict(config or {})
    splits = min(64, triton_decode.max_splits(batch, kv_heads, q.device) * config.pop("split_factor", 1))
    k, v = cache[:, 0], cache[:, 1]
    return kernel_us_per_call(
        lambda: triton_decode.decode_attention(q, (k, v), indptr, indices, last, dim**-0.5, splits, **config), 20, 3)


SWEEP = [{"block_t": t, "num_warps": w, "num_stages": s, "split_factor": f}
         for t in (64, 128) for w in (4, 8) for s in (2, 3, 4) for f in (1, 2)]


def sweep(shape: tuple[int, int, int], batch: int, kv_len: int, kv_dtype: str) -> list[tuple[float, dict[str, int]]]:
    """The Triton decode under every `SWEEP` configuration, fastest first (one that fails to
    build or launch, e.g. out of shared memory, is left out)."""
    timed = []
    for config in SWEEP:
        try:
            timed.append((measure_triton(shape, batch, kv_len, kv_dtype, config), config))
        except Exception as exc:  # noqa: BLE001 - a configuration the GPU cannot launch
            print(f"  {config}: {type(exc).__name__}", flush=True)
    return sorted(timed, key=lambda t: t[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--kv-lens", default="512,4096")
    p.add_argument("--shapes", default=",".join(SHAPES), help="of %(default)s")
    p.add_argument("--kv-dtypes", default="bf16", help="bf16, fp8 or both")
    p.add_argument("--layouts", default="NHD", help="NHD, HND or both")
    p.add_argument("--sweep", action="store_true",
                   help="time the Triton decode under each configuration of SWEEP instead (NHD), the best first")
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name()
    rates = measure_rates("cuda")
    if args.sweep:
        rows = sweep_rows(args)
        save_rows(args.out, gpu, "decode_attention_sweep.json", rates, rows)
        return 0
    print(f"{gpu}: decode attention per layer call, us (kernels only); floor = KV bytes / "
          f"{rates.copy_bytes_per_s / 1e12:.2f} TB/s")
    print(f"{'shape':>13} {'kv':>5} {'layout':>6} {'batch':>6} {'kv_len':>6} {'tensor cores':>13} {'no KV split':>12} "
          f"{'cuda cores':>11} {'triton':>7} {'tc q fp16':>10} {'cc q fp16':>10} {'floor':>7}")
    rows = []
    for name, kv_dtype, layout, batch, kv_len in cases(args, args.layouts.split(",")):
        shape = SHAPES[name]
        kw = {"kv_dtype": kv_dtype, "layout": layout}
        tc, cc = (measure(shape, batch, kv_len, t, **kw) for t in (True, False))
        unsplit = measure(shape, batch, kv_len, True, split=False, **kw)
        tr = measure_triton(shape, batch, kv_len, kv_dtype) if layout == "NHD" else None
        fp8 = kv_dtype == "fp8"
        tc16, cc16 = ((measure(shape, batch, kv_len, t, q_fp16=True, **kw) for t in (True, False)) if fp8
                      else (None, None))
        floor = 2 * batch * kv_len * shape[1] * shape[2] * (1 if fp8 else 2) / rates.copy_bytes_per_s * 1e6
        rows.append({"shape": name, "kv_dtype": kv_dtype, "layout": layout, "batch": batch, "kv_len": kv_len,
                     "tensor_cores_us": tc, "tensor_cores_no_split_us": unsplit, "cuda_cores_us": cc,
                     "triton_us": tr, "tensor_cores_q_fp16_us": tc16, "cuda_cores_q_fp16_us": cc16,
                     "floor_us": floor})
        opt = [f"{x:{w}.2f}" if x is not None else f"{'-':>{w}}" for x, w in ((tr, 7), (tc16, 10), (cc16, 10))]
        print(f"{name:>13} {kv_dtype:>5} {layout:>6} {batch:6d} {kv_len:6d} {tc:13.2f} {unsplit:12.2f} {cc:11.2f} "
              f"{' '.join(opt)} {floor:7.2f}", flush=True)
    save_rows(args.out, gpu, "decode_attention.json", rates, rows)
    return 0


def cases(args: argparse.Namespace, layouts: list[str]) -> Iterator[tuple[str, str, str, int, int]]:
    """(shape, KV dtype, layout, batch, cached tokens) for every combination the options name."""
    return itertools.product(args.shapes.split(","), args.kv_dtypes.split(","), layouts,
                             map(int, args.batches.split(",")), map(int, args.kv_lens.split(",")))


def sweep_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The Triton decode's `sweep` for every case (NHD), against its default launch; prints the best."""
    rows = []
    for name, kv_dtype, _, batch, kv_len in cases(args, ["NHD"]):
        timed = sweep(SHAPES[name], batch, kv_len, kv_dtype)
        default = measure_triton(SHAPES[name], batch, kv_len, kv_dtype)
        rows.append({"shape": name, "kv_dtype": kv_dtype, "batch": batch, "kv_len": kv_len, "default_us": default,
                     "timed": [[us, c] for us, c in timed]})
        best = ", ".join(f"{us:.1f} {c}" for us, c in timed[:3])
        print(f"{name} {kv_dtype} batch {batch} kv {kv_len}: default {default:.1f} us; best {best}", flush=True)
    return rows


def save_rows(out: str, gpu: str, name: str, rates: Any, rows: list[dict[str, Any]]) -> Path:
    """Writes {gpu, rates, rows} as `name` under `out`/<GPU>/; returns the path."""
    path = Path(out) / gpu.replace(" ", "_") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "rates": rates.to_json(), "rows": rows}, indent=2))
    return path


if __name__ == "__main__":
    raise SystemExit(main())
