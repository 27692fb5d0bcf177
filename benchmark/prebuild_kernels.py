"""Compiles the FlashInfer modules the server uses here, for the GPU machine, and puts them in the wheel.

FlashInfer builds each kernel module with nvcc on first use: on a fresh GPU machine that is minutes
before the first request (attention, norm, RoPE, page, SiLU, sampling, cascade merge, the fused
all-reduce). nvcc needs no GPU, so this compiles them on the machine that prepares `.whl/` (CUDA 13
toolkit, as on the GPU machine) for the H100/H200 architecture (sm_90a), and stores each shared
object inside the slimmed flashinfer wheel at `flashinfer/data/aot/<module>/<module>.so`. FlashInfer
loads a module found there instead of building it (`jit.env.get_aot_artifacts`).

The modules are the ones the server's code paths ask for, built by the same FlashInfer generators
with the same arguments, so their names (URIs) are the ones looked up at run time:

- `attention/flashinfer.py`: FA2 paged prefill (`backend="fa2"`), which the tensor-core decode
  wrapper reuses, per head size, q/KV dtype and output dtype (the model's; float16 for cascade
  passes), int32 indices, no RoPE in the kernel, no sliding window or soft cap; FA3's (Hopper) of
  the first head size and dtype, for fresh prompts' ragged pass; the cascade merge; the page append.
- `layers/ops.py`: RMSNorm and fused add + RMSNorm, RoPE with a cos/sin cache, SiLU-and-mul.
- `sample/flashinfer.py`: softmax, top-k/top-p/min-p sampling and renorms (one module).
- `distributed/comm.py`: the fused all-reduce + RMSNorm (`trtllm_comm`; its source comes back with
  `make comm-source`).
- `--kv-cache-dtype fp8` (group `fp8`): the FP8-KV attention of the first head size. (The FP8 GEMM
  module behind `bmm_fp8` needs cuBLAS headers this toolkit lacks; it compiles on first use.)

    python benchmark/prebuild_kernels.py                       # every module, into the wheel in .whl/
    python benchmark/prebuild_kernels.py --modules comm        # the fused all-reduce only
    python benchmark/prebuild_kernels.py --check               # GPU machine: load each one, name the missing

Compiled objects stay in `--build-dir` (default build/prebuild-kernels), so an interrupted run
resumes where it stopped; finished modules wait, stripped, in `<build-dir>/aot` until every requested
module is built (or failed), then go into the wheel. `make kernels-prebuilt` runs it.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

ARCHS = "9.0a"  # H100 and H200
CURAND = "nvidia-curand==10.4.4.72"  # CUDA 13's cuRAND, for its headers
GROUPS = ("attention", "ops", "sampling", "comm", "fp8")
AOT_IN_WHEEL = "flashinfer/data/aot/"  # <module>/<module>.so and ARCHS under it
_IMPORT_NEEDS = [("numpy", "numpy"), ("packaging", "packaging"), ("requests", "requests"), ("tqdm", "tqdm"),
                 ("jinja2", "jinja2"), ("filelock", "filelock"), ("markupsafe", "markupsafe"),
                 ("urllib3", "urllib3"), ("idna", "idna"), ("certifi", "certifi"),
                 ("charset_normalizer", "charset-normalizer")]


def spec_factories(head_dims: list[int], dtypes: list[str]) -> list[tuple[str, str]]:
    """(group, Python expression of a JitSpec), most needed first: what every Llama forward of the
    first head size and dtype runs, sampling, the fused all-reduce, then the cascade passes' output
    dtype and the other head sizes and dtypes. Evaluated in the child, with flashinfer."""
    attention = []
    for dtype in dtypes:
        for head_dim in head_dims:
            # The model's output dtype, then float16 (cascade passes write float16).
            for out in dict.fromkeys([dtype, "float16"]):
                attention.append(
                    f"_gen_batch_prefill_primary_module('fa2', torch.{dtype}, torch.{dtype}, torch.{out}, "
                    f"torch.int32, {head_dim}, {head_dim}, 0, False, False, False)"
                )
    # FA3 (Hopper) for fresh prompts' ragged pass (`RAGGED_MIN_TOKENS`), of the first dtype and head size.
    # FlashInfer builds every backend but FA2 through the public generator (runtime paged-KV strides).
    fa3 = (f"gen_batch_prefill_module('fa3', torch.{dtypes[0]}, torch.{dtypes[0]}, torch.{dtypes[0]}, "
           f"torch.int32, {head_dims[0]}, {head_dims[0]}, 0, False, False, False)")
    first, rest = [attention[0], fa3], attention[1:]
    # FP8: attention over an FP8 KV cache (queries and output in the model's dtype) for the first
    # head size. The small-batch FP8 GEMM's module (`gen_gemm_module`, behind `bmm_fp8`) needs the
    # cuBLAS headers, which a toolkit of nvcc alone lacks: it compiles on first use.
    fp8 = [f"_gen_batch_prefill_primary_module('fa2', torch.{dtypes[0]}, torch.float8_e4m3fn, torch.{dtypes[0]}, "
           f"torch.int32, {head_dims[0]}, {head_dims[0]}, 0, False, False, False)"]
    ops = ["gen_norm_module()", "gen_rope_module()", "gen_page_module()", "gen_act_and_mul_module('silu')",
           "gen_cascade_module()"]  # fmt: skip
    return ([("attention", s) for s in first] + [("ops", s) for s in ops] + [("sampling", "gen_sampling_module()")]
            + [("comm", "gen_trtllm_comm_module()")] + [("attention", s) for s in rest]
            + [("fp8", s) for s in fp8])  # fmt: skip


# Modules of a group that are never prebuilt here (the FP8 GEMM's needs cuBLAS headers that a toolkit of
# nvcc alone lacks) but that `--check --build-missing` compiles on the GPU machine, whose toolkit has
# them, so that the first FP8 run after it does not.
FIRST_USE = {"fp8": ["gen_gemm_module()"]}

# The generators that `spec_factories`' and FIRST_USE's expressions call, imported where those are evaluated.
GENERATORS = """
import torch
from flashinfer.jit.activation import gen_act_and_mul_module
from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_prefill_module
from flashinfer.jit.cascade import gen_cascade_module
from flashinfer.jit.comm import gen_trtllm_comm_module
from flashinfer.jit.gemm import gen_gemm_module
from flashinfer.jit.norm import gen_norm_module
from flashinfer.jit.page import gen_page_module
from flashinfer.jit.rope import gen_rope_module
from flashinfer.jit.sampling import gen_sampling_module
"""
# Runs in the child: builds each spec in turn, copies its stripped library into OUT, reports JSON lines.
CHILD = GENERATORS + """
import json, shutil, subprocess, sys, time
from pathlib import Path
out = Path(sys.argv[1])
for expr in json.loads(sys.argv[2]):
    spec = eval(expr)
    dest = out / spec.name / f"{spec.name}.so"
    if dest.exists():
        print(json.dumps({"module": spec.name, "seconds": 0, "status": "present"}), flush=True)
        continue
    start = time.time()
    try:
        spec.build()
    except Exception as exc:
        print(json.dumps({"module": spec.name, "status": "failed", "error": str(exc)[-2000:]}), flush=True)
        continue
    needed = subprocess.run(["readelf", "-d", str(spec.jit_library_path)], capture_output=True, text=True).stdout
    if "libcuda.so" in needed:  # the stand-in driver library would not do at load time
        print(json.dumps({"module": spec.name, "status": "failed", "error": "links libcuda"}), flush=True)
        continue
    tmp = dest.with_suffix(".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(spec.jit_library_path, tmp)
    subprocess.run(["strip", "--strip-unneeded", str(tmp)], check=True)
    tmp.rename(dest)
    print(json.dumps({"module": spec.name, "seconds": round(time.time() - start, 1), "status": "built",
                      "mb": round(dest.stat().st_size / 1e6, 2)}), flush=True)
"""


def check(exprs: list[str], build_missing: bool) -> int:
    """On the GPU machine: loads every module the package holds prebuilt (never building one),
    prints the time each took, and names those it lacks; with `build_missing`, FlashInfer's JIT
    then builds those all at once (each module's nvcc processes in parallel too), into its cache
    for the processes that follow. Exit status 1 when a prebuilt module failed to load."""
    from concurrent.futures import ThreadPoolExecutor

    names: dict[str, Any] = {}
    exec(GENERATORS, names)
    failed, missing = 0, []
    for spec in (eval(expr, names) for expr in exprs):
        if not spec.is_aot:
            missing.append(spec)
            print(f"{spec.name[:110]:110s} not prebuilt", flush=True)
            continue
        start = time.perf_counter()
        try:
            loaded = spec.try_load()  # the prebuilt library only; None when it does not load
        except Exception as exc:
            loaded, error = None, f"{type(exc).__name__}: {str(exc)[:300]}"
        else:
            error = "did not load"
        failed += loaded is None
        status = f"loaded in {time.perf_counter() - start:.2f} s" if loaded is not None else f"FAILED: {error}"
        print(f"{spec.name[:110]:110s} {status}", flush=True)
    if build_missing and missing:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(missing)) as pool:
            list(pool.map(lambda spec: spec.build_and_load(), missing))
        print(f"{len(missing)} modules not prebuilt, compiled by FlashInfer here in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


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


def prepare(wheel: Path, build_dir: Path, cuda_home: str) -> dict[str, str]:
    """The wheel installed into build_dir/site (once per wheel) and the child's environment."""
    site, stamp = build_dir / "site", build_dir / "site.wheel"
    if not stamp.exists() or stamp.read_text() != f"{wheel.name} {wheel.stat().st_size}":
        shutil.rmtree(site, ignore_errors=True)
        # What `import flashinfer` needs besides torch (FLASHINFER.md §7), where this Python lacks it.
        missing = [pkg for mod, pkg in _IMPORT_NEEDS if importlib.util.find_spec(mod) is None]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
             str(wheel), tvm_ffi_requirement(wheel.parent), "nvidia-ml-py", *missing],
            check=True,
        )  # fmt: skip
        # Modules already in the wheel must not stand in for the ones to build (FlashInfer would
        # take them as prebuilt and skip the build).
        shutil.rmtree(site / "flashinfer" / "data" / "aot", ignore_errors=True)
        stamp.write_text(f"{wheel.name} {wheel.stat().st_size}")
    return build_env(build_dir, cuda_home, PYTHONPATH=str(site))


def build_env(build_dir: Path, cuda_home: str, **extra: str) -> dict[str, str]:
    """The child's environment: FlashInfer's JIT cache in build_dir, sm_90a, a stand-in libcuda,
    and stand-in cuBLAS headers where the toolkit has none."""
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(build_dir / "cache"), FLASHINFER_CUDA_ARCH_LIST=ARCHS,
               CUDA_HOME=cuda_home, **extra)  # fmt: skip
    include = build_dir / "stubs" / "include"
    include.mkdir(parents=True, exist_ok=True)
    # The norm module includes a TensorRT-LLM header that includes cuBLAS's without using any of
    # it: a toolkit without cuBLAS's development files (nvcc alone) gets empty ones. Were anything
    # of cuBLAS used, the build would fail, not go wrong.
    for name in ("cublasLt.h", "cublas_v2.h"):
        if not Path(cuda_home, "include", name).exists():
            (include / name).write_text("// stand-in: included by flashinfer/trtllm/common/cudaUtils.h, unused\n")
    # Sampling draws with cuRAND's device functions: its headers, from NVIDIA's wheel, where the
    # toolkit lacks them.
    if not Path(cuda_home, "include", "curand_kernel.h").exists() and not (include / "curand_kernel.h").exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux_2_27_x86_64", "--python-version", "3.12", "-d", str(build_dir),
                        CURAND], check=True)  # fmt: skip
        with zipfile.ZipFile(next(build_dir.glob("nvidia_curand-*.whl"))) as z:
            for name in z.namelist():
                if "/include/" in name and name.endswith(".h"):
                    (include / Path(name).name).write_bytes(z.read(name))
    env["FLASHINFER_EXTRA_CUDAFLAGS"] = f"{env.get('FLASHINFER_EXTRA_CUDAFLAGS', '')} -isystem {include}".strip()
    # The modules call the CUDA runtime only; the driver library they are linked with may be
    # missing where no GPU driver is installed, so an empty stand-in satisfies the linker.
    stubs = build_dir / "stubs"
    if not (stubs / "libcuda.so").exists():
        stubs.mkdir(parents=True, exist_ok=True)
        cc = shutil.which("gcc") or "g++"
        subprocess.run([cc, "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(stubs / "libcuda.so"), "-x", "c",
                        "/dev/null"], check=True)  # fmt: skip
    env["LIBRARY_PATH"] = str(stubs)
    return env


def build(exprs: list[str], env: dict[str, str], aot: Path, wheel: Path | None) -> list[dict]:
    """Builds the specs one after another in a child process; each module goes into the wheel as
    soon as it is built, so that an interrupted run leaves the finished ones there."""
    aot.mkdir(parents=True, exist_ok=True)
    # What they run on: `flashserve.attention.flashinfer_modules` keeps other GPUs off them.
    (aot / "ARCHS").write_text(ARCHS + "\n")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(aot), json.dumps(exprs)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    results = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.startswith("{"):
            continue
        result = json.loads(line)
        results.append(result)
        if result["status"] != "failed" and wheel is not None:
            add_to_wheel(wheel, [aot / result["module"] / f"{result['module']}.so", aot / "ARCHS"])
        print(f"{time.strftime('%H:%M:%S')} {line.strip()}", flush=True)
    stderr = proc.stderr.read() if proc.stderr else ""
    if proc.wait() != 0:
        raise SystemExit(f"the build process failed:\n{stderr[-4000:]}")
    return results


def seed_from_wheel(wheel: Path, aot: Path) -> list[str]:
    """Copies the modules the wheel already holds into the aot folder, so that they are not built
    again (a fresh build folder beside a wheel that an earlier run filled)."""
    seeded = []
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            parts = name.split("/")
            if name.startswith(AOT_IN_WHEEL) and name.endswith(".so") and len(parts) == 5:
                dest = aot / parts[3] / parts[4]
                if not dest.exists():
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(z.read(name))
                    seeded.append(parts[3])
    return seeded


def add_to_wheel(wheel: Path, files: list[Path]) -> list[str]:
    """Stores each file of an aot folder (<module>/<module>.so, ARCHS) at the same place under
    flashinfer/data/aot in the wheel, unless the same bytes are there. Zip entries cannot be
    replaced in place: a wheel holding another version of one is rewritten without it first."""
    names = {AOT_IN_WHEEL + "/".join(f.parts[-2:] if f.suffix == ".so" else f.parts[-1:]): f for f in files}
    with zipfile.ZipFile(wheel) as z:
        held = {i.filename: i for i in z.infolist() if i.filename in names}
    same = {n for n, i in held.items() if i.file_size == names[n].stat().st_size
            and i.CRC == zlib.crc32(names[n].read_bytes())}  # fmt: skip
    stale = set(held) - same
    if stale:
        rewritten = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as dst:
            for item in src.infolist():
                if item.filename not in stale:
                    dst.writestr(item, src.read(item.filename))
        rewritten.replace(wheel)
    with zipfile.ZipFile(wheel, "a", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for name, lib in names.items():
            if name not in same:
                z.write(lib, name)
    return list(names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", nargs="?", help="the flashinfer wheel (default: the one in .whl/)")
    parser.add_argument("--modules", default=",".join(GROUPS), help=f"groups, comma-separated: {', '.join(GROUPS)}")
    parser.add_argument("--head-dims", default="128,64", help="attention head sizes (Llama 8B/70B: 128; 1B, SmolLM2: 64)")
    parser.add_argument("--dtypes", default="bfloat16", help="model dtypes (bfloat16, float16)")
    parser.add_argument("--only", help="modules whose generator call contains one of these, comma-separated "
                                       "(e.g. norm,sampling)")
    parser.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    parser.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes (MAX_JOBS)")
    parser.add_argument("--build-dir", default="build/prebuild-kernels")
    parser.add_argument("--list", action="store_true", help="print the module expressions and stop")
    parser.add_argument("--pack-only", action="store_true",
                        help="build nothing: put the modules already built in <build-dir>/aot into the wheel")
    parser.add_argument("--installed", action="store_true",
                        help="into this Python's flashinfer package (a Docker image), not a wheel")
    parser.add_argument("--check", action="store_true",
                        help="on the GPU machine: load each module prebuilt and time it, name those missing")
    parser.add_argument("--build-missing", action="store_true", help="with --check: JIT-build the missing ones")
    args = parser.parse_args()
    groups = set(args.modules.split(","))
    if groups - set(GROUPS):
        raise SystemExit(f"unknown module groups {sorted(groups - set(GROUPS))}; choose from {GROUPS}")
    exprs = [expr for group, expr in spec_factories([int(d) for d in args.head_dims.split(",")],
                                                    args.dtypes.split(",")) if group in groups]  # fmt: skip
    if args.only:
        exprs = [expr for expr in exprs if any(word in expr for word in args.only.split(","))]
    if args.list:
        print("\n".join(exprs))
        return
    if args.check:
        first_use = [expr for group in GROUPS if group in groups for expr in FIRST_USE.get(group, ())]
        raise SystemExit(check(exprs + first_use, args.build_missing))
    if not Path(args.cuda_home, "bin", "nvcc").exists():
        raise SystemExit(f"no nvcc under {args.cuda_home} (set CUDA_HOME)")
    if nvcc_release(args.cuda_home) != "13":
        raise SystemExit("the GPU machine's torch and nvcc are CUDA 13; build with a CUDA 13 nvcc")
    build_dir = Path(args.build_dir).resolve()
    wheel: Path | None = None
    if args.installed:
        spec = importlib.util.find_spec("flashinfer")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("flashinfer is not installed in this Python")
        aot = Path(list(spec.submodule_search_locations)[0]) / "data" / "aot"
        env = build_env(build_dir, args.cuda_home)
    else:
        wheel = Path(args.wheel or next(iter(sorted(glob.glob(".whl/flashinfer_python-*.whl"))), ""))
        if not wheel.is_file():
            raise SystemExit("no flashinfer wheel: run ../shared/device/prepare-wheels.sh (and make comm-source)")
        aot = build_dir / "aot"
        if args.pack_only:
            libraries = sorted(aot.glob("*/*.so"))
            add_to_wheel(wheel, [*libraries, aot / "ARCHS"])
            print(f"{len(libraries)} modules from {aot} in {wheel} ({wheel.stat().st_size / 2**20:.1f} MiB)")
            return
        env = prepare(wheel, build_dir, args.cuda_home)
        seeded = seed_from_wheel(wheel, aot)
        if seeded:
            print(f"{len(seeded)} modules already in {wheel.name}: not built again")
    env["MAX_JOBS"] = str(args.jobs)
    start = time.time()
    results = build(exprs, env, aot, wheel)
    done = [aot / r["module"] / f"{r['module']}.so" for r in results if r["status"] != "failed"]
    total = sum(p.stat().st_size for p in done) / 1e6
    where = f"{wheel} ({wheel.stat().st_size / 2**20:.1f} MiB)" if wheel is not None else str(aot)
    print(f"{len(done)} modules ({total:.1f} MB, sm_{ARCHS.replace('.', '')}) in {where} after {time.time() - start:.0f} s")
    failed = [r for r in results if r["status"] == "failed"]
    for r in failed:
        print(f"FAILED {r['module']}: {r['error']}", file=sys.stderr)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
