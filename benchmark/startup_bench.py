"""Start to healthy: seconds from starting `flashserve serve` (the embedded model on the CPU) to its
first /health 200, for two source trees, runs interleaved (this machine's speed drifts).

    python -m benchmark.startup_bench --before /tmp/before/src [--after src] [--repeats 5]

Each tree runs as `python -m flashserve serve` with PYTHONPATH set to it and the same virtual
environment, so both read the same converted GGUF (`model_loader/gguf_cache.py`); one unmeasured
start per tree first makes sure that copy exists and the files are in the page cache. Prints a
table (median, min, max, every run) and writes JSON to `--out` (default: the git-ignored
benchmark/results/local/cpu/startup.json; the committed figures are benchmark/results/cpu/startup.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from benchmark import LOCAL_RESULTS
from benchmark.cpu_bench import serve_startup_s

ROOT = Path(__file__).resolve().parent.parent
OUT = LOCAL_RESULTS / "cpu" / "startup.json"


def start_to_healthy_s(src: str, timeout_s: float = 180.0) -> float:
    """Seconds from the process start to the first /health 200 of a server from the tree `src`."""
    seconds = serve_startup_s(timeout_s, env={**os.environ, "PYTHONPATH": src}, poll_s=0.05)
    if seconds is None:
        raise RuntimeError(f"the server of {src} did not become healthy within {timeout_s:.0f} s")
    return seconds


def tree_of(src: str) -> str:
    """The flashserve package a server from `src` imports (checks that PYTHONPATH picks the tree)."""
    code = "import flashserve, os; print(os.path.dirname(flashserve.__file__))"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": src}, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="src directory of the tree before (a git worktree's src)")
    p.add_argument("--after", default=str(ROOT / "src"), help="src directory of the tree after (default: this one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    for name, src in trees.items():
        found = tree_of(src)
        if not found.startswith(src):
            raise SystemExit(f"{name}: PYTHONPATH={src} imports flashserve from {found}")
        start_to_healthy_s(src)  # unmeasured: the converted GGUF exists and the files are cached
    runs: dict[str, list[float]] = {name: [] for name in trees}
    for i in range(args.repeats):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))  # neither always goes first
        for name in order:
            runs[name].append(round(start_to_healthy_s(trees[name]), 2))
    summary = {name: {"median_s": round(statistics.median(r), 2), "min_s": min(r), "max_s": max(r), "runs_s": r}
               for name, r in runs.items()}
    saved = round(summary["before"]["median_s"] - summary["after"]["median_s"], 2)
    print(f"{'tree':8} {'median s':>9} {'min s':>7} {'max s':>7}  runs (s)")
    for name, s in summary.items():
        print(f"{name:8} {s['median_s']:9.2f} {s['min_s']:7.2f} {s['max_s']:7.2f}  {s['runs_s']}")
    print(f"start to healthy: {saved:+.2f} s faster after (medians of {args.repeats} interleaved runs)")
    doc = {"benchmark": "startup_bench", "what": "flashserve serve (embedded SmolLM2-135M, CPU): start to /health 200",
           "cpu_count": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
           "repeats": args.repeats, "trees": trees, "results": summary, "median_saved_s": saved}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
