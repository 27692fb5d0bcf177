"""Every `flashserve` import in the sources, tests and benchmarks names a module and a name that
exist. The GPU tests and benchmarks never run on a CPU machine (and some of their modules import
flashinfer), so a moved module or a renamed function would otherwise break them unseen; this reads
them as text (ast) and imports nothing."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
FILES = sorted([*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmark").rglob("*.py"),
                ROOT / "stress_test.py"])
# A dotted flashserve name in quotes: a monkeypatch target, a logger's name or a `python -m` module.
DOTTED = re.compile(r"[\"'](flashserve(?:\.\w+)+)[\"']")
LOGGERS = {"flashserve.requests"}  # loggers named after no module


@functools.cache
def module_file(module: str) -> Path | None:
    path = SRC.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def top_level_names(path: Path) -> set[str]:
    """What `from module import name` can take from `path`: its definitions, assignments and
    imports, also those under a top-level if or try."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def resolves(module: str, name: str | None = None) -> bool:
    path = module_file(module)
    if path is None:
        return False
    return name is None or module_file(f"{module}.{name}") is not None or name in top_level_names(path)


def unresolved(path: Path) -> list[str]:
    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "flashserve":
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name != "*" and not resolves(node.module, a.name)]  # type: ignore[arg-type]
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "flashserve" and not resolves(a.name)]
    for match in DOTTED.finditer(text):
        parts = match.group(1).split(".")
        if match.group(1) in LOGGERS:
            continue
        module = next((k for k in range(len(parts), 0, -1) if module_file(".".join(parts[:k]))), None)
        if module is None or (module < len(parts) and not resolves(".".join(parts[:module]), parts[module])):
            found.append(f"{match.group(1)!r}")
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flashserve_import_names_a_module_and_a_name_that_exist(path: Path) -> None:
    assert unresolved(path) == []


def test_the_engine_kv_cache_client_and_api_import_no_torch() -> None:
    # The front ends and the scheduler never touch a tensor: a front-end process starts without
    # torch's import time and memory, and engine/ and kv_cache/ stay testable without it.
    packages = sorted({p.relative_to(SRC).with_suffix("").as_posix().replace("/", ".")
                       for d in ("engine", "kv_cache", "client") for p in (SRC / "flashserve" / d).glob("*.py")})
    script = "import sys\n" + "".join(f"import {m}\n" for m in [*packages, "flashserve.api.server"]) + \
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


# The packages (and top-level modules) of flashserve, bottom first: each may import only those
# before it. "" is the package's own __init__ (the lazy `LLM` and `SamplingParams`).
LAYERS = ["message", "spec_decode", "config", "metrics_vllm", "metrics", "tracing", "pinned_staging", "kv_cache",
          "structured", "detokenizer", "engine", "layers", "attention", "distributed", "lora", "sample", "worker", "models", "model_loader",
          "executor", "client", "api", "cli", "serve_args", "entrypoints", "__main__", ""]
# Imports from a lower package to a higher one that are still there, each to be removed by moving
# what it needs down; nothing may be added here. Empty: every package imports only those below it.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _under_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports_of(path: Path, module: str | None = None) -> set[str]:
    """The flashserve modules `path` (module `module`, by default the one it is in src/) imports,
    at its top or inside functions; not those imported under `if TYPE_CHECKING:` (annotations
    only, never at run time)."""
    found: set[str] = set()
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if _under_type_checking(node):
            for child in node.orelse:  # type: ignore[attr-defined]
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            if base.split(".")[0] == "flashserve":
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if module_file(f"{base}.{alias.name}") else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "flashserve")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if module_file(m) is not None}


@functools.cache
def import_graph() -> dict[str, set[str]]:
    graph = {_module_name(p): set() for p in SRC.rglob("*.py")}
    for path in SRC.rglob("*.py"):
        graph[_module_name(path)] = imports_of(path) - {_module_name(path)}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    return {(a, b) for a, targets in graph.items() for b in targets if rank[_layer(a)] < rank[_layer(b)]}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other, round a circle (Tarjan's strongly connected
    components of more than one module, or a module that imports itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_every_package_has_a_place_in_the_layer_order() -> None:
    assert sorted({_layer(m) for m in import_graph()} - set(LAYERS)) == []


def test_no_package_imports_one_above_it() -> None:
    assert sorted(upward_imports(import_graph()) - ALLOWED_UPWARD) == []


def test_every_allowed_upward_import_is_still_there() -> None:
    # Once an arrow is gone, its entry goes too, so that it cannot come back unseen.
    assert sorted(ALLOWED_UPWARD - upward_imports(import_graph())) == []


def test_no_modules_import_each_other() -> None:
    assert import_circles(import_graph()) == []


def test_the_order_check_names_a_planted_upward_import_and_circle(tmp_path: Path) -> None:
    planted_file, planted = tmp_path / "planted.py", ".".join(["flashserve", "attention", "planted"])
    planted_file.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import flashserve.api.server\n"
                            "def f():\n    from flashserve.executor.build import build_runner\n")
    graph = {**import_graph(), planted: imports_of(planted_file, planted)}
    assert upward_imports(graph) - ALLOWED_UPWARD == {(planted, "flashserve.executor.build")}
    graph["flashserve.executor.build"] = graph["flashserve.executor.build"] | {planted}
    assert any(planted in c for c in import_circles(graph))
