"""Prebuilt FlashInfer modules are used only on the GPU architecture they were built for, and the
start-up log names what was prebuilt and what FlashInfer compiled. FlashInfer's `jit.env` is stood
in for (the CPU suite has no flashinfer), with its two folders in a temporary directory."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from flashserve.attention import flashinfer_modules


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    env = types.SimpleNamespace(FLASHINFER_AOT_DIR=tmp_path / "aot", FLASHINFER_JIT_DIR=tmp_path / "cached_ops")
    for name in ("norm", "sampling"):
        (env.FLASHINFER_AOT_DIR / name).mkdir(parents=True)
        (env.FLASHINFER_AOT_DIR / name / f"{name}.so").write_bytes(b"")
    (env.FLASHINFER_AOT_DIR / "ARCHS").write_text("9.0a\n")
    (env.FLASHINFER_JIT_DIR / "rope").mkdir(parents=True)
    (env.FLASHINFER_JIT_DIR / "rope" / "rope.so").write_bytes(b"")
    jit = types.ModuleType("flashinfer.jit")
    jit.env = env  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.jit", jit)
    return env


def test_a_gpu_of_the_prebuilt_architecture_loads_the_prebuilt_modules(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    aot = env.FLASHINFER_AOT_DIR
    assert flashinfer_modules.use_prebuilt_modules(torch.device("cuda", 0))
    assert env.FLASHINFER_AOT_DIR == aot


def test_another_gpu_compiles_its_own_instead_of_loading_modules_built_for_sm90a(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not flashinfer_modules.use_prebuilt_modules(torch.device("cuda", 0))
    assert not (env.FLASHINFER_AOT_DIR / "norm" / "norm.so").exists()


def test_the_start_up_report_counts_prebuilt_modules_and_names_the_compiled_ones(env: Any) -> None:
    assert flashinfer_modules.module_report() == (
        "FlashInfer modules: 2 prebuilt in the package; 1 compiled by its JIT on this machine: rope"
    )
