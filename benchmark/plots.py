"""PNG plots from result JSONs of `benchmark.serve_bench`, one line per system (label).

    python -m benchmark.plots benchmark/results/nvidia-h100-80gb-hbm3 --out-dir /tmp/plots

`concurrency.png`: median TTFT, median per-token latency (TPOT) and output throughput against the
number of concurrent streams. `request_rate.png`: output throughput and P99 TTFT against the
request rate (random-workload phases and goodput probes), with the goodput SLO when there is one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullLocator, ScalarFormatter  # noqa: E402

from benchmark import LOCAL_RESULTS

Series = dict[str, list[tuple[float, dict[str, Any]]]]  # system -> [(x, metrics)], sorted by x


def load_results(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Result documents from files and folders (searched recursively); summary.json is skipped."""
    docs = []
    for path in map(Path, paths):
        files = sorted(path.rglob("*.json")) if path.is_dir() else [path]
        for f in files:
            if f.name == "summary.json":
                continue
            doc = json.loads(f.read_text())
            if isinstance(doc, dict) and "workload" in doc and "label" in doc:
                docs.append(doc)
    return docs


def _latest(docs: Sequence[dict[str, Any]], workloads: set[str]) -> list[dict[str, Any]]:
    """The latest document per (label, gpu, workload)."""
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for d in docs:
        key = (d["label"], d.get("gpu", "?"), d["workload"])
        if d["workload"] in workloads and (key not in best or d["timestamp"] >= best[key]["timestamp"]):
            best[key] = d
    return list(best.values())


def _name(doc: dict[str, Any], gpus: set[str]) -> str:
    return doc["label"] if len(gpus) <= 1 else f"{doc['label']} ({doc.get('gpu', '?')})"


def concurrency_series(docs: Sequence[dict[str, Any]]) -> Series:
    """Per system: (streams, metrics) of every concurrency-workload phase."""
    chosen = _latest(docs, {"concurrency"})
    gpus = {d.get("gpu", "?") for d in chosen}
    out: Series = {}
    for d in chosen:
        pts = [(float(p["concurrency"]), p["metrics"]) for p in d["phases"] if p.get("concurrency")]
        out.setdefault(_name(d, gpus), []).extend(pts)
    return {k: sorted(v, key=lambda t: t[0]) for k, v in out.items()}


def rate_series(docs: Sequence[dict[str, Any]]) -> tuple[Series, float | None]:
    """Per system: (req/s, metrics) from random phases and goodput probes; and the TTFT SLO (ms)."""
    chosen = _latest(docs, {"random", "goodput"})
    gpus = {d.get("gpu", "?") for d in chosen}
    out: Series = {}
    slo = None
    for d in chosen:
        pts = [(float(p["request_rate"]), p["metrics"]) for p in d["phases"] if p.get("request_rate")]
        if d.get("goodput"):
            slo = d["goodput"]["slo_ms"]
            pts += [(float(p["rate"]), p["metrics"]) for p in d["goodput"]["probes"]]
        out.setdefault(_name(d, gpus), []).extend(pts)
    return {k: sorted(v, key=lambda t: t[0]) for k, v in out.items()}, slo


def _panels(series: Series, xlabel: str, panels: Sequence[tuple[str, Any]], title: str, out: Path,
            log_x: bool = False, hline: tuple[int, float] | None = None) -> Path:
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (ylabel, get) in zip(axes[0], panels):
        for name, pts in sorted(series.items()):
            xs = [x for x, m in pts if get(m) is not None]
            ax.plot(xs, [get(m) for x, m in pts if get(m) is not None], marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if log_x:
            ax.set_xscale("log")
            ax.set_xticks(sorted({x for pts in series.values() for x, _ in pts}))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_locator(NullLocator())
    if hline is not None:
        axes[0][hline[0]].axhline(hline[1], color="red", linestyle="--", label=f"SLO {hline[1]:g} ms")
    for ax in axes[0]:
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_concurrency(docs: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """TTFT and per-token latency (ms) and output tok/s vs concurrent streams; None without data."""
    series = concurrency_series(docs)
    if not series:
        return None
    panels = [("median TTFT (ms)", lambda m: m["ttft_ms"]["median"]),
              ("median per-token latency (ms)", lambda m: m["tpot_ms"]["median"]),
              ("output throughput (tok/s)", lambda m: m["output_token_throughput"])]
    return _panels(series, "concurrent streams", panels, "Concurrency workload", out, log_x=True)


def plot_request_rate(docs: Sequence[dict[str, Any]], out: Path) -> Path | None:
    """Output tok/s and P99 TTFT (ms) vs request rate (req/s); None without data."""
    series, slo = rate_series(docs)
    if not series:
        return None
    panels = [("output throughput (tok/s)", lambda m: m["output_token_throughput"]),
              ("P99 TTFT (ms)", lambda m: m["ttft_ms"]["p99"])]
    return _panels(series, "request rate (req/s)", panels, "Random workload", out,
                   hline=(1, slo) if slo is not None else None)


def main(argv: Sequence[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(prog="python -m benchmark.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="result JSON files or folders")
    p.add_argument("--out-dir", type=Path, default=LOCAL_RESULTS / "plots")
    args = p.parse_args(argv)
    docs = load_results(args.paths)
    written = [plot_concurrency(docs, args.out_dir / "concurrency.png"),
               plot_request_rate(docs, args.out_dir / "request_rate.png")]
    for path in written:
        if path is not None:
            print(f"wrote {path}")
    return [p for p in written if p is not None]


if __name__ == "__main__":
    main()
