"""Prefill attention alone, per layer call: FlashInfer's paged prefill (FA2, or FA3 on Hopper) against
the step's last prompts attended apart (the backend's default from `RAGGED_MIN_TOKENS` tokens: the
ragged pass over the step's own K/V, FA3 on Hopper, a second pass over their cached tokens' pages
for prompts that continue, merged, and the other rows over their pages).

Three steps of n new tokens, through `FlashInferAttentionBackend` as a step runs them (K/V appended
to the pages, then the planned passes), with the Llama-3.1-8B heads (32 query, 8 KV, head dim 128),
bf16 queries and a bf16 or FP8 KV cache: a lone prompt, a chunk after a cached prefix of n tokens,
and 40 decode rows over 1,000 cached tokens each beside a fresh prompt of n tokens or beside a
chunk of n tokens after n cached ones. Beside each time, the attention FLOPs per second (causal: half the score matrix
of the new tokens) and the largest error against a float32 attention of the same q, K and V.

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
DECODES = 40  # the mixed step's decode rows
DECODE_CONTEXT = 1000  # tokens each decode row has cached
MODES = {"paged fa2": ("fa2", False), "paged fa3": ("fa3", False), "apart": ("fa2", True)}


def steps(n: int) -> dict[str, list[tuple[int, int]]]:
    """Each case's rows as (cached tokens, new tokens)."""
    return {"lone prompt": [(0, n)], "after a prefix": [(n, n)],
            f"{DECODES} decodes + prompt": [(DECODE_CONTEXT, 1)] * DECODES + [(0, n)],
            f"{DECODES} decodes + chunk after a prefix": [(DECODE_CONTEXT, 1)] * DECODES + [(n, n)]}  # fmt: skip


def layout(rows: list[tuple[int, int]], new: bool = True) -> Any:
    """The step of `rows` (`new`), or the step that cached their prefixes (their cached tokens as
    new ones, rows without any left out)."""
    from flashserve.attention.base import BatchLayout
    from flashserve.engine.outputs import ScheduledRequest
    from flashserve.message.sampling_params import SamplingParams

    first, built, params = 1, [], SamplingParams()
    for i, (cached, n) in enumerate(rows):
        pages = list(range(first, first + (cached + n + PAGE - 1) // PAGE))
        first += len(pages)
        if new:
            built.append(ScheduledRequest(str(i), [1] * n, cached, pages, True, params))
        elif cached:
            built.append(ScheduledRequest(str(i), [1] * cached, 0, pages, True, params))
    return BatchLayout.build(built, PAGE)


def reference(q: Any, k: Any, v: Any, rows: list[tuple[int, int]]) -> Any:
    """float32 causal attention of each row's new queries over its cached and new K/V
    (`k`/`v`: every row's cached then new tokens, row after row)."""
    import torch

    group = HEADS // KV_HEADS
    out, qi, ki = [], 0, 0
    for cached, n in rows:
        total = cached + n
        kf = k[ki : ki + total].float().repeat_interleave(group, dim=1)
        vf = v[ki : ki + total].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qi : qi + n].float(), kf) / DIM**0.5
        mask = torch.arange(total, device=q.device)[None, :] > (cached + torch.arange(n, device=q.device))[:, None]
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, float("-inf")).softmax(-1), vf))
        qi, ki = qi + n, ki + total
    return torch.cat(out)


def measure(mode: str, case: str, rows: list[tuple[int, int]], cache_dtype: Any, seed: int) -> dict[str, Any]:
    import torch

    from benchmark.decode_bench import time_ms
    from flashserve.attention import flashinfer as fi_module
    from flashserve.attention.flashinfer import FlashInferAttentionBackend

    prefill_backend, apart = MODES[mode]
    pages = sum((c + n + PAGE - 1) // PAGE for c, n in rows) + 2
    backend = FlashInferAttentionBackend(1, pages, PAGE, KV_HEADS, DIM, torch.bfloat16, "cuda", num_qo_heads=HEADS,
                                         prefill_backend=prefill_backend, kv_cache_dtype=cache_dtype)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(c + n for c, n in rows)
    q = torch.randn(sum(n for _, n in rows), HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    cached_rows = [i for i, (c, _) in enumerate(rows) if c]
    starts = [sum(c + n for c, n in rows[:i]) for i in range(len(rows))]
    old = [torch.arange(s, s + rows[i][0], device="cuda") for i, s in ((i, starts[i]) for i in cached_rows)]
    new = torch.cat([torch.arange(s + c, s + c + n, device="cuda") for s, (c, n) in zip(starts, rows)])
    if old:  # the cached prefixes' K/V, appended by a step before
        idx = torch.cat(old)
        backend.plan(layout(rows, new=False))
        backend.forward(0, q.new_zeros(len(idx), HEADS, DIM), k[idx], v[idx])
    saved = fi_module.RAGGED_MIN_TOKENS
    fi_module.RAGGED_MIN_TOKENS = saved if apart else 1 << 30
    try:
        backend.plan(layout(rows))
    finally:
        fi_module.RAGGED_MIN_TOKENS = saved
    kn, vn = k[new], v[new]
    out = backend.forward(0, q, kn, vn)
    err = (out.float() - reference(q, k, v, rows)).abs().max().item()
    ms = time_ms(lambda: backend.forward(0, q, kn, vn), 5, 20)
    flops = sum(4 * HEADS * DIM * (n * c + n * (n + 1) / 2) for c, n in rows)
    return {"mode": mode, "case": case, "cache": str(cache_dtype).removeprefix("torch."), "tokens": rows[-1][1],
            "us": ms * 1e3, "TFLOP_per_s": flops / (ms / 1e3) / 1e12, "max_abs_err_vs_fp32": err}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="512,2048,8192")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    gpu = torch.cuda.get_device_name()
    rows = []
    for n in (int(x) for x in args.lens.split(",")):
        for case, step in steps(n).items():
            for cache in (torch.bfloat16, torch.float8_e4m3fn):
                for mode in MODES:
                    if mode == "paged fa3" and cache != torch.bfloat16:
                        continue  # FA3 does not read an FP8 cache beside bf16 queries
                    try:
                        rows.append(measure(mode, case, step, cache, seed=n))
                    except Exception as exc:  # noqa: BLE001 - one kernel failing must not end the table
                        rows.append({"mode": mode, "case": case, "cache": str(cache).removeprefix("torch."),
                                     "tokens": n, "error": f"{type(exc).__name__}: {exc}"[:300]})  # fmt: skip
    print(f"Prefill attention per layer call on {gpu}: 8B heads ({HEADS}/{KV_HEADS}, D={DIM}), bf16 queries, page {PAGE}")
    print("| new prompt tokens | step | KV cache | attention | us | TFLOP/s | max abs err vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['tokens']} | {r['case']} | {r['cache']} | {r['mode']} |"
        if "error" in r:
            print(f"{head} {r['error']} | | |")
        else:
            print(f"{head} {r['us']:.0f} | {r['TFLOP_per_s']:.0f} | {r['max_abs_err_vs_fp32']:.2e} |")
    out = Path(args.out) if args.out else LOCAL_RESULTS / re.sub(r"\W+", "_", gpu)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_attention.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
