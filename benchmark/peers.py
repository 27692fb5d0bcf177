"""Peers on the same dummy weights as flashserve (same shape, same seed, same loader).

    python -m benchmark.peers --system hf-generate --model llama-3.2-1b --out-dir DIR
    python -m benchmark.peers --system hf-continuous-batching --model llama-3.2-1b --num-requests 128 --out-dir DIR

- `hf-generate`: transformers' `generate` (its own cache, sdpa). The latency workload (batch 1,
  128 in / 128 out; and batch 8, 32 in / 128 out): end-to-end time of `max_new_tokens=128`, TTFT as
  the time of `max_new_tokens=1` on the same prompts, TPOT = (e2e - TTFT) / 127. And the offline
  workload in static batches of `--batch-size` (32, as in the device README's reference figure).
- `hf-continuous-batching`: `model.generate_batch(...)` with `attn_implementation="paged|sdpa"`
  (transformers 5.17 needs the prefix; 5.23 drops it with a warning). Its duration runs from the
  first request scheduled to the last one finished, so the manager's warm-up and CUDA-graph capture
  are not counted. One `max_new_tokens` per call, so it runs the fixed 512 / 128 phase only.

Both run the first `--num-requests` requests of the offline phases (the same prompts flashserve
gets); a subset is stated in the JSON (`settings.subset`), and only rates (`*_per_s`), not
durations, enter the headline, so a subset still compares with the full run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Sequence

from benchmark.offline import add_common_args, prompt_spec_for, result_doc, write_and_print
from benchmark.workloads import BenchRequest, Phase, latency_phases, offline_phases

SYSTEMS = ("hf-generate", "hf-continuous-batching")


def load_peer_model(args: argparse.Namespace) -> Any:
    """The transformers model flashserve would load for `--model` (dummy weights from the same seed)."""
    from flashserve.config import ModelConfig
    from flashserve.model_loader.loader import load_model
    from flashserve.worker.assembly import pick_device

    device = pick_device(args.device)
    return load_model(ModelConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, seed=0), device)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_generate_s(model: Any, requests: Sequence[BenchRequest], new_tokens: int) -> float:
    """Seconds of one `generate` call on the prompts (left-padded), exactly `new_tokens` each."""
    import torch
    from transformers import GenerationConfig

    width = max(r.prompt_len for r in requests)
    ids = torch.zeros((len(requests), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, width - r.prompt_len :] = torch.tensor(r.prompt)
        mask[i, width - r.prompt_len :] = 1
    gc = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    ids, mask = ids.to(model.device), mask.to(model.device)
    _sync(model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, generation_config=gc)
    _sync(model.device)
    dt = time.perf_counter() - t0
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - width} tokens, asked for {new_tokens}")
    return dt


def hf_latency(model: Any, phases: Sequence[Phase]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per latency phase: e2e, TTFT and TPOT (ms) of each round, and serve_bench's headline names."""
    out, head = [], {}
    for ph in phases:
        batch = ph.concurrency or 1
        rounds = [ph.requests[i : i + batch] for i in range(0, len(ph.requests), batch)]
        hf_generate_s(model, rounds[0], 2)  # warm-up
        e2e, ttft = [], []
        for reqs in rounds:
            ttft.append(hf_generate_s(model, reqs, 1) * 1e3)
            e2e.append(hf_generate_s(model, reqs, reqs[0].output_len) * 1e3)
        tpot = [(e - t) / (ph.requests[0].output_len - 1) for e, t in zip(e2e, ttft)]
        out.append({"name": ph.name, "concurrency": batch, "rounds": len(rounds),
                    "metrics": {"e2e_ms": e2e, "ttft_ms": ttft, "tpot_ms": tpot}})
        head |= {f"{ph.name}_e2e_mean_ms": statistics.fmean(e2e), f"{ph.name}_ttft_median_ms": statistics.median(ttft),
                 f"{ph.name}_tpot_median_ms": statistics.median(tpot)}
    return out, head


def _metrics(requests: Sequence[BenchRequest], duration_s: float, completed: int, extra: dict[str, Any]) -> dict[str, Any]:
    n_in = sum(r.prompt_len for r in requests)
    n_out = sum(r.output_len for r in requests)
    return {"duration_s": duration_s, "completed": completed, "failed": len(requests) - completed,
            "total_input_tokens": n_in, "total_output_tokens": n_out, "request_throughput": completed / duration_s,
            "output_token_throughput": n_out / duration_s, "total_token_throughput": (n_in + n_out) / duration_s,
            **extra}


def hf_static_batches(model: Any, phase: Phase, batch_size: int) -> dict[str, Any]:
    """The phase in consecutive static batches; a batch generates its longest output for every row,
    and only the tokens each request asked for count as output."""
    hf_generate_s(model, phase.requests[: min(batch_size, len(phase.requests))], 2)  # warm-up
    total = 0.0
    generated = 0
    for i in range(0, len(phase.requests), batch_size):
        reqs = phase.requests[i : i + batch_size]
        longest = max(r.output_len for r in reqs)
        total += hf_generate_s(model, reqs, longest)
        generated += longest * len(reqs)
    return _metrics(phase.requests, total, len(phase.requests), {"batch_size": batch_size, "generated_tokens": generated})


def hf_continuous_batching(model: Any, phase: Phase, args: argparse.Namespace) -> dict[str, Any]:
    """transformers' `generate_batch` on the phase (one output length for all its requests)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    out_len = phase.requests[0].output_len
    if any(r.output_len != out_len for r in phase.requests):
        raise ValueError("generate_batch takes one max_new_tokens: run it on a phase of fixed output length")
    model.set_attn_implementation("paged|sdpa")
    gc = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb_kwargs: dict[str, Any] = {}
    if model.device.type == "cpu":  # sized from free GPU memory otherwise; on a CPU, just what the run needs
        cb_kwargs = {"num_blocks": sum(-(-(r.prompt_len + out_len) // 256) for r in phase.requests) + 8,
                     "max_batch_tokens": 1024}
    if args.cb_num_blocks:
        cb_kwargs["num_blocks"] = args.cb_num_blocks
    if args.cb_max_batch_tokens:
        cb_kwargs["max_batch_tokens"] = args.cb_max_batch_tokens
    cbc = ContinuousBatchingConfig(**cb_kwargs) if cb_kwargs else None
    t0 = time.perf_counter()
    results = model.generate_batch([list(r.prompt) for r in phase.requests], generation_config=gc,
                                   continuous_batching_config=cbc, warmup=not args.no_cb_warmup)
    wall = time.perf_counter() - t0
    outs = list(results.values())
    good = [o for o in outs if o.error is None and len(o.generated_tokens) == out_len]
    spans = [o.lifespan for o in outs if o.lifespan[0] > 0 and o.lifespan[1] > 0]
    duration = max(s[1] for s in spans) - min(s[0] for s in spans) if spans else wall
    errors = [str(o.error) for o in outs if o.error is not None][:5]
    return _metrics(phase.requests, duration, len(good),
                    {"wall_s": wall, "errors": errors, "attn_implementation": model.config._attn_implementation,
                     "continuous_batching_config": cb_kwargs})


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The peer's result documents, each written as soon as it is complete: latency (hf-generate
    only) and offline."""
    import transformers

    loaded = load_peer_model(args)
    model = loaded.model
    spec = prompt_spec_for(model.config.vocab_size)
    docs = []
    extra = {"transformers": transformers.__version__, "dtype": str(loaded.dtype).removeprefix("torch."),
             "device": str(loaded.device)}
    if args.system == "hf-generate" and args.latency_repeats:
        phases, head = hf_latency(model, latency_phases(spec, args.seed, args.latency_repeats))
        args.workload = "latency"
        docs.append(result_doc(args, args.system, phases, head, loaded.name, None, extra))
        write_and_print(docs[-1], args.out_dir)
        print(f"{args.system} latency: " + ", ".join(f"{k} {v:.2f}" for k, v in head.items()), flush=True)
    wanted = ("fixed512x128",) if args.system == "hf-continuous-batching" else args.phases
    phases, head = [], {}
    for ph in offline_phases(spec, args.seed, 256):
        if ph.name not in wanted:
            continue
        ph = Phase(ph.name, ph.requests[: args.num_requests])
        if args.system == "hf-generate":
            m = hf_static_batches(model, ph, args.batch_size)
        else:
            m = hf_continuous_batching(model, ph, args)
        phases.append({"name": ph.name, "num_requests": len(ph.requests), "metrics": m})
        head |= {f"{ph.name}_req_per_s": m["request_throughput"], f"{ph.name}_output_tok_per_s": m["output_token_throughput"],
                 f"{ph.name}_total_tok_per_s": m["total_token_throughput"]}
        print(f"{args.system} {ph.name}: {m['completed']}/{len(ph.requests)} in {m['duration_s']:.2f} s, "
              f"{m['request_throughput']:.2f} req/s, {m['output_token_throughput']:.0f} out tok/s", flush=True)
    args.workload = "offline"
    subset = {"subset": args.num_requests < 256, "workload_num_requests": 256, "phases_run": [p["name"] for p in phases]}
    docs.append(result_doc(args, args.system, phases, head, loaded.name, None, extra | subset))
    write_and_print(docs[-1], args.out_dir)
    return docs


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 1 when a request of the offline phases did not complete."""
    p = argparse.ArgumentParser(prog="python -m benchmark.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    add_common_args(p)
    p.add_argument("--batch-size", type=int, default=32, help="hf-generate: static batch size")
    p.add_argument("--latency-repeats", type=int, default=3, help="hf-generate: rounds per latency batch size (0: skip)")
    p.add_argument("--phases", type=lambda s: tuple(x for x in s.split(",") if x), default=("fixed512x128",),
                   help="hf-generate: offline phases (fixed512x128, uniform100to1024)")
    p.add_argument("--cb-num-blocks", type=int, help="hf-continuous-batching: KV blocks (default: from memory)")
    p.add_argument("--cb-max-batch-tokens", type=int, help="hf-continuous-batching: tokens per batch")
    p.add_argument("--no-cb-warmup", action="store_true", help="hf-continuous-batching: skip its warm-up")
    args = p.parse_args(argv)
    failed = False
    for doc in run(args):
        failed |= any(ph["metrics"].get("failed") for ph in doc["phases"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
