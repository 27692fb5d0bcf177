"""Speculative decoding on the CPU with the embedded model (SmolLM2-135M): batch 1, greedy, the
input-grounded workload of `benchmark.spec_workload`, speculation off against n-gram prompt lookup
(k = 2 and 4) and draft models, in the same run.

    python -m benchmark.spec_bench [--per-kind 2] [--ks 2 4] [--lookup 2 4] [--draft-layers 6]
        [--repeat 1] [--threads 1] [--out benchmark/results/cpu/spec_decode]

Every configuration is an `LLM` of its own (`speculative_config` in `--speculative-config`'s JSON
shape), all loaded at once; the requests run one at a time, each prompt through every
configuration in turn (the order rotated from one prompt to the next), so that a busy moment of the
machine falls on all of them alike. Draft models: the embedded model as its own draft (every draft
token should be accepted: the mechanics, not a speed-up) and a copy of it cut to its first
`--draft-layers` layers (some accepted). A method the engine does not serve yet is reported as
skipped with the engine's reason.

Per configuration: output tokens per second (wall clock, prompt included, and per CPU second of
this process, which other processes on the machine disturb less), the speed-up over speculation
off (of the totals, and the geometric mean of each request's own), the mean accepted length (the
tokens a verified draft row produced, vLLM's "mean acceptance length"), the acceptance at each draft
position, and whether each output is token for token the one speculation off gave. The acceptance
is the engine's own count (`Scheduler.spec_stats`). Prints a table, writes `spec_bench.json` and
`spec_bench.png` under `--out` (default benchmark/results/local/cpu/spec_decode/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmark import LOCAL_RESULTS
from benchmark.spec_workload import KINDS, SpecPrompt, build_workload

OUT_DIR = LOCAL_RESULTS / "cpu" / "spec_decode"
OFF = "off"


@dataclass
class Config:
    """One engine of the run: a label and its `speculative_config` (None: speculation off)."""

    label: str
    speculative: dict[str, Any] | None
    llm: Any = None
    skipped: str | None = None  # why this configuration did not run


@dataclass
class Run:
    """One request through one configuration."""

    tokens: list[int]
    text: str
    wall_s: float
    cpu_s: float
    first_token_s: float  # the prompt's prefill and the first token
    decode_s: float  # wall clock after the first token
    decode_cpu_s: float
    steps: int  # engine steps that gave the request tokens after its first
    drafts: int = 0  # verified rows with draft tokens
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def configs(ks: list[int], lookup: tuple[int, int], draft_layers: int, draft_dir: str | None) -> list[Config]:
    out = [Config(OFF, None)]
    for k in ks:
        out.append(Config(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                           "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1]}))
    if draft_dir is not None:
        from flashserve.model_loader.loader import embedded_gguf_path

        k = max(ks)
        out.append(Config(f"draft self k={k}", {"model": embedded_gguf_path(), "num_speculative_tokens": k}))
        out.append(Config(f"draft {draft_layers} layers k={k}", {"model": draft_dir, "num_speculative_tokens": k}))
    return out


def cut_model(layers: int, directory: str) -> str:
    """The embedded model's first `layers` layers with its embedding, final norm, LM head and
    tokenizer, saved as a transformers checkpoint in `directory` (a draft sharing its vocabulary)."""
    from flashserve.config import ModelConfig
    from flashserve.model_loader.loader import load_model

    loaded = load_model(ModelConfig(device="cpu"), "cpu")
    model = loaded.model
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)
    return directory


def spec_counts(llm: Any) -> tuple[int, int, int, list[int]]:
    """The engine's acceptance counts since it started: drafts, draft tokens, accepted, accepted per position."""
    stats = llm.engine.scheduler.spec_stats
    if stats is None:
        return 0, 0, 0, []
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_pos)


def run_one(llm: Any, prompt_ids: list[int], max_tokens: int) -> Run:
    """One request alone through the engine's loop, timed to its first token and to its last."""
    from flashserve.message.sampling_params import SamplingParams

    engine = llm.engine
    before = spec_counts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, eos_token_ids=tuple(llm.stack.loaded.eos_token_ids))
    tokens: list[int] = []
    text: list[str] = []
    t0, c0 = time.perf_counter(), time.process_time()
    first = first_cpu = None
    steps = 0
    engine.add_request(uuid.uuid4().hex, prompt_ids, params)
    while engine.has_unfinished:
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request failed: {out.error}")
            if out.new_token_ids and first is None:
                first, first_cpu = time.perf_counter(), time.process_time()
            elif out.new_token_ids:
                steps += 1
            tokens += out.new_token_ids
            text.append(out.new_text)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert first is not None and first_cpu is not None
    after = spec_counts(llm)
    per_pos = [a - (before[3][i] if i < len(before[3]) else 0) for i, a in enumerate(after[3])]
    return Run(tokens, "".join(text), wall, cpu, first - t0, wall - (first - t0), cpu - (first_cpu - c0), steps,
               after[0] - before[0], after[1] - before[1], after[2] - before[2], per_pos)


def _decode_rate(runs: list[Run], cpu: bool = False) -> float:
    """Tokens after the first over the time after the first (wall clock, or this process's CPU time)."""
    seconds = sum(r.decode_cpu_s if cpu else r.decode_s for r in runs)
    return sum(max(len(r.tokens) - 1, 0) for r in runs) / seconds if seconds > 0 else float("nan")


def summarize(label: str, runs: list[Run], base: list[Run]) -> dict[str, Any]:
    """Totals of one configuration's runs, against speculation off's runs of the same prompts."""
    tokens = sum(len(r.tokens) for r in runs)
    wall = sum(r.wall_s for r in runs)
    base_e2e = sum(len(r.tokens) for r in base) / sum(r.wall_s for r in base)
    # Each request's decode speed-up over the same prompt with speculation off, run next to it.
    ratios = [_decode_rate([r]) / _decode_rate([b]) for r, b in zip(runs, base) if r.decode_s > 0 and b.decode_s > 0]
    drafts = sum(r.drafts for r in runs)
    draft_tokens = sum(r.draft_tokens for r in runs)
    accepted = sum(r.accepted for r in runs)
    width = max((len(r.accepted_per_pos) for r in runs), default=0)
    per_pos = [sum(r.accepted_per_pos[i] for r in runs if i < len(r.accepted_per_pos)) for i in range(width)]
    steps = sum(r.steps for r in runs)
    return {
        "config": label,
        "requests": len(runs),
        "output_tokens": tokens,
        "wall_s": wall,
        "first_token_s": sum(r.first_token_s for r in runs),
        "decode_tokens_per_s": _decode_rate(runs),
        "speedup": _decode_rate(runs) / _decode_rate(base),
        "speedup_cpu": _decode_rate(runs, cpu=True) / _decode_rate(base, cpu=True),
        "speedup_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
        "tokens_per_s": tokens / wall,  # end to end: the prompt's prefill included
        "speedup_end_to_end": tokens / wall / base_e2e,
        "identical": sum(r.tokens == b.tokens for r, b in zip(runs, base)),
        "decode_steps": steps,
        "tokens_per_step": sum(max(len(r.tokens) - 1, 0) for r in runs) / steps if steps else None,
        "drafted_steps": drafts / steps if steps else None,  # the share of steps that verified drafts
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "acceptance_per_position": [a / drafts for a in per_pos] if drafts else [],
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def load(config: Config, cache_gb: float) -> None:
    from flashserve.entrypoints.llm import LLM

    kwargs: dict[str, Any] = {"device": "cpu", "cpu_kv_cache_gb": cache_gb}
    if config.speculative is not None:
        kwargs["speculative_config"] = config.speculative
    try:
        config.llm = LLM("", **kwargs)
    except (ValueError, NotImplementedError) as exc:  # a method or option the engine does not serve yet
        config.skipped = f"{type(exc).__name__}: {exc}"


def chat_ids(tokenizer: Any, prompt: SpecPrompt) -> list[int]:
    text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    workload = build_workload(args.per_kind, args.seed, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="flashserve-draft-") as tmp:
        draft_dir = cut_model(args.draft_layers, tmp) if args.draft_layers else None
        runs_of = configs(args.ks, tuple(args.lookup), args.draft_layers, draft_dir)
        for config in runs_of:
            t0 = time.perf_counter()
            load(config, args.cpu_kv_cache_gb)
            print(f"{config.label}: " + (f"loaded in {time.perf_counter() - t0:.1f} s" if config.llm
                                         else f"skipped ({config.skipped})"), flush=True)
    live = [c for c in runs_of if c.llm is not None]
    tokenizer = live[0].llm.stack.tokenizer
    prompts = [chat_ids(tokenizer, p) for p in workload]
    for config in live:  # first calls allocate and warm caches: not part of any request's time
        config.llm.generate([prompts[0][:32]], _greedy(4))
    runs: dict[str, list[Run]] = {c.label: [] for c in live}
    order: list[tuple[int, int]] = [(rep, i) for rep in range(args.repeat) for i in range(len(workload))]
    doc: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "python": sys.version.split()[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
        "model": "SmolLM2-135M-Instruct (embedded, float32)", "batch": 1, "temperature": 0.0,
        "workload": {"per_kind": args.per_kind, "seed": args.seed, "max_tokens": args.max_tokens, "repeat": args.repeat,
                     "limit_tokens": args.limit_tokens},
        "configs": {c.label: c.speculative for c in runs_of},
        "skipped": {c.label: c.skipped for c in runs_of if c.skipped},
        "load_avg_before": os.getloadavg(),
    }
    for n, (rep, i) in enumerate(order):
        turn = live[n % len(live):] + live[: n % len(live)]
        for config in turn:
            budget = min(workload[i].max_tokens, args.limit_tokens or workload[i].max_tokens)
            runs[config.label].append(run_one(config.llm, prompts[i], budget))
        line = ", ".join(f"{c.label} {_decode_rate(runs[c.label][-1:]):.1f}" for c in live)
        print(f"[{n + 1}/{len(order)}] {workload[i].kind} ({workload[i].source}), decode tokens/s: {line}", flush=True)
    doc["load_avg_after"] = os.getloadavg()
    base = runs[OFF]
    doc["rows"] = [summarize(c.label, runs[c.label], base) for c in live]
    doc["by_kind"] = {
        kind: [summarize(c.label, [r for (_, i), r in zip(order, runs[c.label]) if workload[i].kind == kind],
                         [r for (_, i), r in zip(order, base) if workload[i].kind == kind]) for c in live]
        for kind in KINDS
    }
    doc["requests"] = [
        {"kind": workload[i].kind, "source": workload[i].source, "repeat": rep, "prompt_tokens": len(prompts[i]),
         "max_tokens": workload[i].max_tokens, "output_off": base[n].text,
         "runs": {c.label: {"tokens": len(runs[c.label][n].tokens), "wall_s": runs[c.label][n].wall_s,
                            "first_token_s": runs[c.label][n].first_token_s, "decode_s": runs[c.label][n].decode_s,
                            "identical": runs[c.label][n].tokens == base[n].tokens,
                            "first_difference": first_difference(runs[c.label][n].tokens, base[n].tokens),
                            "mean_accepted_length": (1 + runs[c.label][n].accepted / runs[c.label][n].drafts
                                                     if runs[c.label][n].drafts else None)}
                  for c in live}}
        for n, (rep, i) in enumerate(order)
    ]  # fmt: skip
    return doc


def _greedy(max_tokens: int) -> Any:
    from flashserve.message.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def table(doc: dict[str, Any]) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["| configuration | decode tokens/s | speed-up | speed-up (CPU s) | per-request speed-up (geomean) "
             "| end to end tokens/s (speed-up) | steps with drafts | tokens per step | mean accepted length "
             "| acceptance per position | identical outputs |", "|---" * 11 + "|"]
    for r in doc["rows"]:
        per_pos = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
        lines.append(f"| {r['config']} | {r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['speedup_cpu']:.2f}x "
                     f"| {num(r['speedup_geomean'], '.2f')}x | {r['tokens_per_s']:.1f} ({r['speedup_end_to_end']:.2f}x) "
                     f"| {num(r['drafted_steps'], '.0%')} | {num(r['tokens_per_step'], '.2f')} "
                     f"| {num(r['mean_accepted_length'], '.2f')} | {per_pos} | {r['identical']}/{r['requests']} |")
    lines.append("")
    lines.append("| configuration | " + " | ".join(f"{k}: speed-up, mean accepted length" for k in doc["by_kind"]) + " |")
    lines.append("|---" * (1 + len(doc["by_kind"])) + "|")
    for j, r in enumerate(doc["rows"]):
        cells = [f"{rows[j]['speedup']:.2f}x, {num(rows[j]['mean_accepted_length'], '.2f')}" for rows in doc["by_kind"].values()]
        lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    for label, why in doc.get("skipped", {}).items():
        lines.append(f"skipped {label}: {why}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Speed-up per configuration (all requests and each kind) and acceptance per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    groups = [("all", rows)] + list(doc["by_kind"].items())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(groups)
    for g, (name, group) in enumerate(groups):
        left.bar([i + (g - (len(groups) - 1) / 2) * width for i in range(len(group))], [r["speedup"] for r in group],
                 width, label=name)
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_xticks(range(len(rows)), [r["config"] for r in rows], fontsize=8, rotation=15)
    left.set_ylabel("decode tokens/s over speculation off")
    left.legend(fontsize=8)
    for r in rows:
        if r["acceptance_per_position"]:
            pos = range(1, len(r["acceptance_per_position"]) + 1)
            right.plot(pos, r["acceptance_per_position"], marker="o", label=r["config"])
            right.set_xticks(pos)
    right.set_xlabel("draft position")
    right.set_ylabel("share of drafts accepted")
    right.set_ylim(0, 1.05)
    right.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M on the CPU ({doc['cpus']} cores), batch 1, greedy", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.spec_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--per-kind", type=int, default=2, help="prompts of each kind of the workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256, help="the largest answer a prompt may need")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4], help="draft tokens per step of the n-gram runs")
    p.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"),
                   help="prompt_lookup_min and prompt_lookup_max of the n-gram runs")
    p.add_argument("--draft-layers", type=int, default=6, help="layers of the cut draft model (0: no draft-model runs)")
    p.add_argument("--repeat", type=int, default=1, help="passes over the workload")
    p.add_argument("--limit-tokens", type=int, default=None, help="cut every answer at this many tokens (a smoke run)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's CPU threads (default: torch's choice); on a machine that other work keeps busy, 1 "
                        "is steadier and often faster than threads that wait for each other")
    p.add_argument("--cpu-kv-cache-gb", type=float, default=0.25, help="each engine's KV cache")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--no-plot", dest="plot", action="store_false")
    args = p.parse_args(argv)
    doc = run(args)
    print(table(doc))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "spec_bench.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot(doc, path.with_suffix(".png"))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
