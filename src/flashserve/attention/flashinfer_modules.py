"""FlashInfer's compiled modules: prebuilt ones (`make kernels-prebuilt`, the Docker image) and
those its JIT compiles on first use.

FlashInfer loads a module found at `flashinfer/data/aot/<module>/<module>.so` instead of compiling
it, whatever the GPU. `benchmark/prebuild_kernels.py` builds them for the architectures it writes
to `flashinfer/data/aot/ARCHS` (sm_90a: H100, H200); on any other GPU those would fail at launch,
so `use_prebuilt_modules` points FlashInfer away from them there and it compiles its own.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def _modules(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / f"{p.name}.so").exists()) if root.is_dir() else []


def use_prebuilt_modules(device: torch.device) -> bool:
    """Whether FlashInfer may load its prebuilt modules on `device`'s architecture; when not, it is
    made to compile them instead (this process only). Call before the first kernel runs."""
    from flashinfer.jit import env

    marker = env.FLASHINFER_AOT_DIR / "ARCHS"
    if not marker.exists():
        return True
    major, minor = torch.cuda.get_device_capability(device)
    archs = marker.read_text().split()
    # "9.0a" runs on compute capability 9.0 only; an architecture-specific build never runs elsewhere.
    if f"{major}.{minor}" in (a.rstrip("af") for a in archs):
        return True
    logger.warning("FlashInfer's prebuilt modules are for %s, this GPU is %d.%d: compiling them on first use instead",
                   " ".join(archs), major, minor)  # fmt: skip
    env.FLASHINFER_AOT_DIR = env.FLASHINFER_AOT_DIR.with_name("aot-other-gpus")
    return False


def module_report() -> str | None:
    """A start-up log line: the FlashInfer modules the installed package holds prebuilt (loaded,
    not compiled), and those its JIT compiled on this machine (its cache: what a fresh machine
    compiles at start). None without flashinfer."""
    try:
        from flashinfer.jit import env
    except ImportError:
        return None
    prebuilt, built = _modules(env.FLASHINFER_AOT_DIR), _modules(env.FLASHINFER_JIT_DIR)
    return (f"FlashInfer modules: {len(prebuilt)} prebuilt in the package; {len(built)} compiled by its JIT on this "
            f"machine{': ' + ', '.join(built) if built else ''}")  # fmt: skip
