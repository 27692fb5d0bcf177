"""The offline workload through the Python API (`flashserve.LLM`, no HTTP), against its floor.

    python -m benchmark.offline --model llama-3.2-1b --out-dir benchmark/results/<gpu> [--rates rates.json]

Phases (`benchmark.workloads.offline_phases`): N requests x 512 in / 128 out, and N requests with
in/out uniform in [100, 1024]; greedy, ignore_eos, all submitted at once (N = 256 by default).
Each phase reports requests/s, output and total tokens/s and its duration; with measured device
rates (`benchmark.floor`) also its floor and floor / duration (1.0 would be the roofline itself).
Writes one result JSON (`workload` "offline@<model>", label `flashserve`, see benchmark.metrics).

`--shapes 128x128,2048x128,1000x1000` runs fixed shapes instead (N requests of IN tokens asking for
OUT each): the input/output lengths of TensorRT-LLM's published Llama-3.1-8B FP8 figures on an H100
(`trtllm-bench`, offline), printed beside ours for those shapes. `--quantization fp8` and
`--kv-cache-dtype fp8` load the model as the server's flags do.

    python -m benchmark.offline --model llama-3.1-8b --quantization fp8 --shapes 128x128,2048x128,1000x1000 \
        --num-requests 1024 --max-num-batched-tokens 8192 --out-dir DIR
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from benchmark.floor import DeviceRates, ModelShape, load_rates, offline_floor_s
from benchmark.workloads import Phase, PromptSpec, fixed_requests, offline_phases


# Output tokens/s of Llama-3.1-8B in FP8 on one H100, published by TensorRT-LLM (trtllm-bench,
# offline), by (input, output) length.
TRTLLM_H100_FP8_8B = {(128, 128): 28_312, (2048, 128): 3_450, (1000, 1000): 15_220}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"128x128,2048x128" -> [(128, 128), (2048, 128)]."""
    shapes = []
    for item in text.split(","):
        n_in, sep, n_out = item.strip().partition("x")
        if not sep or not n_in.isdigit() or not n_out.isdigit() or int(n_in) < 1 or int(n_out) < 1:
            raise argparse.ArgumentTypeError(f"a shape is INxOUT with two positive integers, e.g. 128x128: {item!r}")
        shapes.append((int(n_in), int(n_out)))
    return shapes


def shape_phases(spec: PromptSpec, seed: int, num_requests: int, shapes: Sequence[tuple[int, int]]) -> list[Phase]:
    """One phase a shape: `num_requests` distinct prompts of IN tokens, each asking for OUT."""
    return [Phase(f"fixed{n_in}x{n_out}", fixed_requests(num_requests, n_in, n_out, spec, seed + i))
            for i, (n_in, n_out) in enumerate(shapes)]


def shape_name(model: str) -> str:
    """A short name for a model: the built-in shape name, or the folder of a config.json."""
    from benchmark.serve_bench import slug

    path = Path(model)
    if path.name == "config.json":
        path = path.parent
    return slug(path.name or model)


def prompt_spec_for(vocab_size: int) -> PromptSpec:
    """Token-id prompts inside the vocabulary (the default range assumes at least 10,000 ids)."""
    return PromptSpec(kind="token_ids", token_id_high=min(10_000, vocab_size))


def run_phase(llm: Any, phase: Phase) -> dict[str, Any]:
    """Generate every request of the phase at once; counts, throughputs (per s) and duration (s)."""
    from flashserve.message.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in phase.requests]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in phase.requests], params)
    dur = time.perf_counter() - t0
    ok = [(r, o) for r, o in zip(phase.requests, outs) if o.error is None]
    n_in = sum(len(o.prompt_token_ids) for _, o in ok)
    n_out = sum(len(o.token_ids) for _, o in ok)
    return {
        "duration_s": dur,
        "completed": len(ok),
        "failed": len(outs) - len(ok),
        "errors": [o.error for o in outs if o.error is not None][:5],
        "output_len_mismatch": sum(1 for r, o in ok if len(o.token_ids) != r.output_len),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur,
        "output_token_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
    }


def offline_headline(phases: Sequence[dict[str, Any]], whole: bool = True) -> dict[str, float]:
    """Per phase and, when `whole` (every phase ran), for the workload (the phases' sums).

    Names as in `benchmark.floor.offline_floor_headline`."""
    out: dict[str, float] = {}
    for p in phases:
        m, n = p["metrics"], p["name"]
        out |= {f"{n}_req_per_s": m["request_throughput"], f"{n}_output_tok_per_s": m["output_token_throughput"],
                f"{n}_total_tok_per_s": m["total_token_throughput"], f"{n}_duration_s": m["duration_s"]}
    dur = sum(p["metrics"]["duration_s"] for p in phases)
    if whole and phases and dur > 0:
        out["workload_duration_s"] = dur
        out["workload_output_tok_per_s"] = sum(p["metrics"]["total_output_tokens"] for p in phases) / dur
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load the model, warm up, run both phases; the result document (not yet written)."""
    from flashserve.entrypoints.llm import LLM

    kwargs: dict[str, Any] = {"load_format": args.load_format, "device": args.device, "dtype": args.dtype,
                              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    for key in ("num_pages", "gpu_memory_utilization", "quantization", "kv_cache_dtype"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    loaded = llm.stack.loaded
    load_s = time.perf_counter() - t0
    shape = ModelShape.from_config(loaded.hf_config, dtype_bytes=loaded.dtype.itemsize)
    spec = prompt_spec_for(shape.vocab_size)
    if args.warmup:  # one batch as wide as the real ones: kernels and graph sizes are ready before timing
        run_phase(llm, Phase("warmup", fixed_requests(args.warmup, 64, 8, spec, seed=10_000)))
    rates = load_rates(args.rates) if args.rates else None
    phases = []
    shapes = args.shapes
    planned = shape_phases(spec, args.seed, args.num_requests, shapes) if shapes else offline_phases(
        spec, args.seed, args.num_requests)
    for phase in planned:
        if args.phases and phase.name not in args.phases:
            continue
        metrics = run_phase(llm, phase)
        entry: dict[str, Any] = {"name": phase.name, "num_requests": len(phase.requests), "metrics": metrics}
        if rates is not None:
            floor = offline_floor_s(shape, rates, [(r.prompt_len, r.output_len) for r in phase.requests])
            entry["floor"] = floor
            entry["floor_fraction"] = floor["total_s"] / metrics["duration_s"]  # 1.0 = at the roofline
        phases.append(entry)
        print(f"{phase.name}: {metrics['completed']}/{len(phase.requests)} in {metrics['duration_s']:.2f} s, "
              f"{metrics['request_throughput']:.2f} req/s, {metrics['output_token_throughput']:.0f} out tok/s, "
              f"{metrics['total_token_throughput']:.0f} tok/s" +
              (f", {entry['floor_fraction']:.2f} of floor ({entry['floor']['total_s']:.2f} s)" if rates else ""),
              flush=True)
        published = TRTLLM_H100_FP8_8B.get((phase.requests[0].prompt_len, phase.requests[0].output_len))
        if published is not None and shapes:
            entry["trtllm_h100_fp8_8b_output_tok_per_s"] = published
            print(f"  TensorRT-LLM's published figure for this shape (Llama-3.1-8B FP8, H100): {published:,} out tok/s; "
                  f"here {metrics['output_token_throughput'] / published:.2f}x of it", flush=True)
    whole = not shapes and len(phases) == 2
    return result_doc(args, "flashserve", phases, offline_headline(phases, whole=whole), loaded.name, rates,
                      {"load_s": load_s, "num_pages": llm.stack.num_pages, "page_size": llm.stack.page_size,
                       "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device)})


def result_doc(args: argparse.Namespace, label: str, phases: list[dict[str, Any]], headline: dict[str, float],
               model: str, rates: DeviceRates | None, extra: dict[str, Any]) -> dict[str, Any]:
    """A result document in benchmark.metrics' format (shared with benchmark.peers)."""
    from datetime import datetime, timezone

    from benchmark.serve_bench import detect_gpu_name, git_commit

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "schema": 1,
        "workload": f"{args.workload}@{shape_name(args.model)}",
        "label": label,
        "gpu": args.gpu_name or detect_gpu_name(),
        "git_commit": git_commit(),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "settings": settings | extra,
        "rates": rates.to_json() if rates else None,
        "phases": phases,
        "headline": {k: float(v) for k, v in headline.items()},
    }


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Options shared by the offline runner and the peers."""
    p.add_argument("--model", required=True, help="dummy shape name (llama-3.2-1b) or a config.json")
    p.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA (dummy), float32 on CPU")
    p.add_argument("--num-requests", type=int, default=256, help="per phase (the workload's 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", type=Path, help="rates JSON of benchmark.floor: adds the floor")
    p.add_argument("--gpu-name", help="default: torch.cuda.get_device_name(), else cpu")
    p.add_argument("--out-dir", type=Path, required=True)


def write_and_print(doc: dict[str, Any], out_dir: Path) -> Path:
    from benchmark.serve_bench import write_result

    path = write_result(doc, out_dir)
    print(f"wrote {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 1 when a request failed or got another number of tokens than it asked for."""
    p = argparse.ArgumentParser(prog="python -m benchmark.offline", description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-pages", type=int, help="KV pages (default: sized from memory)")
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--warmup", type=int, default=32, help="requests of 64 in / 8 out before timing (0: none)")
    p.add_argument("--phases", type=lambda s: tuple(x for x in s.split(",") if x), default=(),
                   help="run only these phases, e.g. fixed512x128 (default: both)")
    p.add_argument("--shapes", type=parse_shapes, help="fixed INxOUT shapes instead of the workload's phases, "
                   "e.g. 128x128,2048x128,1000x1000 (TensorRT-LLM's published FP8 shapes)")
    p.add_argument("--quantization", choices=("fp8",), help="as serve's --quantization")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), help="as serve's --kv-cache-dtype")
    args = p.parse_args(argv)
    args.workload = "offline"
    doc = run(args)
    write_and_print(doc, args.out_dir)
    bad = any(ph["metrics"]["failed"] or ph["metrics"]["output_len_mismatch"] for ph in doc["phases"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
