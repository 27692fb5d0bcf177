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

