"""The PERFORMANCE.md targets, judged from a summary.json; and bar charts of the headline figures.

Workloads in a suite run are named `<workload>@<model shape>` (benchmark.suite), so one summary
holds both model shapes. `evaluate_targets` reads one GPU's block of each workload; a figure that
is missing (its phase was cut, failed or not run) is reported as such and counts as not met.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

Block = dict[str, Any]  # summary["workloads"][workload][gpu]


@dataclass(frozen=True)
class Target:
    number: str
    what: str
    workload: str
    figure: Callable[[Block], float | None]
    op: str  # "<=", ">=" or ">"
    goal: float
    unit: str = "x"


def _get(block: Block, *keys: str) -> Any:
    for k in keys:
        if not isinstance(block, dict) or k not in block:
            return None
        block = block[k]
    return block


def _inverse(x: float | None) -> float | None:
    return 1.0 / x if x else None


def _levels(block: Block, suffix: str) -> list[tuple[int, float]]:
    """(streams, figure) of the concurrency levels in flashserve's headline, fewest streams first."""
    head = _get(block, "systems", "flashserve", "headline") or {}
    out = [(int(k[1 : -len(suffix)]), v) for k, v in head.items() if k.startswith("c") and k.endswith(suffix)
           and k[1 : -len(suffix)].isdigit()]
    return sorted(out)


def _tpot_growth(block: Block) -> float | None:
    lv = _levels(block, "_tpot_median_ms")
    return lv[-1][1] / lv[0][1] if len(lv) >= 2 and lv[0][1] else None


def _throughput_rise(block: Block) -> float | None:
    lv = _levels(block, "_output_tok_per_s")
    return lv[-1][1] / lv[-2][1] if len(lv) >= 2 and lv[-2][1] else None


def targets(large: str, small: str, offline: str, slo_ms: float = 200.0) -> list[Target]:
    """The measurable targets, for the model shapes a run used (8B-class `large`, 1B-class `small`)."""
    return [
        Target("1", f"batch-1 decode step (TPOT p50) / weight-read floor, {large}", f"latency@{large}",
               lambda b: _get(b, "ratio_to_floor", "bs1_tpot_median_ms"), "<=", 1.1),
        Target("2", f"offline out tok/s vs hf-continuous-batching, {offline}", f"offline@{offline}",
               lambda b: _get(b, "speedup_vs_hf-continuous-batching", "fixed512x128_output_tok_per_s"), ">=", 10.0),
        Target("2", f"offline floor time / measured time (both phases), {offline}", f"offline@{offline}",
               lambda b: _inverse(_get(b, "ratio_to_floor", "workload_duration_s")), ">=", 0.6),
        Target("3", f"goodput (P99 TTFT <= {slo_ms:g} ms), {large}", f"goodput@{large}",
               lambda b: _get(b, "systems", "flashserve", "headline", "goodput_req_per_s"), ">=", 8.0, " req/s"),
        Target("3", f"median ITL at goodput / batch-1 floor, {large}", f"goodput@{large}",
               lambda b: _get(b, "ratio_to_floor", "itl_median_ms"), "<=", 1.5),
        Target("4", f"TPOT p50 at most streams / at fewest, {small}", f"concurrency@{small}",
               _tpot_growth, "<=", 2.0),
        Target("4", f"out tok/s at most streams / next level (still rising), {small}", f"concurrency@{small}",
               _throughput_rise, ">", 1.0),
    ]


def _met(value: float | None, op: str, goal: float) -> bool | None:
    if value is None:
        return None
    return {"<=": value <= goal, ">=": value >= goal, ">": value > goal}[op]


def evaluate_targets(summary: dict[str, Any], gpu: str, large: str, small: str, offline: str,
                     slo_ms: float = 200.0) -> list[dict[str, Any]]:
    """One row per target: its figure on `gpu`, the goal, and whether it is met (None: no figure)."""
    rows = []
    for t in targets(large, small, offline, slo_ms):
        block = _get(summary, "workloads", t.workload, gpu) or {}
        value = t.figure(block)
        value = None if value is None else float(value)
        rows.append({"target": t.number, "what": t.what, "workload": t.workload, "figure": value,
                     "goal": f"{t.op} {t.goal:g}{t.unit}", "met": _met(value, t.op, t.goal)})
    rows.append({"target": "5", "what": "KV pages sized from free memory, <= 1 partial page per request",
                 "workload": None, "figure": None, "goal": "engine property", "met": None,
                 "note": "not measured by the suite (see the engine's KV cache manager tests)"})
    return rows


def format_targets(rows: Sequence[dict[str, Any]], gpu: str) -> str:
    lines = [f"PERFORMANCE.md targets on {gpu}", f"{'#':<3}{'what':<72}{'figure':>10}  {'goal':<17}met"]
    for r in rows:
        fig = "-" if r["figure"] is None else f"{r['figure']:.3g}"
        met = {True: "yes", False: "NO", None: "missing" if r["workload"] else "n/a"}[r["met"]]
        lines.append(f"{r['target']:<3}{r['what'][:71]:<72}{fig:>10}  {r['goal']:<17}{met}")
    return "\n".join(lines)


# Headline figures drawn as grouped bars, per workload kind: (kind, keys, y label).
BAR_FIGURES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("latency", ("bs1_tpot_median_ms", "bs8_tpot_median_ms"), "TPOT p50 (ms)"),
    ("offline", ("fixed512x128_output_tok_per_s", "uniform100to1024_output_tok_per_s"), "output tok/s"),
)


def plot_headlines(summary: dict[str, Any], gpu: str, out: Path) -> Path | None:
    """One panel per latency@/offline@ workload: each system's (floor included) headline figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for wl, per_gpu in sorted(summary.get("workloads", {}).items()):
        for kind, keys, ylabel in BAR_FIGURES:
            if wl.split("@")[0] == kind and gpu in per_gpu:
                panels.append((wl, keys, ylabel, per_gpu[gpu]["systems"]))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (wl, keys, ylabel, systems) in zip(axes[0], panels):
        labels = sorted(systems)
        width = 0.8 / max(len(labels), 1)
        for i, label in enumerate(labels):
            head = systems[label]["headline"]
            ax.bar([j + i * width for j in range(len(keys))], [head.get(k) or 0 for k in keys], width, label=label)
        ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(keys))], [k.split("_")[0] for k in keys])
        ax.set(title=wl, ylabel=ylabel, yscale="log")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(gpu)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
