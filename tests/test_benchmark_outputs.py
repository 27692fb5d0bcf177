"""Benchmarks write to a git-ignored folder unless told otherwise, never over the committed results."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from benchmark import LOCAL_RESULTS, serve_bench

REPO = Path(__file__).resolve().parent.parent
BENCHMARK = REPO / "benchmark"


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_local_results_folder_is_git_ignored() -> None:
    probe = LOCAL_RESULTS.relative_to(REPO) / "NVIDIA_H100_80GB_HBM3" / "decode_bench.json"
    assert subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=REPO).returncode == 0


def test_no_benchmark_script_names_the_committed_results_folder_in_code() -> None:
    """Output paths come from LOCAL_RESULTS or an explicit --out; docstrings may name any folder."""
    offenders = []
    for path in sorted(BENCHMARK.glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        skip = docstrings(tree)
        for node in ast.walk(tree):
            named = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                and "benchmark/results" in node.value and "benchmark/results/local" not in node.value
            joined = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) \
                and isinstance(node.right, ast.Constant) and node.right.value == "results"
            if named or joined:
                offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders


def test_tp_gpu_script_writes_under_the_local_folder_by_default() -> None:
    script = (BENCHMARK / "tp_gpu.sh").read_text()
    assert "OUT=${OUT:-benchmark/results/local/" in script


def test_serve_bench_writes_its_runs_and_summary_under_the_local_folder_by_default() -> None:
    args = serve_bench.parse_args(["--workload", "latency"])
    assert args.out_dir is None and serve_bench.RESULTS_DIR == LOCAL_RESULTS  # run files: RESULTS_DIR/<gpu>/
    assert args.summary_path.parent == LOCAL_RESULTS



def test_tp_prefill_reports_the_gpu_idle_between_device_operations_of_any_stream() -> None:
    from benchmark.tp_prefill import device_idle

    # Two steps: a GEMM, an all-reduce on another stream overlapping it, a 300 us gap, a norm; a 1 ms
    # gap to the next step's GEMM, which a copy covers in part.
    ops = [(0.0, 100.0, "gemm"), (50.0, 150.0, "nccl_allreduce"), (450.0, 500.0, "norm"),
           (1500.0, 1600.0, "gemm"), (1400.0, 1550.0, "Memcpy HtoD")]  # fmt: skip
    idle = device_idle(ops, steps=2)
    assert idle["idle_ms"] == (300 + 900) / 1e3 / 2
    assert idle["span_ms"] == 1600 / 1e3 / 2
    assert [(g["ms"], g["after"], g["before"]) for g in idle["longest_gaps"]] == [
        (0.9, "norm", "Memcpy HtoD"), (0.3, "nccl_allreduce", "norm")]
