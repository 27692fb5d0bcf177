"""Serving benchmark for any OpenAI-compatible server (flashserve or a peer).

- `workloads`: the workloads of PERFORMANCE.md as lists of `BenchRequest`, fixed seeds.
- `client`: streaming requests with per-request timing, and the load (concurrency / Poisson rate).
- `metrics`: per-run aggregation (ms, per s) and `summary.json` merging.
- `goodput`: highest request rate whose P99 TTFT meets an SLO.
- `serve_bench`: the CLI (`python -m benchmark.serve_bench --workload ...`).
- `plots`: PNGs from result JSONs (`python -m benchmark.plots DIR`).
"""
