"""Paired A/B runs of SGLang's `bench_serving.py`: each pair's figures side by side, and the mean and
range of the differences over the pairs.

    python -m benchmark.ab_pairs DIR --a late --b nolate

Pairs are the files `sgl_<name>-<a>.jsonl` and `sgl_<name>-<b>.jsonl` under DIR (what
`benchmark/seed_protocol.sh` writes for NAME=<name>-<a> and <name>-<b>; `benchmark/late_launch_ab.sh`
makes them), one line a rate; lines pair in order. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

METRICS = [("median_ttft_ms", "median TTFT"), ("mean_ttft_ms", "mean TTFT"), ("p99_ttft_ms", "P99 TTFT"),
           ("median_itl_ms", "median ITL"), ("mean_itl_ms", "mean ITL"), ("p99_itl_ms", "P99 ITL")]


def pairs(folder: Path, a: str, b: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, a's record, b's record) for every rate of every pair under `folder`, by name."""
    found = []
    for path_a in sorted(folder.glob(f"sgl_*-{a}.jsonl")):
        name = path_a.name[len("sgl_") : -len(f"-{a}.jsonl")]
        path_b = folder / f"sgl_{name}-{b}.jsonl"
        if not path_b.exists():
            continue
        lines_a, lines_b = (p.read_text().splitlines() for p in (path_a, path_b))
        for line_a, line_b in zip(lines_a, lines_b):
            found.append((name, json.loads(line_a), json.loads(line_b)))
    return found


def table(found: list[tuple[str, dict[str, Any], dict[str, Any]]], a: str, b: str) -> str:
    head = "| pair | req/s | " + " | ".join(f"{label} ms: {a} / {b}" for _, label in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 2)]
    for name, ra, rb in found:
        cells = " | ".join(f"{ra[key]:.2f} / {rb[key]:.2f}" for key, _ in METRICS)
        lines.append(f"| {name} | {ra['request_rate']:g} | {cells} |")
    if found:
        diffs = {key: [ra[key] - rb[key] for _, ra, rb in found] for key, _ in METRICS}
        cells = " | ".join(f"{statistics.mean(d):+.2f} ({min(d):+.2f} to {max(d):+.2f})" for d in diffs.values())
        lines.append(f"| {a} - {b}: mean (range) over {len(found)} | | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--a", default="late")
    p.add_argument("--b", default="nolate")
    args = p.parse_args(argv)
    found = pairs(args.folder, args.a, args.b)
    print(table(found, args.a, args.b))
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
