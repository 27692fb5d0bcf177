"""Where a lone prompt's host time goes: `LLM.generate(max_tokens=1)` timed, then under cProfile.

    python -m benchmark.host_profile --model llama-3.1-8b --tokens 2048 [--quantization fp8 --kv-cache-dtype fp8]

Dummy weights, CUDA graphs as the server captures them, no prefix cache. Prints the median of 8 timed calls
(`tp_prefill.ttft_ms`, after unrecorded ones) and the functions of 5 profiled calls by their own time, then by cumulative
time: the host's work before the first kernel (scheduling, the step's inputs, FlashInfer's plan),
its launches beside the GPU, and its wait for the sampled token (`Event.synchronize`). cProfile
adds about a microsecond a call, so the profiled calls run longer than the timed ones. Writes
host_profile.json (the timings) and host_profile.txt (the profile) under `--out`.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--lines", type=int, default=45, help="functions shown in each ordering")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from benchmark.tp_prefill import ttft_ms
    from flashserve.entrypoints.llm import LLM
    from flashserve.message.sampling_params import SamplingParams

    llm = LLM(args.model, load_format="dummy", max_num_seqs=16, max_model_len=args.tokens + 64,
              gpu_memory_utilization=0.85, cuda_graph=True, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False)  # fmt: skip
    ttft_ms(llm, args.tokens, reps=3)  # warm-up (the timed call below draws the same prompts: no prefix cache)
    median = ttft_ms(llm, args.tokens, reps=8)
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    profiler = cProfile.Profile()
    for _ in range(5):
        ids = [rng.randrange(1000, 100000) for _ in range(args.tokens)]
        torch.cuda.synchronize()
        profiler.enable()
        llm.generate([ids], params)
        profiler.disable()
    llm.close()
    head = (f"{torch.cuda.get_device_name()}: {args.model}, {args.tokens}-token prompt, quantization "
            f"{args.quantization}, KV {args.kv_cache_dtype}: generate median {median:.2f} ms")  # fmt: skip
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for order in ("tottime", "cumulative"):
        stats.sort_stats(order).print_stats(args.lines)
    report = (head + "\n" + text.getvalue()).replace(os.getcwd() + "/", "")
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_profile.txt").write_text(report)
        (out / "host_profile.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "args": vars(args),
                                                            "generate_median_ms": median}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
