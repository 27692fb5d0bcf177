"""Cascade attention alone: one decode step's layer call through flashserve's FlashInfer backend,
flat against cascade (eager plan and CUDA-graph plan), with the KV-read floor of each beside them.

    python -m benchmark.cascade_attention [--shapes 4x256x4096,64x16x2000,2x16x1024]

A shape GxRxP is G groups of R decoding requests behind a P-token shared prefix, each with
`--own` tokens of its own. Device time of every kernel one `forward(layer, q, k, v)` launches (the
K/V append, the attention passes, the merge, the dtype casts), from torch.profiler, median over
rounds; the five slowest kernels of each cascade call are printed too. The floor is the KV bytes
the call must read (flat: every request's pages; cascade: each prefix once plus every request's
own pages) over the copy bandwidth measured in the same run. Writes `cascade_attention.json` under
`benchmark/results/local/<GPU>/`.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmark import LOCAL_RESULTS
from benchmark.decode_attention import kernel_us_per_call, save_rows
from benchmark.floor import measure_rates

PAGE = 16
SHAPE = (32, 8, 64)  # llama-3.2-1b: q heads, kv heads, head dim


def step(groups: int, per_group: int, prefix: int, own: int) -> tuple[list[Any], int]:
    """The decode step's requests (page ids in group order) and the pages they use."""
    from flashserve.engine.outputs import ScheduledRequest
    from flashserve.message.sampling_params import SamplingParams

    prefix_pages, own_pages = prefix // PAGE, (own + PAGE) // PAGE
    next_page, requests = 1, []
    for g in range(groups):
        shared = list(range(next_page, next_page + prefix_pages))
        next_page += prefix_pages
        for r in range(per_group):
            pages = shared + list(range(next_page, next_page + own_pages))
            next_page += own_pages
            kv = prefix + own
            requests.append(ScheduledRequest(f"{g}-{r}", [1], kv - 1, pages, True, SamplingParams()))
    return requests, next_page


def top_kernels(run: Any, n: int) -> list[tuple[str, float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    rows = [(e.key[:70], e.device_time_total / 10) for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return sorted(rows, key=lambda r: -r[1])[:n]


def measure(groups: int, per_group: int, prefix: int, own: int) -> dict[str, Any]:
    import torch

    from flashserve.attention.base import BatchLayout
    from flashserve.attention.cascade import CascadePolicy
    from flashserve.attention.flashinfer import FlashInferAttentionBackend

    qo_heads, kv_heads, dim = SHAPE
    requests, num_pages = step(groups, per_group, prefix, own)
    batch = len(requests)
    backend = FlashInferAttentionBackend(1, num_pages + batch, PAGE, kv_heads, dim, torch.bfloat16, "cuda",
                                         num_qo_heads=qo_heads)
    q = torch.randn(batch, qo_heads, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    flat, cascade = BatchLayout.build(requests, PAGE), BatchLayout.build(requests, PAGE, CascadePolicy())
    # Room for the flat page table, which lists each shared page once per member.
    backend.init_cuda_graph([batch], max_total_pages=len(flat.kv_indices) + batch, cascade=True)
    assert cascade.prefix is not None and cascade.prefix.num_groups == groups
    result: dict[str, Any] = {"groups": groups, "per_group": per_group, "prefix": prefix, "own": own}
    plans = {"flat": lambda: backend.plan(flat), "cascade eager": lambda: backend.plan(cascade),
             "flat graph": lambda: backend.plan_cuda_graph(flat, batch),
             "cascade graph": lambda: backend.plan_cuda_graph(cascade, batch)}
    for name, plan in plans.items():
        plan()
        result[f"{name}_us"] = kernel_us_per_call(lambda: backend.forward(0, q, k, v), 20, 5)
        if name.startswith("cascade"):
            result[f"{name}_top"] = top_kernels(lambda: backend.forward(0, q, k, v), 5)
    kv_bytes = 2 * kv_heads * dim * 2  # K and V of one token, one layer
    result["flat_bytes"] = batch * (prefix + own) * kv_bytes
    result["cascade_bytes"] = (groups * prefix + batch * own) * kv_bytes
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4x256x4096,64x16x2000,8x64x1024,2x16x1024")
    p.add_argument("--own", type=int, default=128, help="tokens of each request's own")
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name()
    rates = measure_rates("cuda")
    bw = rates.copy_bytes_per_s
    print(f"{gpu}: one decode layer call (llama-3.2-1b heads), us of kernels; floors at {bw / 1e12:.2f} TB/s")
    print(f"{'groups x req x prefix':>22} {'flat':>8} {'floor':>7} {'casc eager':>11} {'casc graph':>11} "
          f"{'floor':>7} {'flat graph':>11}")
    rows = []
    for shape in args.shapes.split(","):
        g, r, pre = map(int, shape.split("x"))
        row = measure(g, r, pre, args.own)
        row["flat_floor_us"], row["cascade_floor_us"] = row["flat_bytes"] / bw * 1e6, row["cascade_bytes"] / bw * 1e6
        rows.append(row)
        print(f"{shape:>22} {row['flat_us']:8.1f} {row['flat_floor_us']:7.1f} {row['cascade eager_us']:11.1f} "
              f"{row['cascade graph_us']:11.1f} {row['cascade_floor_us']:7.1f} {row['flat graph_us']:11.1f}")
        for name in ("cascade eager", "cascade graph"):
            for kernel, us in row[f"{name}_top"]:
                print(f"{'':>24}{name}: {us:9.1f} us  {kernel}")
    save_rows(args.out, gpu, "cascade_attention.json", rates, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
