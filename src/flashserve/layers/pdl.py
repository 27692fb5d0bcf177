"""Programmatic dependent launch (PDL) on Hopper and later GPUs.

A kernel launched with PDL may start while the kernel before it on the stream still runs: its
blocks take the SMs that one frees, do the work that does not depend on it (a GEMV's first weight
tile), and wait for it (`griddepcontrol.wait`: the kernel before has ended and its writes are
visible) before reading its output; the kernel before lets it start early
(`griddepcontrol.launch_dependents`). At one decode row a step is hundreds of short dependent
kernels, and each launch's latency and each kernel's ramp-up would otherwise add up. CUDA graphs
keep the launches' PDL edges.

Every kernel launched this way must wait before it reads what an earlier kernel wrote, and before
it ends, so that the kernels after it still see every write before theirs. FlashInfer's kernels
that take `enable_pdl` / `launch_with_pdl` do.
"""

from __future__ import annotations

import functools
import os

import torch

# Off (FLASHSERVE_PDL=0 in the environment, or set here): every kernel launches as a plain launch
# does, after the kernel before it has ended; benchmarks compare the two.
ENABLED = os.environ.get("FLASHSERVE_PDL", "1") != "0"


def launches_early(device: torch.device) -> bool:
    """Whether kernels that support PDL launch with it on `device`: a CUDA GPU of compute
    capability 9.0 or later, unless `ENABLED` is off."""
    return ENABLED and device.type == "cuda" and _capable(_index(device))


def triton_launches_early(device: torch.device) -> bool:
    """`launches_early`, and the installed Triton has the launch option (`launch_pdl`)."""
    return launches_early(device) and _triton_has_pdl()


def triton_pdl(device: torch.device) -> dict[str, bool]:
    """The keywords of a Triton kernel launch on `device` that has a `PDL` constexpr (whether it
    calls `gdc_wait` / `gdc_launch_dependents`): with `launch_pdl` where `triton_launches_early`."""
    return {"PDL": True, "launch_pdl": True} if triton_launches_early(device) else {"PDL": False}


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.cache
def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__
