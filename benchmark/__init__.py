"""Serving benchmark for any OpenAI-compatible server (flashserve or a peer).

- `workloads`: the workloads of PERFORMANCE.md as lists of `BenchRequest`, fixed seeds.
- `client`: streaming requests with per-request timing, and the load (concurrency / Poisson rate).
- `metrics`: per-run aggregation (ms, per s) and `summary.json` merging.
- `goodput`: highest request rate whose P99 TTFT meets an SLO.
- `serve_bench`: the CLI (`python -m benchmark.serve_bench --workload ...`).
- `plots`: PNGs from result JSONs (`python -m benchmark.plots DIR`).
- `floor`: measured copy bandwidth and matmul rate, and the roofline floor of each workload.
- `offline`: the offline workload through the Python API (`python -m benchmark.offline`).
- `peers`: HF transformers `generate` and `generate_batch` on the same dummy weights.
- `suite` (with `plan`, `server_process`, `report`): the whole suite in one command
  (`bash benchmark/run_suite.sh OUT` on a GPU machine; `python -m benchmark.suite OUT --smoke` on a CPU).

Every script writes under `LOCAL_RESULTS` unless its `--out` (`--out-dir`) names another folder.
"""

from pathlib import Path

# Git-ignored: a run never overwrites the committed results beside it unless told to.
LOCAL_RESULTS = Path(__file__).resolve().parent / "results" / "local"
