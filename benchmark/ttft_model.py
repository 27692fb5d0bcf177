"""What P99 TTFT the seed protocol allows for a given prefill speed: a model of the engine's
scheduling, fed with step costs, not a measurement.

The seed protocol's workload (SGLang's random, range ratio 0.25: inputs uniform in 512-2,048
tokens, outputs in 64-256, Poisson arrivals) through the scheduler's policy: one step at a time;
running requests first, oldest first, each a decode token or its next prefill chunk; then waiting
requests first come, first served, while the step's token budget lasts (with `--max-prefill-tokens`,
while the step's prompt tokens stay within it too; with `--chunked-prefill-size`, a step that
streams wait on holds at most that many prompt tokens). A step's time is the
longer of a decode step (the weights read once, `--decode-ms`, plus `--row-ms` a decode row) and
its prefill tokens' compute (`--prefill-ms-per-token` each), plus `--row-ms` a decode row: a
prefill chunk reads the same weights while it computes. With `--additive` it is their sum instead
(plus `--prefill-step-ms` for a step with prompt tokens), as `benchmark.mixed_step` measured steps
that carry both: the decode rows' attention does not hide under the prompt's GEMMs. `--overlap`
schedules each step as the one before begins. The host and the network are left out, so the
figures are what the step costs alone allow.

    python -m benchmark.ttft_model                        # the 70B at TP 4 on H200s, as measured
    python -m benchmark.ttft_model --decode-ms 4.9 --prefill-ms-per-token 0.0261 --floor-ms-per-token 0.0183 \\
        --rates 12 16 20 24                              # the 8B on one H200
    python -m benchmark.ttft_model --additive --overlap --decode-ms 3.35 --row-ms 0.0625 --prefill-step-ms 1.9 \\
        --prefill-ms-per-token 0.0105 --floor-ms-per-token 0.0105 --max-prefill-tokens 2048 --rates 24 \\
        --chunked-prefill-size 1024 [--deadline-ms 80]   # the FP8 8B on one H200, from its mixed steps

For each rate: median and P99 TTFT and ITL at the measured prefill speed (`--prefill-ms-per-token`,
a lone 2,048-token prompt's TTFT over 2,048) and at fractions of the way to its compute floor
(`--floor-ms-per-token`). Prints a table; writes ttft_model.json under `--out` when given.

With `--replay SERVER_LOG` (a `flashserve serve` log, gzipped or not, with its request lines) the
model runs the requests the server logged instead of random ones: each run of requests (a pause of
more than 5 s between two arrivals starts the next) with the arrivals, prompt and output tokens the
server saw, beside the TTFT the server logged for them (from the handler's start, so the client's
side is left out of both):

    python -m benchmark.ttft_model --overlap --decode-ms 8.95 --prefill-ms-per-token 0.0482 \
        --max-prefill-tokens 2048 --replay server_70b-tp4rank-fp8.log.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import statistics
from pathlib import Path
from typing import Any


def simulate(rate: float, prefill_ms_per_token: float, decode_ms: float, row_ms: float, budget: int,
             num_requests: int, seed: int, max_prefill: int = 0, chunk: int = 0, additive: bool = False,
             prefill_step_ms: float = 0.0, deadline_ms: float = 0.0, overlap: bool = False,
             arrivals: list[tuple[float, int, int]] | None = None) -> dict[str, float]:  # fmt: skip
    """Median and P99 TTFT and ITL (ms) of `num_requests` Poisson arrivals at `rate` req/s.
    `max_prefill`: the scheduler's `max_prefill_tokens`, `chunk` its `chunked_prefill_size` (0: no bound).
    `additive`: a step costs `decode_ms` + `row_ms` a decode row + (`prefill_step_ms` + its prompt
    tokens' compute, if it has any), the mixed steps of `benchmark.mixed_step`; otherwise the longer
    of a decode step and the prompt tokens' compute, plus the rows (and `prefill_step_ms` if it has
    prompt tokens). `deadline_ms`: a step that streams
    wait on holds more than `chunk` prompt tokens (up to `max_prefill`) while a prompt that has no
    first token yet has waited that long. `overlap`: each step is scheduled when the one before it
    starts (the engine's overlap scheduling), so it admits only prompts that had arrived by then.
    `arrivals`: (ms, prompt tokens, output tokens) of each request, in order, instead of `num_requests`
    drawn at `rate` from `seed` (the seed protocol's lengths)."""
    if arrivals is None:
        rng = random.Random(seed)
        t, arrivals = 0.0, []
        for _ in range(num_requests):
            t += rng.expovariate(rate) * 1e3
            arrivals.append((t, rng.randint(512, 2048), rng.randint(64, 256)))
    num_requests = len(arrivals)
    waiting: list[dict[str, Any]] = []
    running: list[dict[str, Any]] = []
    ttft: list[float] = []
    itl: list[float] = []
    now, nxt, done = 0.0, 0, 0
    seen = 0.0  # arrivals up to this time are known when the step is scheduled
    while done < num_requests:
        while nxt < num_requests and arrivals[nxt][0] <= seen:
            a, prompt, out = arrivals[nxt]
            waiting.append({"arrival": a, "prefill": prompt, "out": out, "last": None})
            nxt += 1
        left, rows, prompt_tokens = budget, [], 0
        cap = chunk if chunk and any(r["last"] is not None for r in running) else budget  # streams wait
        if cap < budget and deadline_ms:
            first = [r["arrival"] for r in running if r["last"] is None] + [r["arrival"] for r in waiting[:1]]
            if first and now - min(first) >= deadline_ms:
                cap = max_prefill or budget  # a first token is late: steps of whole prompts until it is out
        for r in running:
            if left <= 0:
                break
            n = min(r["prefill"], left, cap - prompt_tokens) if r["prefill"] else 1
            if n <= 0:
                continue
            rows.append((r, n, r["prefill"] > 0))
            left -= n
            prompt_tokens += n if r["prefill"] else 0
        while waiting and left > 0:
            n = min(waiting[0]["prefill"], left)
            if max_prefill and prompt_tokens and prompt_tokens + n > max_prefill:
                break
            n = min(n, cap - prompt_tokens)
            if n <= 0:
                break
            r = waiting.pop(0)
            running.append(r)
            rows.append((r, n, True))
            left -= n
            prompt_tokens += n
        if not rows:
            now = seen = arrivals[nxt][0]  # an idle engine takes the next arrival at once
            continue
        start = now
        prefill = sum(n for _, n, is_prefill in rows if is_prefill)
        decodes = sum(1 for _, _, is_prefill in rows if not is_prefill)
        if additive:
            now += decode_ms + row_ms * decodes + (prefill_step_ms + prefill * prefill_ms_per_token if prefill else 0.0)
        else:
            now += max(decode_ms, prefill * prefill_ms_per_token) + row_ms * decodes
            now += prefill_step_ms if prefill else 0.0
        seen = start if overlap else now  # with overlap the next step was scheduled as this one began
        for r, n, is_prefill in rows:
            if is_prefill:
                r["prefill"] -= n
            if r["prefill"]:
                continue  # a chunk that samples nothing
            if r["last"] is None:
                ttft.append(now - r["arrival"])
            else:
                itl.append(now - r["last"])
            r["last"] = now
            r["out"] -= 1
            if r["out"] <= 0:
                running.remove(r)
                done += 1

    return {"median_ttft_ms": statistics.median(ttft), "p99_ttft_ms": p99(ttft), "median_itl_ms": statistics.median(itl),
            "p99_itl_ms": p99(itl)}  # fmt: skip


def p99(xs: list[float]) -> float:
    """The 99th percentile as the seed protocol's clients take it: the value below which 99% fall."""
    return sorted(xs)[max(0, int(len(xs) * 0.99) - 1)]


_REQUEST_LINE = re.compile(r"^(\S+ \S+) .*flashserve\.requests: request \S+ finished: prompt_tokens=(\d+) "
                           r"completion_tokens=(\d+) ttft=([\d.]+)s latency=([\d.]+)s")


def logged_runs(lines: Any, pause_s: float = 5.0) -> list[list[dict[str, float]]]:
    """The finished requests of a server log (`metrics.py`'s request lines), by arrival, split into runs
    where more than `pause_s` passes between two arrivals: each {"arrival" s, "prompt", "output", "ttft_ms"}."""
    import datetime

    reqs = []
    for line in lines:
        m = _REQUEST_LINE.match(line)
        if m is None:
            continue
        end = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        reqs.append({"arrival": end - float(m[5]), "prompt": int(m[2]), "output": int(m[3]),
                     "ttft_ms": float(m[4]) * 1e3})
    reqs.sort(key=lambda r: r["arrival"])
    runs: list[list[dict[str, float]]] = []
    for r in reqs:
        if not runs or r["arrival"] - runs[-1][-1]["arrival"] > pause_s:
            runs.append([])
        runs[-1].append(r)
    return runs


def replay(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each logged run through the model at `--prefill-ms-per-token`, beside the server's TTFTs."""
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        runs = logged_runs(f)
    print("| run | requests | mean prompt tokens | span s | model median / P99 TTFT ms | logged median / P99 TTFT ms |")
    print("|---|---|---|---|---|---|")
    rows = []
    for i, run in enumerate(runs):
        t0 = run[0]["arrival"]
        arrivals = [((r["arrival"] - t0) * 1e3, int(r["prompt"]), max(1, int(r["output"]))) for r in run]
        model = simulate(0.0, args.prefill_ms_per_token, args.decode_ms, args.row_ms, args.budget, 0, 0,
                         args.max_prefill_tokens, args.chunked_prefill_size, args.additive, args.prefill_step_ms,
                         args.deadline_ms, args.overlap, arrivals=arrivals)  # fmt: skip
        logged = [r["ttft_ms"] for r in run]
        row = {"run": i, "requests": len(run), "mean_prompt": statistics.mean(r["prompt"] for r in run),
               "span_s": run[-1]["arrival"] - t0, "model": model,
               "logged": {"median_ttft_ms": statistics.median(logged), "p99_ttft_ms": p99(logged)}}  # fmt: skip
        rows.append(row)
        got = row["logged"]
        print(f"| {i} | {len(run)} | {row['mean_prompt']:.0f} | {row['span_s']:.1f} | {model['median_ttft_ms']:.0f} / "
              f"{model['p99_ttft_ms']:.0f} | {got['median_ttft_ms']:.0f} / {got['p99_ttft_ms']:.0f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults: the 70B at TP 4 on H200s (benchmark/results/NVIDIA_H200/seed_protocol): a lone
    # 2,048-token prompt 145 ms in the engine, floor 88.9 ms; c1 ITL 11.95 ms.
    p.add_argument("--prefill-ms-per-token", type=float, default=145.0 / 2048)
    p.add_argument("--floor-ms-per-token", type=float, default=88.9 / 2048)
    p.add_argument("--decode-ms", type=float, default=11.95)
    p.add_argument("--row-ms", type=float, default=0.02, help="a decode row's share of a step")
    p.add_argument("--budget", type=int, default=8192, help="--max-num-batched-tokens")
    p.add_argument("--max-prefill-tokens", type=int, default=0, help="the scheduler's --max-prefill-tokens (0: no bound)")
    p.add_argument("--chunked-prefill-size", type=int, default=0, help="the scheduler's --chunked-prefill-size (0: no bound)")
    p.add_argument("--additive", action="store_true",
                   help="a step costs the decode step plus its prompt tokens' (benchmark.mixed_step), not the longer")
    p.add_argument("--prefill-step-ms", type=float, default=0.0, help="what a step with prompt tokens costs beyond "
                   "the decode step (with --additive) and their per-token compute")
    p.add_argument("--deadline-ms", type=float, default=0.0, help="with --chunked-prefill-size: steps of whole "
                   "prompts (to --max-prefill-tokens) while a first token has waited this long (0: never)")
    p.add_argument("--overlap", action="store_true", help="each step admits only prompts that arrived before the "
                   "step before it began (overlap scheduling)")
    p.add_argument("--rates", type=float, nargs="+", default=[4.0, 5.0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--seeds", type=int, default=3, help="runs per cell, the mean of their figures")
    p.add_argument("--out", default=None)
    p.add_argument("--replay", type=Path, default=None, help="a server log: run its logged requests (see above)")
    args = p.parse_args(argv)
    if args.replay is not None:
        rows = replay(args.replay, args)
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "ttft_replay.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                              "runs": rows}, indent=1))
        return 0
    speeds = [(f"{f:.0%} of the way to the floor", args.prefill_ms_per_token - f * (args.prefill_ms_per_token - args.floor_ms_per_token))
              for f in (0.0, 0.5, 1.0)]  # fmt: skip
    rows = []
    print("| rate (req/s) | prefill speed | ms / 2,048-token prompt | median TTFT | P99 TTFT | median ITL | P99 ITL |")
    print("|---|---|---|---|---|---|---|")
    for rate in args.rates:
        for name, per_token in speeds:
            runs = [simulate(rate, per_token, args.decode_ms, args.row_ms, args.budget, args.requests, seed,
                             args.max_prefill_tokens, args.chunked_prefill_size, args.additive, args.prefill_step_ms,
                             args.deadline_ms, args.overlap) for seed in range(args.seeds)]  # fmt: skip
            row = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
            row.update(rate=rate, speed=name, prompt_2048_ms=per_token * 2048)
            rows.append(row)
            print(f"| {rate:g} | {name} | {per_token * 2048:.1f} | {row['median_ttft_ms']:.0f} | {row['p99_ttft_ms']:.0f} "
                  f"| {row['median_itl_ms']:.1f} | {row['p99_itl_ms']:.0f} |")  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ttft_model.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
