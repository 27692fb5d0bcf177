"""Prefill attention alone: FlashInfer's FA2 and FA3 (Hopper) paged prefill kernels, per layer call.

A lone prompt of n tokens (causal over itself) and a chunk of n tokens after a cached prefix of the
same length, through `FlashInferAttentionBackend` as a step runs it (K/V appended to the pages,
then the planned prefill wrapper), with the Llama-3.1-8B heads (32 query, 8 KV, head dim 128) in
bfloat16. Beside each time, the attention FLOPs it implies per second (causal: half the score
matrix), and each kernel's largest error against a float32 attention of the same q, K and V.

    python -m benchmark.prefill_attention [--lens 512,2048,8192]

GPU time per call between CUDA events, median of 20 after 5 unrecorded. Prints a table; writes
`prefill_attention.json` under `--out` (default benchmark/results/local/<GPU>/).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS

PAGE = 16
HEADS, KV_HEADS, DIM = 32, 8, 128


def layout(prefix: int, n: int) -> Any:
    from flashserve.attention.base import BatchLayout

    total = prefix + n
    pages = (total + PAGE - 1) // PAGE
    return BatchLayout(page_size=PAGE, qo_indptr=[0, n], kv_indptr=[0, pages], kv_indices=list(range(1, 1 + pages)),
                       kv_last_page_len=[(total - 1) % PAGE + 1], positions=list(range(prefix, total)))  # fmt: skip


def reference(q: Any, k: Any, v: Any, prefix: int) -> Any:
    """float32 causal attention of q [n, H, D] over k/v [prefix + n, Hkv, D]."""
    import torch

    n, total = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) / DIM**0.5
    mask = torch.arange(total, device=q.device)[None, :] > (prefix + torch.arange(n, device=q.device))[:, None]
    scores.masked_fill_(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf)


def measure(backend_name: str, prefix: int, n: int, seed: int) -> dict[str, Any]:
    import torch

    from benchmark.decode_bench import time_ms
    from flashserve.attention.flashinfer import FlashInferAttentionBackend

    total = prefix + n
    pages = (total + PAGE - 1) // PAGE + 2
    backend = FlashInferAttentionBackend(1, pages, PAGE, KV_HEADS, DIM, torch.bfloat16, "cuda", num_qo_heads=HEADS,
                                         prefill_backend=backend_name)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(n, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    if prefix:  # the cached prefix's K/V, appended by a step before
        backend.plan(layout(0, prefix))
        backend.forward(0, q.new_zeros(prefix, HEADS, DIM), k[:prefix], v[:prefix])
    backend.plan(layout(prefix, n))
    out = backend.forward(0, q, k[prefix:], v[prefix:])
    err = (out.float() - reference(q, k, v, prefix)).abs().max().item()
    ms = time_ms(lambda: backend.forward(0, q, k[prefix:], v[prefix:]), 5, 20)
    flops = 4 * HEADS * DIM * (n * prefix + n * (n + 1) / 2)
    return {"backend": backend_name, "prefix": prefix, "tokens": n, "us": ms * 1e3,
            "TFLOP_per_s": flops / (ms / 1e3) / 1e12, "max_abs_err_vs_fp32": err}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="512,2048,8192")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name()
    rows = []
    for n in (int(x) for x in args.lens.split(",")):
        for prefix in (0, n):
            for name in ("fa2", "fa3"):
                try:
                    rows.append(measure(name, prefix, n, seed=n))
                except Exception as exc:  # noqa: BLE001 - one kernel failing must not end the table
                    rows.append({"backend": name, "prefix": prefix, "tokens": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
    print(f"Prefill attention per layer call on {gpu}: 8B heads ({HEADS}/{KV_HEADS}, D={DIM}), bf16, page {PAGE}")
    print("| tokens | cached prefix | backend | us | TFLOP/s | max abs err vs fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['tokens']} | {r['prefix']} | {r['backend']} | {r['error']} | | |")
        else:
            print(f"| {r['tokens']} | {r['prefix']} | {r['backend']} | {r['us']:.0f} | {r['TFLOP_per_s']:.0f} | "
                  f"{r['max_abs_err_vs_fp32']:.2e} |")  # fmt: skip
    out = Path(args.out) if args.out else LOCAL_RESULTS / re.sub(r"\W+", "_", gpu)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_attention.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
