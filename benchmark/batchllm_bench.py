"""Shared prefixes offline (BatchLLM's shape) and cascade decode, through `flashserve.LLM` on one GPU.

    python -m benchmark.batchllm_bench --model llama-3.2-1b
    python -m benchmark.batchllm_bench --groups 100 --decode-groups 4 --decode-requests 256

Offline: G groups x 16 prompts of `--shared` shared + `--unique` own random token ids, 100 out,
greedy, ignore_eos, shuffled, in one `LLM.generate` per configuration: no prefix caching; prefix
caching in arrival order; prefix-sharing groups; groups + cascade attention (`on`).
Each run gets prompts of its own (different random ids), so none reads another's cached pages; the
last three configurations alternate `--rounds` times on one LLM and the best round of each is kept.
Then, on the same LLM, a profile of 21 steps of a groups run, flat and with cascade, where each step
mixes a prefill chunk with hundreds of decodes: the host's time per step and the kernels' by class.
Then the same shape as an OpenAI batch file through `flashserve run-batch` (its app in a process of
its own, the engine that LLM's; groups, no cascade), to compare with `LLM.generate`: the whole call
(the app process's start included) and the run itself (first line in to last result out, as its
summary gives it). Reports requests/s, output and
total tokens/s and the share of prompt tokens computed.

Cascade decode: D groups x R requests behind a `--decode-prefix`-token prefix with a 64-token
question each, 512 out, stepped through the engine: the median time of steps where every request
decodes, with cascade on and off (the same prompts, prefix pages cached by the first round).

Cascade sweep: the same on/off comparison, 48 steps each, over prefixes of 256-4096 tokens and 2-64
requests per group, which is what `--cascade-attention auto` is decided on.
Prints tables and writes `batchllm.json` and `batchllm.png` under `benchmark/results/local/<GPU>/batchllm/`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from benchmark import LOCAL_RESULTS

def group_prompts(rng: random.Random, vocab: int, groups: int, per_group: int, shared: int,
                  unique: int) -> list[list[int]]:
    """Random ids in [1, vocab): `groups` prefixes, each behind `per_group` prompts, shuffled."""
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(1, vocab) for _ in range(shared)]
        prompts += [prefix + [rng.randrange(1, vocab) for _ in range(unique)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def offline(llm: Any, prompts: list[list[int]], out: int, grouping: bool) -> dict[str, Any]:
    from flashserve.message.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, prefix_grouping=grouping)
    wall = time.perf_counter() - t0
    assert all(r.error is None and len(r.token_ids) == out for r in results)
    stats = llm.last_stats
    prompt_tokens = sum(map(len, prompts))
    return {"requests": len(prompts), "wall_s": wall, "requests_per_s": len(prompts) / wall,
            "output_tokens_per_s": len(prompts) * out / wall, "total_tokens_per_s": (prompt_tokens + len(prompts) * out) / wall,
            "prompt_tokens": prompt_tokens, "computed_prompt_tokens": stats.num_computed_prompt_tokens,
            "computed_share": stats.num_computed_prompt_tokens / prompt_tokens, "groups": stats.num_groups}


def run_batch(llm: Any, prompts: list[list[int]], out: int, model: str, workdir: Path) -> dict[str, Any]:
    """The same requests as an OpenAI batch file through `flashserve run-batch` (the app in a process
    of its own, the engine `llm`'s): /v1/completions lines with the prompts' token ids. `wall_s` is
    the whole call, the app process's start included; `run_s` the run, as its summary gives it."""
    import contextlib
    import io
    import re

    from flashserve.cli import build_parser
    from flashserve.serve_args import to_batch_args
    from flashserve.entrypoints.run_batch.main import main as run_batch_main

    src, dst = workdir / "batch_in.jsonl", workdir / "batch_out.jsonl"
    with src.open("w") as f:
        for i, p in enumerate(prompts):
            body = {"model": model, "prompt": p, "max_tokens": out, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    ns = build_parser({}).parse_args(["run-batch", "-i", str(src), "-o", str(dst), "--model", model,
                                      "--load-format", "dummy", "--no-progress", "--overwrite"])
    printed = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        code = run_batch_main(to_batch_args(ns), stack=llm.stack)
    wall = time.perf_counter() - t0
    print(printed.getvalue(), end="")
    found = re.search(r" in ([0-9.]+) s \(", printed.getvalue())
    run_s = float(found.group(1)) if found else float("nan")
    lines = [json.loads(line) for line in dst.read_text().splitlines()]
    assert code == 0 and len(lines) == len(prompts), (code, len(lines))
    usage = [line["response"]["body"]["usage"] for line in lines]
    assert all(u["completion_tokens"] == out for u in usage)
    prompt_tokens = sum(u["prompt_tokens"] for u in usage)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage)
    return {"requests": len(prompts), "wall_s": wall, "requests_per_s": len(prompts) / wall,
            "run_s": run_s, "run_requests_per_s": len(prompts) / run_s if run_s > 0 else float("nan"),
            "output_tokens_per_s": len(prompts) * out / wall, "total_tokens_per_s": (prompt_tokens + len(prompts) * out) / wall,
            "prompt_tokens": prompt_tokens, "computed_prompt_tokens": prompt_tokens - cached,
            "computed_share": (prompt_tokens - cached) / prompt_tokens}


KERNEL_CLASSES = (("attention", ("prefill", "batchdecode")), ("merge", ("merge",)),
                  ("matmul", ("gemm", "nvjet", "cutlass", "sm90")), ("norm", ("norm",)), ("rope", ("rope",)),
                  ("kv append", ("append",)))


def kernel_class(name: str) -> str:
    lower = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in lower for k in keys)), "other")


def step_profile(llm: Any, prompts: list[list[int]], out: int, first: int, last: int) -> dict[str, Any]:
    """An offline run (groups) whose steps `first`..`last` run under the torch profiler: the wall
    time between their returns, and the device time of their kernels by class. The window sits
    where prefill chunks and hundreds of decodes share every step."""
    import torch

    engine, step = llm.engine, llm.engine.step
    walls: list[float] = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def profiled() -> Any:
        n = len(walls)
        if n == first:
            torch.cuda.synchronize()
            prof.__enter__()
        t0 = time.perf_counter()
        outputs = step()
        walls.append(time.perf_counter() - t0)
        if n == last:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
        return outputs

    engine.step = profiled
    try:
        offline(llm, prompts, out, grouping=True)
    finally:
        del engine.step
    steps = last - first + 1
    device: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            cls = kernel_class(event.key)
            device[cls] = device.get(cls, 0.0) + event.self_device_time_total / 1e3 / steps
    return {"steps": f"{first}-{last}", "wall_ms_per_step": 1e3 * sum(walls[first : last + 1]) / steps,
            "device_ms_per_step": sum(device.values()), "device_ms_by_class": device}


def decode_steps(llm: Any, prompts: list[list[int]], out: int) -> dict[str, Any]:
    """Steps the engine by hand; the median wall time of steps in which every request decodes.

    Not synchronised with the device: a step returns while the next one runs there (the engine's
    overlap of the host's output work with the device), so the time between returns is the
    engine's rhythm, as `LLM.generate` sees it."""
    from flashserve.message.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True,
                            eos_token_ids=tuple(llm.stack.loaded.eos_token_ids))
    for i, p in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params)
    times, t_prev, steps = [], time.perf_counter(), 0
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        if len(outputs) == len(prompts) and all(o.num_output_tokens > 1 for o in outputs):
            times.append(now - t_prev)
        t_prev = now
    return {"steps": steps, "decode_steps": len(times), "median_step_ms": 1e3 * statistics.median(times),
            "p90_step_ms": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))]}


def cascade_decode(llm: Any, rng: random.Random, vocab: int, groups: int, per_group: int, prefix: int,
                   out: int, auto: bool = False) -> dict[str, Any]:
    """`groups` x `per_group` requests behind a `prefix`-token prefix with 64 own tokens each:
    decode steps with cascade off (flat) and on (and `auto`, `--cascade-attention auto`'s
    policy), all from CUDA graphs, the same prompts."""
    from flashserve.attention.cascade import CascadePolicy, cascade_policy
    from flashserve.message.sampling_params import SamplingParams

    prompts = []
    for _ in range(groups):
        shared = [rng.randrange(1, vocab) for _ in range(prefix)]
        prompts += [shared + [rng.randrange(1, vocab) for _ in range(64)] for _ in range(per_group)]
    # Each group's prefix computed once and cached before the timed rounds.
    llm.engine.executor.cascade = None
    llm.generate([p[:prefix] for p in prompts[::per_group]], SamplingParams(max_tokens=1))
    result = {}
    policies = [("cascade off", None), ("cascade on", CascadePolicy())] + [("cascade auto", cascade_policy("auto"))] * auto
    for name, policy in policies:
        llm.engine.executor.cascade = policy
        result[name] = decode_steps(llm, prompts, out)
    return result


def sweep(llm: Any, rng: random.Random, vocab: int, groups: int, prefixes: list[int],
          group_sizes: list[int]) -> list[dict[str, Any]]:
    """Cascade on vs off over prefix lengths and requests per group (`groups` groups each): where
    the prefix level pays for its extra pass and its merge (`--cascade-attention auto`)."""
    print(f"cascade sweep: {groups} groups, 64 own tokens, 48 out; median all-decode step, ms")
    print(f"{'prefix':>7} {'per group':>9} {'batch':>6} {'off':>8} {'on':>8} {'on/off':>7}", flush=True)
    rows = []
    for prefix in prefixes:
        for per_group in group_sizes:
            r = cascade_decode(llm, rng, vocab, groups, per_group, prefix, 48)
            off, on = r["cascade off"]["median_step_ms"], r["cascade on"]["median_step_ms"]
            rows.append({"prefix": prefix, "per_group": per_group, "batch": groups * per_group,
                         "off_ms": off, "on_ms": on, "ratio": on / off})
            print(f"{prefix:7d} {per_group:9d} {groups * per_group:6d} {off:8.2f} {on:8.2f} {on / off:7.2f}", flush=True)
    return rows


class Printed(dict):
    """Offline results by configuration, each printed as a table row when it comes in."""

    def __init__(self, title: str) -> None:
        super().__init__()
        print(title)
        print(f"{'configuration':>32} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'computed':>9}", flush=True)

    def __setitem__(self, name: str, r: dict[str, Any]) -> None:
        super().__setitem__(name, r)
        print(f"{name:>32} {r['requests_per_s']:8.2f} {r['output_tokens_per_s']:10.0f} "
              f"{r['total_tokens_per_s']:12.0f} {r['computed_share']:9.1%}", flush=True)


def free_device() -> None:
    """Hands a deleted LLM's KV cache back to the device before the next one is built."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--shared", type=int, default=2000)
    p.add_argument("--unique", type=int, default=200)
    p.add_argument("--out-tokens", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the configurations sharing an LLM")
    p.add_argument("--decode-groups", type=int, default=4)
    p.add_argument("--decode-requests", type=int, default=256, help="requests per decode group")
    p.add_argument("--decode-prefix", type=int, default=4096)
    p.add_argument("--decode-out", type=int, default=512)
    p.add_argument("--sweep-groups", type=int, default=4, help="groups in each cascade sweep configuration")
    p.add_argument("--sweep-prefixes", type=ints, default=[256, 512, 1024, 4096],
                   help="comma-separated prefix lengths")
    p.add_argument("--sweep-group-sizes", type=ints, default=[2, 4, 8, 16, 64],
                   help="comma-separated requests per group")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="per LLM (two are alive at times)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages per LLM instead of a share of memory: fewer than the prefixes need makes the "
                        "cache evict, the case prefix-sharing groups are for")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: offline, profile, run-batch, decode, sweep")
    p.add_argument("--max-num-seqs", type=int, default=1024, help="the LLMs' (decode graphs are captured up to it)")
    p.add_argument("--out", default=str(LOCAL_RESULTS), help="results folder (default: %(default)s)")
    args = p.parse_args(argv)

    import torch

    from flashserve.attention.cascade import CascadePolicy
    from flashserve.entrypoints.llm import LLM

    from benchmark.suite import model_config

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    vocab = model_config(args.model)["vocab_size"]
    rng = random.Random(0)
    doc: dict[str, Any] = {"gpu": gpu, "model": args.model, "args": vars(args)}
    skip = set(args.skip.split(","))
    out_dir = Path(args.out) / gpu.replace(" ", "_") / "batchllm"
    common = {"load_format": "dummy", "max_num_seqs": args.max_num_seqs, "gpu_memory_utilization": args.gpu_memory_utilization,
              "num_pages": args.num_pages}
    if "offline" not in skip:
        shape = (vocab, args.groups, args.per_group, args.shared, args.unique)
        runs = Printed(f"{gpu}, {args.model} (dummy weights): {args.groups} groups x {args.per_group}, "
                       f"{args.shared} shared + {args.unique} own tokens, {args.out_tokens} out")
        plain = LLM(args.model, enable_prefix_caching=False, cascade_attention="off", **common)
        runs["no caching"] = offline(plain, group_prompts(rng, *shape), args.out_tokens, grouping=False)
        plain.close()
        del plain
        free_device()
        llm = LLM(args.model, cascade_attention="on", **common)
        # Built with cascade on, so that cascade decode graphs are captured; each configuration sets
        # the policy. The same LLM for the rest, which alternate `--rounds` times; the best round
        # of each is kept.
        # (cascade policy, grouping, overlap scheduling)
        configs = {"prefix caching, arrival order": (None, False, True), "prefix-sharing groups": (None, True, True),
                   "groups + cascade": (CascadePolicy(), True, True),
                   "groups, steps in turn (no overlap scheduling)": (None, True, False)}
        best: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):
            for name, (policy, grouping, overlap) in configs.items():
                llm.engine.executor.cascade = policy
                llm.engine.overlap = overlap
                r = offline(llm, group_prompts(rng, *shape), args.out_tokens, grouping)
                if name not in best or r["requests_per_s"] > best[name]["requests_per_s"]:
                    best[name] = r
        llm.engine.overlap = True
        for name, r in best.items():
            runs[name] = r
        if "profile" not in skip and torch.cuda.is_available():
            doc["profile"] = {}
            for name, policy in (("groups", None), ("groups + cascade", CascadePolicy())):
                llm.engine.executor.cascade = policy
                doc["profile"][name] = prof = step_profile(llm, group_prompts(rng, *shape), args.out_tokens, 150, 170)
                print(f"{name:>20}: steps {prof['steps']}: {prof['wall_ms_per_step']:.2f} ms a step on the host's clock, "
                      f"{prof['device_ms_per_step']:.2f} ms of kernels ("
                      + ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof["device_ms_by_class"].items(), key=lambda kv: -kv[1]))
                      + ")", flush=True)
        if "run-batch" not in skip:  # last: it shuts the engine down
            llm.engine.executor.cascade = None
            with tempfile.TemporaryDirectory() as tmp:
                runs["run-batch (groups)"] = run_batch(llm, group_prompts(rng, *shape), args.out_tokens, args.model,
                                                       Path(tmp))
            rb, groups = runs["run-batch (groups)"], runs["prefix-sharing groups"]
            print(f"run-batch vs LLM.generate (groups): {rb['requests_per_s'] / groups['requests_per_s']:.3f}x "
                  f"(the whole call), {rb['run_requests_per_s'] / groups['requests_per_s']:.3f}x (the run)")
        doc["offline"] = dict(runs)
        llm.close()
        del llm
        free_device()
    if "decode" not in skip or "sweep" not in skip:
        llm = LLM(args.model, cascade_attention="on", **common)
        if "decode" not in skip:
            print(f"cascade decode: {args.decode_groups} groups x {args.decode_requests}, {args.decode_prefix}-token "
                  f"prefix, 64 own, {args.decode_out} out")
            doc["decode"] = cascade_decode(llm, rng, vocab, args.decode_groups, args.decode_requests,
                                           args.decode_prefix, args.decode_out, auto=True)
            for name, r in doc["decode"].items():
                print(f"{name:>12}: median step {r['median_step_ms']:.2f} ms, p90 {r['p90_step_ms']:.2f} ms "
                      f"over {r['decode_steps']} all-decode steps", flush=True)
        if "sweep" not in skip:
            doc["sweep"] = sweep(llm, rng, vocab, args.sweep_groups, args.sweep_prefixes, args.sweep_group_sizes)
        llm.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "batchllm.json").write_text(json.dumps(doc, indent=2))
    plot(doc, out_dir / "batchllm.png")
    return 0


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [k for k in ("offline", "decode") if k in doc]
    if not parts:  # a sweep alone: its table and JSON say it all
        return
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 3.8), squeeze=False)
    for ax, part in zip(axes[0], parts):
        names = list(doc[part])
        key, label = ("requests_per_s", "requests/s") if part == "offline" else ("median_step_ms", "median decode step (ms)")
        ax.bar(range(len(names)), [doc[part][n][key] for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(label)
    fig.suptitle(f"{doc['gpu']}, {doc['model']} (dummy weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
