"""The all-reduce after a row-parallel projection, with the residual add and RMSNorm after it:
NCCL then FlashInfer's fused add + RMSNorm (what the server runs with
`--no-enable-flashinfer-allreduce-fusion`) against FlashInfer's one-kernel all-reduce + add + RMSNorm
(`distributed/comm.py`'s FlashInferAllReduceNorm), at decode- and prefill-sized steps; and the
copy-engine all-reduce (`distributed/copy_engine.py`, what `--tp-overlap-comm copy-engine` runs for
the overlapped chunks) then the same norm, alone here (beside GEMMs: `benchmark.tp_prefill`).

    python -m benchmark.tp_allreduce [--tp 4] [--hidden 8192] [--tokens 1,16,64,256,512,1024,2048,4096,8192]

Each rank (one process a GPU, NCCL) times both paths per token count on the same bfloat16 inputs,
two ways: eagerly (50 calls back to back, launch costs included, as a prefill step runs them) and
replayed from a CUDA graph of 20 calls (device time only, as a decode step runs them). Rank 0's
medians over 5 repetitions are printed as a table, with the largest token count at which the fused
kernel is still faster (the server's FUSED_ALLREDUCE_MAX_TOKENS should not exceed it), and written to
`<out>/tp_allreduce.json`. Each path's output is checked against the other's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Callable

from benchmark import LOCAL_RESULTS

EPS = 1e-5


def _time_ms(fn: Callable[[], Any], calls: int, graph: bool) -> float:
    """Median over 5 repetitions of the time of one call, from `calls` calls eagerly or replayed."""
    import torch

    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        run: Callable[[], Any] = g.replay
    else:
        def run() -> None:
            for _ in range(calls):
                fn()
    run()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _rank_main(hidden: int, tokens: list[int], out: str) -> None:
    import torch
    import torch.distributed as dist

    import flashinfer

    from flashserve.distributed.comm import FlashInferAllReduceNorm, close_tp_group, init_tp_group, local_rank
    from flashserve.distributed.copy_engine import CopyEngineAllReduce

    device = torch.device("cuda", local_rank())
    group = init_tp_group(device)
    dtype = torch.bfloat16
    fused = FlashInferAllReduceNorm(group, max(tokens), hidden, dtype)
    copies = CopyEngineAllReduce(group.process_group, max(tokens) * hidden, dtype, device)
    weight = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    rows = []
    for n in tokens:
        gen = torch.Generator(device=device).manual_seed(group.rank * 1000 + n)
        partial = torch.randn(n, hidden, dtype=dtype, device=device, generator=gen)
        residual = torch.randn(n, hidden, dtype=dtype, device=device, generator=gen)
        work, res = partial.clone(), residual.clone()

        def nccl() -> None:  # in place, as the server runs it; timed without resetting the inputs
            group.all_reduce(work)
            flashinfer.fused_add_rmsnorm(work, res, weight, EPS)

        def one_kernel() -> tuple[torch.Tensor, torch.Tensor]:
            return fused(partial, residual, weight, EPS)

        ce_work, ce_res = partial.clone(), residual.clone()

        def copy_engine() -> None:
            copies.start(ce_work).wait()
            flashinfer.fused_add_rmsnorm(ce_work, ce_res, weight, EPS)

        check = partial.clone()
        copies.start(check).wait()
        nccl()
        row: dict[str, Any] = {"tokens": n}
        try:  # a size the fused kernel refuses is refused on every rank alike (argument checks)
            normed, _ = one_kernel()
        except Exception as exc:
            row["fused_error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.synchronize()
        if "fused_error" not in row:
            row["max_rel_err"] = ((normed.float() - work.float()).abs().max() / work.float().abs().max()).item()
        # The copy-engine sum against NCCL's of the same partials (before any timing changed them).
        summed = partial.clone()
        group.all_reduce(summed)
        row["copy_engine_max_rel_err"] = ((check.float() - summed.float()).abs().max()
                                          / summed.float().abs().max()).item()  # fmt: skip
        for graph in (False, True):
            kind = "graph" if graph else "eager"
            dist.barrier()
            row[f"nccl_{kind}_us"] = 1e3 * _time_ms(nccl, 20 if graph else 50, graph)
            if "fused_error" not in row:
                dist.barrier()
                row[f"fused_{kind}_us"] = 1e3 * _time_ms(one_kernel, 20 if graph else 50, graph)
            dist.barrier()
            row[f"copy_engine_{kind}_us"] = 1e3 * _time_ms(copy_engine, 20 if graph else 50, graph)
        rows.append(row)
    fused.close()
    copies.close()
    if group.rank == 0:
        Path(out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "world_size": group.world_size,
                                         "hidden": hidden, "dtype": "bfloat16", "rows": rows}, indent=1))  # fmt: skip
    close_tp_group(group)


def copy_engine_columns(r: dict[str, Any]) -> str:
    """The copy-engine all-reduce's columns of a row (absent from results written before it)."""
    if "copy_engine_eager_us" not in r:
        return ""
    return (f" {r['copy_engine_eager_us']:18.1f} {r['copy_engine_graph_us']:18.1f} "
            f"{r['copy_engine_max_rel_err']:15.2e}")


def report(doc: dict[str, Any]) -> str:
    lines = [f"{doc['gpu']} x {doc['world_size']}: all-reduce + add + RMSNorm of [tokens, {doc['hidden']}] bfloat16, "
             "us per call (rank 0)",
             f"{'tokens':>7} {'NCCL+norm eager':>16} {'fused eager':>12} {'NCCL+norm graph':>16} {'fused graph':>12} "
             f"{'fused/NCCL graph':>17} {'max rel err':>12} {'copies+norm eager':>18} {'copies+norm graph':>18} "
             f"{'copies rel err':>15}"]  # fmt: skip
    for r in doc["rows"]:
        if "fused_error" in r:
            lines.append(f"{r['tokens']:7d} {r['nccl_eager_us']:16.1f} {'-':>12} {r['nccl_graph_us']:16.1f} {'-':>12} "
                         f"{'-':>17} {'-':>12}{copy_engine_columns(r)} fused: {r['fused_error']}")  # fmt: skip
            continue
        lines.append(f"{r['tokens']:7d} {r['nccl_eager_us']:16.1f} {r['fused_eager_us']:12.1f} {r['nccl_graph_us']:16.1f} "
                     f"{r['fused_graph_us']:12.1f} {r['fused_graph_us'] / r['nccl_graph_us']:17.2f} "
                     f"{r['max_rel_err']:12.2e}{copy_engine_columns(r)}")  # fmt: skip
    faster = [r["tokens"] for r in doc["rows"] if "fused_error" not in r and r["fused_eager_us"] < r["nccl_eager_us"]]
    lines.append(f"fused faster eagerly up to: {max(faster) if faster else 'never'} tokens "
                 f"(token counts where it is: {faster})")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--hidden", type=int, default=8192, help="the model's hidden size (70B: 8192, 8B: 4096)")
    p.add_argument("--tokens", default="1,16,64,256,512,1024,2048,4096,8192")
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)
    from flashserve.executor.launch import RankProcesses

    out = Path(args.out) / "tp_allreduce.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    with RankProcesses.start(_rank_main, (args.hidden, tokens, str(out)), world_size=args.tp) as ranks:
        ranks.join(timeout=400)
    print(report(json.loads(out.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
