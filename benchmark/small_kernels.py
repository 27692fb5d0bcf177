"""The small kernels of a batch-1 decode step, alone: what they cost from a CUDA graph, and what
as many launches of an empty kernel cost.

At batch 1 a decode step is its matmuls (the weight reads) plus, per layer, the kernels between
them: the input RMSNorm, RoPE, the KV append, attention (and the merge of its KV split), the
post-attention fused add + RMSNorm, SiLU-and-mul, and cuBLAS's split-K reductions. The step's
profile (`benchmark/results/<GPU>/profile_*_b1.txt`) puts them at about 0.85 ms of the 8B step on
an H100. This measures them without the matmuls, as flashserve's native model launches them
(FlashInfer kernels, one layer's chain repeated for every layer, captured in one CUDA graph), and
beside them a graph of as many dependent launches of a one-element add: the part of that time
that only fewer launches (fusion) can remove.

    python -m benchmark.small_kernels [--models llama-3.1-8b,llama-3.2-1b] [--kv-len 512]

Median replay time over rounds, CUDA events. Prints a table; writes `small_kernels.json` under
`benchmark/results/local/<GPU>/` (`--out DIR`: DIR/<GPU>/).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

from benchmark import LOCAL_RESULTS
from benchmark.decode_attention import save_rows
from benchmark.floor import measure_rates

PAGE = 16


def graph_ms(body: Callable[[], None], rounds: int = 20) -> float:
    """Median time of one replay of a CUDA graph of `body`, in ms."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up outside the capture (JIT, workspace)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer_chain(config: dict[str, Any], kv_len: int) -> tuple[Callable[[], None], dict[str, Callable[[], None]], int]:
    """One layer's small kernels at batch 1 as the native model calls them, each kernel on its own
    too; returns (chain, kernels by name, launches per chain)."""
    import flashinfer
    import torch

    from flashserve.layers.ops import flashinfer_ops, rope_cos_sin_cache, rope_inv_freq

    ops = flashinfer_ops()
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    dev, bf16 = "cuda", torch.bfloat16
    x, residual = (torch.randn(1, hidden, device=dev, dtype=bf16) for _ in range(2))
    w = torch.ones(hidden, device=dev, dtype=bf16)
    q, k, v = (torch.randn(1, n, dim, device=dev, dtype=bf16) for n in (heads, kv_heads, kv_heads))
    gate_up = torch.randn(1, 2 * inter, device=dev, dtype=bf16)
    # The rope type changes the table, not the kernel.
    rope = {"rope_type": "default", "rope_theta": float(config.get("rope_theta", 500000.0))}
    cos_sin = rope_cos_sin_cache(rope_inv_freq(rope, dim), kv_len + 16, dev)
    pages = (kv_len + PAGE - 1) // PAGE
    cache = torch.randn(pages, 2, PAGE, kv_heads, dim, device=dev, dtype=bf16)
    position = torch.tensor([kv_len - 1], device=dev, dtype=torch.int32)
    batch_idx = torch.zeros(1, device=dev, dtype=torch.int32)
    indptr = torch.tensor([0, pages], dtype=torch.int32)
    indices = torch.arange(pages, dtype=torch.int32, device=dev)
    last = torch.tensor([(kv_len - 1) % PAGE + 1], dtype=torch.int32)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend="fa2")
    wrapper.plan(indptr, indices, last, heads, kv_heads, dim, PAGE, q_data_type=bf16, kv_data_type=bf16)
    eps = 1e-5
    kv_indptr = torch.tensor([0, pages], device=dev, dtype=torch.int32)
    kv_last = last.to(dev)

    kernels: dict[str, Callable[[], None]] = {
        "rmsnorm (input, fused add)": lambda: ops.fused_add_rmsnorm(x, residual, w, eps),
        "rope": lambda: ops.apply_rope(position, q.view(1, -1), k.view(1, -1), dim, cos_sin),
        "kv append": lambda: flashinfer.append_paged_kv_cache(k, v, batch_idx, position, cache, indices, kv_indptr,
                                                              kv_last, kv_layout="NHD"),
        "attention (+ merge)": lambda: wrapper.run(q, cache),
        "rmsnorm (post-attention, fused add)": lambda: ops.fused_add_rmsnorm(x, residual, w, eps),
        "silu and mul": lambda: ops.silu_and_mul(gate_up),
    }

    def chain() -> None:
        for kernel in kernels.values():
            kernel()

    return chain, kernels, len(kernels) + 1  # the attention's merge is a launch of its own


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-3.1-8b,llama-3.2-1b")
    p.add_argument("--kv-len", type=int, default=512)
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)
    import torch

    from benchmark.suite import model_config

    gpu = torch.cuda.get_device_name()
    rates = measure_rates("cuda")
    one = torch.zeros(1, device="cuda")
    rows = []
    print(f"{gpu}: batch-1 decode, small kernels of every layer from one CUDA graph, KV of {args.kv_len} tokens")
    for name in args.models.split(","):
        config = model_config(name)
        layers = config["num_hidden_layers"]
        chain, kernels, launches = layer_chain(config, args.kv_len)

        def step() -> None:
            for _ in range(layers):
                chain()

        def empty() -> None:
            for _ in range(layers * launches):
                one.add_(1)

        row = {"model": name, "layers": layers, "launches_per_layer": launches, "kv_len": args.kv_len,
               "small_kernels_ms": graph_ms(step), "empty_launches_ms": graph_ms(empty),
               "per_kernel_us": {k: graph_ms(lambda f=f: [f() for _ in range(layers)]) * 1000 / layers  # type: ignore[misc]
                                 for k, f in kernels.items()}}
        rows.append(row)
        print(f"{name}: {layers} layers x {launches} launches: small kernels {row['small_kernels_ms']:.3f} ms a step, "
              f"as many empty launches {row['empty_launches_ms']:.3f} ms", flush=True)
        for k, us in row["per_kernel_us"].items():
            print(f"    {k:>36}: {us:6.2f} us a launch, alone in a graph of {layers}")
    save_rows(args.out, gpu, "small_kernels.json", rates, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
