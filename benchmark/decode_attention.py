"""Decode attention alone: FlashInfer's tensor-core decode (the prefill kernel, what flashserve
uses), the same with its KV split off, and its CUDA-core decode kernel, per layer call, with the
KV-read floor beside them.

At small batches a decode step's attention is a few microseconds per layer, and the tensor-core
path pads each KV head's query group (4 rows in Llama-3's shapes) to a 16-row tile and splits the
KV over CTAs with a merge kernel after it. This measures whether the CUDA-core kernel is faster
there (`PERFORMANCE.md`: small kernels add ~0.85 ms to the 8B batch-1 step).

    python -m benchmark.decode_attention [--batches 1,8,64,256] [--kv-lens 512,4096]

Kernel time per call from torch.profiler (device time of every kernel a `run` launches: the
attention and, when the KV is split, the merge), median over rounds. The floor is the layer's KV
bytes over the copy bandwidth measured in the same run. Prints a table; writes
`decode_attention.json` under `benchmark/results/local/<GPU>/`.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def measure(shape: tuple[int, int, int], batch: int, kv_len: int, tensor_cores: bool, split: bool = True) -> float:
    """Kernel time per call; `split=False` plans the tensor-core kernel with FlashInfer's KV split
    off (one CTA per request and KV head over all its pages, no merge kernel after it)."""
    import flashinfer
    import torch

    qo_heads, kv_heads, dim = shape
    pages = (kv_len + PAGE - 1) // PAGE
    cache = torch.randn(batch * pages, 2, PAGE, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, qo_heads, dim, dtype=torch.bfloat16, device="cuda")
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores,
                                                            backend="fa2")
    indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32)
    indices = torch.arange(batch * pages, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), (kv_len - 1) % PAGE + 1, dtype=torch.int32)
    wrapper.plan(indptr, indices, last, qo_heads, kv_heads, dim, PAGE, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, **({} if split else {"disable_split_kv": True}))
    return kernel_us_per_call(lambda: wrapper.run(q, cache), 50, 5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--kv-lens", default="512,4096")
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name()
    rates = measure_rates("cuda")
    rows = []
    print(f"{gpu}: decode attention per layer call, us (kernels only); floor = KV bytes / "
          f"{rates.copy_bytes_per_s / 1e12:.2f} TB/s")
    print(f"{'shape':>13} {'batch':>6} {'kv':>6} {'tensor cores':>13} {'no KV split':>12} {'cuda cores':>11} "
          f"{'floor':>7}")
    for name, shape in SHAPES.items():
        for batch in map(int, args.batches.split(",")):
            for kv_len in map(int, args.kv_lens.split(",")):
                tc, cc = (measure(shape, batch, kv_len, t) for t in (True, False))
                unsplit = measure(shape, batch, kv_len, True, split=False)
                floor = 2 * batch * kv_len * shape[1] * shape[2] * 2 / rates.copy_bytes_per_s * 1e6
                rows.append({"shape": name, "batch": batch, "kv_len": kv_len, "tensor_cores_us": tc,
                             "tensor_cores_no_split_us": unsplit, "cuda_cores_us": cc, "floor_us": floor})
                print(f"{name:>13} {batch:6d} {kv_len:6d} {tc:13.2f} {unsplit:12.2f} {cc:11.2f} {floor:7.2f}",
                      flush=True)
    save_rows(args.out, gpu, "decode_attention.json", rates, rows)
    return 0


def save_rows(out: str, gpu: str, name: str, rates: Any, rows: list[dict[str, Any]]) -> Path:
    """Writes {gpu, rates, rows} as `name` under `out`/<GPU>/; returns the path."""
    path = Path(out) / gpu.replace(" ", "_") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, "rates": rates.to_json(), "rows": rows}, indent=2))
    return path


if __name__ == "__main__":
    raise SystemExit(main())
