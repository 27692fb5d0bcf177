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
