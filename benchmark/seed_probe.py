"""A running server's lone-prompt TTFT and single-stream ITL against their floors, and its first request.

    python -m benchmark.seed_probe --base-url http://127.0.0.1:8000 --model llama-3.1-70b --tp 4 \
        --rates rates.json --out probe.json

Run right after `/health` first answers 200, before any other traffic:
- `first`: the first request (a prompt of `--prompt-len` token ids, one output token), then
  `--repeats` more of the same length with other tokens: the first's TTFT over the median of the
  rest says what warm-up left to the first requests (the target is at most 1.2x);
- `lone`: the median of those repeats against the first-token floor per GPU
  (`benchmark.floor.first_token_floor_s` over the tensor-parallel ranks, at the rates that
  `python -m benchmark.floor` measured on this machine before the server started);
- `c1`: `--c1-requests` streams one after another, `--c1-len` tokens in and out, each token
  counted from the stream (ignore_eos): the median inter-token latency against the decode-step
  floor (weights and context read once per step, per GPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from benchmark.floor import ModelShape, decode_step_floor_s, first_token_floor_s, load_rates


def stream_times(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds from sending to each streamed chunk that carries text or a token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    t0 = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices:
                times.append(time.perf_counter() - t0)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.seed_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served id, also the dummy config's name (e.g. llama-3.1-70b)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--rates", type=Path, help="rates JSON of `python -m benchmark.floor --out` (no floors without)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--c1-len", type=int, default=128)
    p.add_argument("--c1-requests", type=int, default=5)
    p.add_argument("--vocab", type=int, default=128000, help="token ids are drawn below this")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rng = random.Random(0)
    url = args.base_url.rstrip("/") + "/v1/completions"
    prompt = lambda n: [rng.randrange(1000, args.vocab) for _ in range(n)]  # noqa: E731
    with httpx.Client(timeout=600.0) as client:
        first = stream_times(client, url, args.model, prompt(args.prompt_len), 1)[0]
        rest = [stream_times(client, url, args.model, prompt(args.prompt_len), 1)[0] for _ in range(args.repeats)]
        itls: list[float] = []
        for _ in range(args.c1_requests):
            times = stream_times(client, url, args.model, prompt(args.c1_len), args.c1_len)
            itls += [b - a for a, b in zip(times, times[1:])]
    lone = statistics.median(rest)
    itl = statistics.median(itls)
    doc: dict[str, Any] = {
        "model": args.model, "tp": args.tp, "prompt_len": args.prompt_len,
        "first_ttft_ms": first * 1e3, "lone_ttft_ms": {"median": lone * 1e3, "min": min(rest) * 1e3, "n": len(rest)},
        "first_over_median": first / lone, "c1_len": args.c1_len, "c1_itl_ms": {"median": itl * 1e3, "n": len(itls)},
    }  # fmt: skip
    if args.rates:
        from flashserve.model_loader.dummy import dummy_hf_config

        shape = ModelShape.from_config(dummy_hf_config(args.model))
        rates = load_rates(args.rates)
        doc["rates"] = {"device": rates.device, "copy_TB_s": rates.copy_bytes_per_s / 1e12,
                        "matmul_TFLOP_s": rates.matmul_flop_per_s / 1e12}  # fmt: skip
        doc["lone_floor_ms"] = first_token_floor_s(shape, rates, [args.prompt_len]) * 1e3 / args.tp
        doc["c1_floor_ms"] = decode_step_floor_s(shape, rates, [args.c1_len * 3 // 2]) * 1e3 / args.tp
        doc["lone_over_floor"] = doc["lone_ttft_ms"]["median"] / doc["lone_floor_ms"]
        doc["c1_over_floor"] = doc["c1_itl_ms"]["median"] / doc["c1_floor_ms"]
    print(json.dumps(doc, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
