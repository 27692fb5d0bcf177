"""Aggregate per-request results into run metrics, and merge run files into `summary.json`.

Reported times are milliseconds (keys end in `_ms`), throughputs are per second.

summary.json is built from result files, each a JSON object with at least
`{"workload": str, "label": str, "gpu": str, "timestamp": ISO-8601 str, "headline": {name: number}}`
(`benchmark.serve_bench` writes these; an offline runner or a floor calculator may write the same
five keys). Headline names ending in `_per_s` are rates (higher is better); all others are times
(lower is better). The system labelled `floor` holds the physical floor of a figure. Layout:

    {"updated": ..., "main_label": "flashserve",
     "workloads": {<workload>: {<gpu>: {
         "systems": {<label>: {"headline": {...}, "timestamp": ..., "git_commit": ..., "source": path}},
         "ratio_to_floor": {<name>: main / floor},            # times >= 1, rates <= 1 at best
         "speedup_vs_<peer>": {<name>: how many times faster main is than peer}}}}}

Only figures from the same GPU are compared; each system's latest file wins.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from benchmark import LOCAL_RESULTS
from benchmark.client import LoadResult

FLOOR_LABEL = "floor"


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, P90 and P99 in ms of values given in seconds (None when there are none)."""
    if len(values_s) == 0:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    a = np.asarray(values_s, dtype=float) * 1000.0
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(load: LoadResult) -> dict[str, Any]:
    """Counts, throughputs (per s over the run's wall time) and latency distributions (ms).

    Throughputs count completed requests only; failures appear in `failed` and `error_kinds`.
    """
    ok = [r for r in load.results if r.success]
    bad = [r for r in load.results if not r.success]
    dur = load.duration_s
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    rate = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    return {
        "duration_s": dur,
        "completed": len(ok),
        "failed": len(bad),
        "error_kinds": dict(Counter(r.error_kind for r in bad)),
        "errors": [f"{r.error_kind}: {r.error}" for r in bad[:5]],
        "output_len_mismatch": sum(1 for r in ok if r.output_tokens != r.output_len),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": rate(len(ok)),
        "input_token_throughput": rate(n_in),
        "output_token_throughput": rate(n_out),
        "total_token_throughput": rate(n_in + n_out),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "client_busy": load.client_busy,
    }


def headline(workload: str, phases: Sequence[dict[str, Any]], goodput: dict[str, Any] | None = None) -> dict[str, float]:
    """The few figures of a run that summary.json compares (see the module docstring for names)."""
    out: dict[str, float | None] = {}
    for p in phases:
        m, n = p["metrics"], p["name"]
        if workload == "latency":
            out[f"{n}_e2e_mean_ms"] = m["e2e_ms"]["mean"]
            out[f"{n}_ttft_median_ms"] = m["ttft_ms"]["median"]
            out[f"{n}_tpot_median_ms"] = m["tpot_ms"]["median"]
        elif workload == "concurrency":
            out[f"{n}_ttft_median_ms"] = m["ttft_ms"]["median"]
            out[f"{n}_tpot_median_ms"] = m["tpot_ms"]["median"]
            out[f"{n}_output_tok_per_s"] = m["output_token_throughput"]
        elif workload == "random":
            out[f"{n}_output_tok_per_s"] = m["output_token_throughput"]
            out[f"{n}_ttft_p99_ms"] = m["ttft_ms"]["p99"]
            out[f"{n}_itl_median_ms"] = m["itl_ms"]["median"]
        elif workload in ("offline", "max_throughput"):
            out[f"{n}_output_tok_per_s"] = m["output_token_throughput"]
            out[f"{n}_duration_s"] = m["duration_s"]
        elif workload.startswith("shared_prefix"):
            out[f"{n}_total_tok_per_s"] = m["total_token_throughput"]
            out[f"{n}_ttft_median_ms"] = m["ttft_ms"]["median"]
            out[f"{n}_duration_s"] = m["duration_s"]
    if goodput is not None:
        out["goodput_req_per_s"] = goodput["rate"]
        out["ttft_median_ms"] = goodput.get("median_ttft_ms")
        out["itl_median_ms"] = goodput.get("median_itl_ms")
    return {k: float(v) for k, v in out.items() if v is not None}


def higher_is_better(name: str) -> bool:
    return name.endswith("_per_s")


def compare(main: dict[str, float], other: dict[str, float], speedup: bool) -> dict[str, float]:
    """Per common figure: main/other (ratio) or how many times faster main is (speedup)."""
    out = {}
    for k in sorted(main.keys() & other.keys()):
        a, b = main[k], other[k]
        if not a or not b:
            continue
        if speedup:
            out[k] = a / b if higher_is_better(k) else b / a
        else:
            out[k] = a / b
    return out


def iter_result_files(results_dir: Path) -> Iterable[Path]:
    for path in sorted(results_dir.rglob("*.json")):
        if path.name != "summary.json":
            yield path


def build_summary(paths: Iterable[Path], main_label: str = "flashserve") -> dict[str, Any]:
    """summary.json's content from result files (unreadable or foreign JSON files are skipped)."""
    latest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
            key = (doc["workload"], doc["gpu"], doc["label"])
            entry = {"headline": dict(doc["headline"]), "timestamp": str(doc["timestamp"]),
                     "git_commit": doc.get("git_commit"), "source": str(path)}
        except (ValueError, KeyError, TypeError, OSError):
            continue
        if key not in latest or entry["timestamp"] >= latest[key]["timestamp"]:
            latest[key] = entry
    workloads: dict[str, dict[str, Any]] = {}
    for (workload, gpu, label), entry in sorted(latest.items()):
        workloads.setdefault(workload, {}).setdefault(gpu, {"systems": {}})["systems"][label] = entry
    for per_gpu in workloads.values():
        for block in per_gpu.values():
            systems = block["systems"]
            if main_label not in systems:
                continue
            main = systems[main_label]["headline"]
            for label, entry in systems.items():
                if label == FLOOR_LABEL:
                    block["ratio_to_floor"] = compare(main, entry["headline"], speedup=False)
                elif label != main_label:
                    block[f"speedup_vs_{label}"] = compare(main, entry["headline"], speedup=True)
    return {"updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "main_label": main_label, "workloads": workloads}


def merge_summary(results_dir: Path, summary_path: Path | None = None, main_label: str = "flashserve") -> Path:
    """Rebuild `summary_path` (default `<results_dir>/summary.json`) from every result file below."""
    results_dir = Path(results_dir)
    summary_path = Path(summary_path or results_dir / "summary.json")
    summary = build_summary(iter_result_files(results_dir), main_label)
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary_path


if __name__ == "__main__":  # python -m benchmark.metrics [results_dir], default LOCAL_RESULTS
    print(merge_summary(Path(sys.argv[1]) if len(sys.argv) > 1 else LOCAL_RESULTS))
