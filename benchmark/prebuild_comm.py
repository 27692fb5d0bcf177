"""Compiles FlashInfer's fused all-reduce module here, for the GPU machine, and puts it in the wheel.

FlashInfer builds its `trtllm_comm` module (`--enable-flashinfer-allreduce-fusion`) with nvcc on first
use; on a fresh GPU machine that takes more than five minutes of its time. nvcc needs no GPU, so
this compiles the module on the machine that prepares `.whl/` (CUDA 13 toolkit, as on the GPU
machine) for the H100/H200 architecture, and stores the shared object inside the slimmed flashinfer
wheel at `flashinfer/data/aot/trtllm_comm/trtllm_comm.so`. FlashInfer loads a module found there
instead of building it (`jit.env.get_aot_artifacts`).

    python benchmark/prebuild_comm.py .whl/flashinfer_python-0.7.2.post1-py3-none-any.whl

`make comm-prebuilt` runs it after `make comm-source`.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODULE = "trtllm_comm"
ARCHS = "9.0a"  # H100 and H200
BUILD = f"""
from flashinfer.jit.comm import gen_trtllm_comm_module
spec = gen_trtllm_comm_module()
assert spec.name == {MODULE!r}, spec.name
spec.build()
print(spec.jit_library_path)
"""


def tvm_ffi_requirement(wheel_dir: Path) -> str:
    """The apache-tvm-ffi version that travels beside the flashinfer wheel (built for another Python)."""
    names = sorted(wheel_dir.glob("apache_tvm_ffi-*.whl"))
    if not names:
        raise SystemExit(f"no apache_tvm_ffi wheel in {wheel_dir}")
    return "apache-tvm-ffi==" + names[0].name.split("-")[1]


def nvcc_release(cuda_home: str) -> str:
    out = subprocess.run([f"{cuda_home}/bin/nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+)\.(\d+)", out)
    if not found:
        raise SystemExit(f"cannot read nvcc's release from: {out}")
    return found.group(1)


def build(wheel: Path, cuda_home: str, jobs: int) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="prebuild_comm."))
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
         str(wheel), tvm_ffi_requirement(wheel.parent), "nvidia-ml-py"],
        check=True,
    )  # fmt: skip
    # The module calls the CUDA runtime only; the driver library it is linked with may be missing
    # where no GPU driver is installed, so an empty stand-in satisfies the linker (and is dropped).
    stubs = tmp / "stubs"
    stubs.mkdir()
    subprocess.run(["gcc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so"), "-x", "c", "/dev/null"],
                   check=True)  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=str(site), FLASHINFER_WORKSPACE_BASE=str(tmp / "cache"), CUDA_HOME=cuda_home,
        FLASHINFER_CUDA_ARCH_LIST=ARCHS, MAX_JOBS=str(jobs), LIBRARY_PATH=str(stubs),
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"building {MODULE} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    library = Path(out.stdout.strip().splitlines()[-1])
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    if "libcuda.so" in needed:
        raise SystemExit(f"{library} needs the CUDA driver library at load time; not prebuilding it")
    stripped = tmp / f"{MODULE}.so"
    shutil.copy(library, stripped)
    subprocess.run(["strip", "--strip-unneeded", str(stripped)], check=True)
    return stripped


def add_to_wheel(wheel: Path, library: Path) -> str:
    name = f"flashinfer/data/aot/{MODULE}/{MODULE}.so"
    with zipfile.ZipFile(wheel) as z:
        present = name in z.namelist()
    if present:  # zipfile cannot replace a member: rewrite the wheel without it
        rewritten = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as dst:
            for item in src.infolist():
                if item.filename != name:
                    dst.writestr(item, src.read(item.filename))
        rewritten.replace(wheel)
    with zipfile.ZipFile(wheel, "a", zipfile.ZIP_DEFLATED) as z:
        z.write(library, name)
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", nargs="?", help="the flashinfer wheel (default: the one in .whl/)")
    parser.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    wheel = Path(args.wheel or next(iter(sorted(glob.glob(".whl/flashinfer_python-*.whl"))), ""))
    if not wheel.is_file():
        raise SystemExit("no flashinfer wheel: run ../shared/device/prepare-wheels.sh and make comm-source")
    if not Path(args.cuda_home, "bin", "nvcc").exists():
        raise SystemExit(f"no nvcc under {args.cuda_home} (set CUDA_HOME)")
    if nvcc_release(args.cuda_home) != "13":
        raise SystemExit("the GPU machine's torch and nvcc are CUDA 13; build with a CUDA 13 nvcc")
    library = build(wheel, args.cuda_home, args.jobs)
    name = add_to_wheel(wheel, library)
    print(f"{name}: {library.stat().st_size / 1e6:.1f} MB (sm_{ARCHS.replace('.', '')}) added to {wheel}")
    shutil.rmtree(library.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
