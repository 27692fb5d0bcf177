"""What structured output costs: 64 concurrent JSON-schema requests against the same requests
unconstrained (same output lengths), and time to first token for a new schema vs a cached one.

    python -m benchmark.structured_bench --model llama-3.1-8b --tokenizer .whl/llama3-tokenizer

Starts `flashserve serve --load-format dummy`. The requests are text completions with vLLM's
`structured_outputs: {"json": schema}` (the Llama-3 tokenizer from PyPI has no chat template; chat's
response_format compiles to the same grammar and runs the same engine path). With random weights the constrained outputs end when
their grammar does, so each unconstrained request then asks for exactly as many tokens (ignore_eos),
and both phases of a round decode the same token counts. The two phases alternate `--repeat` times
(3) and the round of the median ratio is kept, with every round's ratio beside it (the unconstrained
phase alone moves by 10-15% between runs on a GPU machine). Prints a table and writes JSON and a PNG under
`benchmark/results/local/<GPU>/structured/` (`--out DIR`: DIR/<GPU>/structured/), with the batch's decode-step floor (weights + KV read at the
measured copy bandwidth) beside the measured per-token time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmark import LOCAL_RESULTS
from benchmark import floor as fl
from benchmark.server_process import free_port, stop, wait_ready

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "integer"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "colour", "hobbies", "address"],
    "additionalProperties": False,
}


def unbounded(schema: Any) -> Any:
    """The schema without maxLength / maxItems: xgrammar's mask inside a length-bounded string
    costs far more per row than inside a free one."""
    if isinstance(schema, dict):
        return {k: unbounded(v) for k, v in schema.items() if k not in ("maxLength", "maxItems")}
    return schema


def prompt(i: int) -> str:
    return f"Describe person number {i} as JSON with name, age, colour, hobbies and address:\n"


async def complete(client: httpx.AsyncClient, base: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: TTFT, latency, completion tokens, text."""
    t0 = time.perf_counter()
    first = None
    text = []
    usage: dict[str, Any] = {}
    payload = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **body}
    async with client.stream("POST", f"{base}/v1/completions", json=payload) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread()).decode()[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                piece = choice.get("text")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "latency": end - t0, "tokens": usage.get("completion_tokens", 0),
            "text": "".join(text)}


async def phase(base: str, model: str, bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(complete(client, base, model, b) for b in bodies))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    per_token = [(r["latency"] - r["ttft"]) / max(r["tokens"] - 1, 1) for r in results if r["tokens"] > 1]
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "median_ttft_ms": 1e3 * statistics.median(r["ttft"] for r in results),
            "median_tpot_ms": 1e3 * statistics.median(per_token) if per_token else None,
            "token_counts": [r["tokens"] for r in results], "_texts": [r["text"] for r in results]}


async def schema_ttft(base: str, model: str, rounds: int, base_schema: dict[str, Any]) -> dict[str, Any]:
    """TTFT of a request whose schema the server has not seen (compile) and of the same again (cached)."""
    new, cached = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(rounds):
            fresh = {f"field_{i}_{time.time_ns()}": {"type": "integer"}}
            schema = {**base_schema, "properties": {**base_schema["properties"], **fresh}}
            body = {"prompt": prompt(i), "max_tokens": 4, "temperature": 0, "structured_outputs": {"json": schema}}
            new.append((await complete(client, base, model, body))["ttft"])
            cached.append((await complete(client, base, model, body))["ttft"])
    return {"new_schema_ttft_ms": 1e3 * statistics.median(new), "cached_schema_ttft_ms": 1e3 * statistics.median(cached),
            "rounds": rounds}


@contextlib.contextmanager
def sampled(pid: int | None, path: Path) -> Iterator[None]:
    """py-spy samples process `pid` (all threads, with native frames off) while the block runs and
    writes collapsed stacks to `path`; nothing when pid is None."""
    if pid is None:
        yield
        return
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                            "--threads", "--nonblocking", "-o", str(path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)


async def run(base: str, model: str, concurrency: int, max_tokens: int, rounds: int,
              schema: dict[str, Any], spy_pid: int | None = None, out_dir: Path = Path("."),
              repeat: int = 3) -> dict[str, Any]:
    """The two phases `repeat` times, interleaved (a slow moment hits both alike); the round of the
    median throughput ratio is kept, and every round's ratio is recorded. py-spy samples round 1."""
    constrained = [{"prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                    "structured_outputs": {"json": schema}} for i in range(concurrency)]
    await phase(base, model, constrained[:4])  # compile the schema once, outside the timing
    json_runs: list[dict[str, Any]] = []
    plain_runs: list[dict[str, Any]] = []
    for r in range(repeat):
        with sampled(spy_pid if r == 0 else None, out_dir / "profile_json_schema.txt"):
            json_runs.append(await phase(base, model, constrained))
        # The round's own counts: near-uniform logits of random weights let a draw change with the
        # batch's numerics, so rounds can differ.
        plain = [{"prompt": prompt(i), "max_tokens": max(n, 1), "temperature": 0.8, "seed": i, "ignore_eos": True}
                 for i, n in enumerate(json_runs[-1]["token_counts"])]
        with sampled(spy_pid if r == 0 else None, out_dir / "profile_unconstrained.txt"):
            plain_runs.append(await phase(base, model, plain))
    ratios = [j["tokens_per_s"] / u["tokens_per_s"] for j, u in zip(json_runs, plain_runs)]
    # The round of the median ratio, both phases of it (they decode the same counts).
    middle = sorted(range(repeat), key=lambda r: ratios[r])[(repeat - 1) // 2]
    json_run, plain_run = json_runs[middle], plain_runs[middle]
    json_run["round_ratios"] = ratios
    valid = 0
    for text in json_run.pop("_texts"):
        try:
            valid += isinstance(json.loads(text), dict)
        except ValueError:
            pass
    plain_run.pop("_texts")
    return {"json_schema": {**json_run, "valid_json": valid}, "unconstrained": plain_run,
            "compile": await schema_ttft(base, model, rounds, schema)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokenizer", default=".whl/llama3-tokenizer")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5, help="new-schema TTFT measurements")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds of both phases (the median round is kept)")
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    p.add_argument("--unbounded", action="store_true", help="the schema without maxLength / maxItems")
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--profile", action="store_true",
                   help="sample the server with py-spy during both phases (collapsed stacks beside the JSON)")
    args = p.parse_args(argv)

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rates = fl.measure_rates()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    out_dir = Path(args.out) / gpu.replace(" ", "_") / ("structured_unbounded" if args.unbounded else "structured")
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flashserve", "serve", "--load-format", "dummy", "--model", args.model,
           "--tokenizer", args.tokenizer, "--port", str(port), "--log-level", "warning", *args.server_arg]
    with open(out_dir / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            error = wait_ready(proc, base, time.monotonic() + 900, 128_256)
            if error:
                raise SystemExit(f"server: {error}")
            model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
            schema = unbounded(SCHEMA) if args.unbounded else SCHEMA
            doc = asyncio.run(run(base, model, args.concurrency, args.max_tokens, args.rounds, schema,
                                  proc.pid if args.profile else None, out_dir, args.repeat))
        finally:
            stop(proc)
    from benchmark.suite import model_config

    shape = fl.ModelShape.from_config(model_config(args.model))
    mean_len = statistics.mean(doc["json_schema"]["token_counts"]) / 2 + 30
    floor_ms = 1e3 * fl.decode_step_floor_s(shape, rates, [int(mean_len)] * args.concurrency)
    js, un = doc["json_schema"], doc["unconstrained"]
    doc.update(gpu=gpu, model=args.model, schema="unbounded" if args.unbounded else "bounded", rates=rates.to_json(), decode_step_floor_ms=floor_ms,
               throughput_ratio=js["tokens_per_s"] / un["tokens_per_s"])
    rows = [("phase", "tokens", "tok/s", "median TPOT ms", "median TTFT ms"),
            *[(name, r["tokens"], f"{r['tokens_per_s']:.0f}", f"{r['median_tpot_ms']:.2f}", f"{r['median_ttft_ms']:.1f}")
              for name, r in (("json_schema", js), ("unconstrained", un))]]
    print(f"{gpu}, {args.model} (dummy weights), {args.concurrency} concurrent streams")
    for row in rows:
        print("  ".join(f"{c!s:>16}" for c in row))
    print(f"json_schema / unconstrained throughput (median round): {doc['throughput_ratio']:.3f}; per round "
          f"{', '.join(f'{r:.3f}' for r in js['round_ratios'])}; valid JSON {js['valid_json']}/{js['requests']}")
    print(f"decode-step floor at batch {args.concurrency}: {floor_ms:.2f} ms")
    print(f"TTFT new schema {doc['compile']['new_schema_ttft_ms']:.1f} ms, cached {doc['compile']['cached_schema_ttft_ms']:.1f} ms")
    (out_dir / "structured.json").write_text(json.dumps(doc, indent=2))
    plot(doc, out_dir / "structured.png")
    return 0


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = ["json_schema", "unconstrained"]
    values = [doc[n]["median_tpot_ms"] for n in names]
    ax.bar(names, values, color=["tab:orange", "tab:blue"])
    ax.axhline(doc["decode_step_floor_ms"], color="k", ls="--", label="decode-step floor")
    ax.set_ylabel("median time per output token (ms)")
    ax.set_title(f"{doc['gpu']}, {doc['model']}: structured output, {doc['json_schema']['requests']} streams")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
