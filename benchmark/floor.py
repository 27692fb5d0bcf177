"""The physical floor of each workload: measured device rates and the roofline formulas over them.

    python -m benchmark.floor --out rates.json [--device auto|cuda|cpu]

Rates are measured at the start of a run, on the machine that runs it: the device-to-device copy
bandwidth (bytes read + bytes written per second, median of CUDA-event timed copies of a 1 GiB
tensor) and the bf16 matmul rate (FLOP/s of an 8192^3 matmul on random data). On a CPU the same
code runs with small float32 sizes, so that the formulas can be exercised without a GPU.

Formulas (`ModelShape` counts the weights of a Llama-family decoder; bytes at the weight dtype):
- decode step floor (s) = (weight bytes + KV bytes read) / copy bandwidth, where the KV bytes read
  are sum over the batch of (context tokens) * kv_bytes_per_token;
- prefill floor (s) = (2 * matmul params * tokens + 2 * lm-head params + causal attention FLOPs)
  / matmul rate; a forward pass also reads every weight once, so a time to first token is at least
  max(prefill floor, weight bytes / bandwidth);
- offline workload floor (s) = sum over requests of the prefill floor of its prompt (which yields
  its first token) + sum over decode steps k = 1 .. max(out) - 1 of max(byte time, FLOP time) of
  one step that holds every request still generating (out_i > k) at context in_i + k. This is the
  schedule with the fewest weight reads (all requests in one batch, no batch-size cap); the FLOP
  term only matters for large batches of large models, where a decode step turns compute-bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class DeviceRates:
    """Measured rates of one device: copy bandwidth in bytes/s (read + write), matmul in FLOP/s."""

    device: str
    copy_bytes_per_s: float
    matmul_flop_per_s: float
    matmul_dtype: str = "bfloat16"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "copy_GB_per_s": self.copy_bytes_per_s / 1e9,
                "matmul_TFLOP_per_s": self.matmul_flop_per_s / 1e12}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder; `dtype_bytes` of weights and KV (2 for bf16)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, dtype_bytes: int = 2) -> ModelShape:
        """From a config.json dict or a transformers config object."""
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        heads = int(get("num_attention_heads"))
        return cls(
            num_layers=int(get("num_hidden_layers")), hidden_size=int(get("hidden_size")), num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or get("hidden_size") // heads),
            intermediate_size=int(get("intermediate_size")), vocab_size=int(get("vocab_size")),
            dtype_bytes=dtype_bytes,
        )  # fmt: skip

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def matmul_params(self) -> int:
        """Weights of the q/k/v/o and gate/up/down projections of all layers."""
        h = self.hidden_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * self.intermediate_size
        return self.num_layers * per_layer

    @property
    def head_params(self) -> int:
        """The lm head (read in full every step, tied to the embedding or not)."""
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward pass reads: projections, lm head, norms (the embedding rows are negligible)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return (self.matmul_params + self.head_params + norms) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_size * self.dtype_bytes

    def prefill_flops(self, prompt_len: int) -> float:
        """FLOPs of one prompt's prefill: projections on every token, lm head on the last, causal attention."""
        attention = 2 * prompt_len * (prompt_len + 1) * self.q_size * self.num_layers  # sum_i 4 * i * q_size
        return 2 * self.matmul_params * prompt_len + 2 * self.head_params + attention

    def decode_flops(self, context_lens: Sequence[int] | np.ndarray) -> float:
        """FLOPs of one decode step: one token per request, attending over its context."""
        ctx = np.asarray(context_lens, dtype=np.float64)
        return float(len(ctx) * 2 * (self.matmul_params + self.head_params) + 4 * ctx.sum() * self.q_size * self.num_layers)


def decode_step_floor_s(shape: ModelShape, rates: DeviceRates, context_lens: Sequence[int]) -> float:
    """(weight bytes + KV bytes of every request's context) / copy bandwidth, in seconds."""
    kv = float(np.sum(np.asarray(context_lens, dtype=np.float64))) * shape.kv_bytes_per_token
    return (shape.weight_bytes + kv) / rates.copy_bytes_per_s


def prefill_floor_s(shape: ModelShape, rates: DeviceRates, prompt_lens: Sequence[int]) -> float:
    """FLOPs of prefilling every prompt / matmul rate, in seconds."""
    return sum(shape.prefill_flops(n) for n in prompt_lens) / rates.matmul_flop_per_s


def first_token_floor_s(shape: ModelShape, rates: DeviceRates, prompt_lens: Sequence[int]) -> float:
    """A prefill forward also reads every weight once: max(prefill floor, weight bytes / bandwidth)."""
    return max(prefill_floor_s(shape, rates, prompt_lens), shape.weight_bytes / rates.copy_bytes_per_s)


def offline_floor_s(shape: ModelShape, rates: DeviceRates, requests: Sequence[tuple[int, int]]) -> dict[str, float]:
    """Floor of an offline run of (prompt_len, output_len) requests (see the module docstring).

    Returns seconds: `prefill_s`, `decode_s` (sum of per-step max(bytes, FLOPs) times), `total_s`,
    and `decode_bytes_s` / `decode_flops_s` (the two terms summed separately, for reference).
    """
    ins = np.array([r[0] for r in requests], dtype=np.float64)
    outs = np.array([r[1] for r in requests], dtype=np.int64)
    prefill = prefill_floor_s(shape, rates, [int(n) for n in ins])
    decode = bytes_s = flops_s = 0.0
    for k in range(1, int(outs.max(initial=0))):
        ctx = ins[outs > k] + k
        b = decode_step_floor_s(shape, rates, ctx)  # type: ignore[arg-type]
        f = shape.decode_flops(ctx) / rates.matmul_flop_per_s
        decode, bytes_s, flops_s = decode + max(b, f), bytes_s + b, flops_s + f
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode,
            "decode_bytes_s": bytes_s, "decode_flops_s": flops_s}


def _decode_floor_ms(shape: ModelShape, rates: DeviceRates, batch: int, prompt_len: int, output_len: int) -> float:
    """Mean decode step floor (ms) of `batch` requests generating tokens 2 .. output_len together."""
    steps = [decode_step_floor_s(shape, rates, [prompt_len + k] * batch) for k in range(1, max(output_len, 2))]
    return 1e3 * float(np.mean(steps))


def latency_floor_headline(shape: ModelShape, rates: DeviceRates, phases: Sequence[Any]) -> dict[str, float]:
    """Floors under serve_bench's latency headline names (`workloads.latency_phases`: one batch size each)."""
    out = {}
    for ph in phases:
        batch, r = ph.concurrency or len(ph.requests), ph.requests[0]
        ttft_ms = 1e3 * first_token_floor_s(shape, rates, [r.prompt_len] * batch)
        tpot_ms = _decode_floor_ms(shape, rates, batch, r.prompt_len, r.output_len)
        out |= {f"{ph.name}_ttft_median_ms": ttft_ms, f"{ph.name}_tpot_median_ms": tpot_ms,
                f"{ph.name}_e2e_mean_ms": ttft_ms + (r.output_len - 1) * tpot_ms}
    return out


def concurrency_floor_headline(shape: ModelShape, rates: DeviceRates, phases: Sequence[Any]) -> dict[str, float]:
    """Per level c: TTFT of c prompts prefilled together, step time and output rate of c streams."""
    out = {}
    for ph in phases:
        c, r = ph.concurrency, ph.requests[0]
        tpot_ms = _decode_floor_ms(shape, rates, c, r.prompt_len, r.output_len)
        out |= {f"{ph.name}_ttft_median_ms": 1e3 * first_token_floor_s(shape, rates, [r.prompt_len] * c),
                f"{ph.name}_tpot_median_ms": tpot_ms, f"{ph.name}_output_tok_per_s": c / (tpot_ms / 1e3)}
    return out


def goodput_floor_headline(shape: ModelShape, rates: DeviceRates, prompt_len: int = 2048, output_len: int = 256) -> dict[str, float]:
    """Batch-1 floors of the random workload's mean request: its TTFT and its decode step (the ITL)."""
    return {"ttft_median_ms": 1e3 * first_token_floor_s(shape, rates, [prompt_len]),
            "itl_median_ms": 1e3 * decode_step_floor_s(shape, rates, [prompt_len + output_len // 2])}


def offline_floor_headline(shape: ModelShape, rates: DeviceRates, phases: Sequence[Any]) -> dict[str, float]:
    """Floors under `benchmark.offline`'s headline names: per phase and for the whole workload."""
    out: dict[str, float] = {}
    total_s = total_out = 0.0
    for ph in phases:
        reqs = [(r.prompt_len, r.output_len) for r in ph.requests]
        floor_s = offline_floor_s(shape, rates, reqs)["total_s"]
        n_in, n_out = sum(r[0] for r in reqs), sum(r[1] for r in reqs)
        out |= {f"{ph.name}_duration_s": floor_s, f"{ph.name}_req_per_s": len(reqs) / floor_s,
                f"{ph.name}_output_tok_per_s": n_out / floor_s, f"{ph.name}_total_tok_per_s": (n_in + n_out) / floor_s}
        total_s, total_out = total_s + floor_s, total_out + n_out
    out |= {"workload_duration_s": total_s, "workload_output_tok_per_s": total_out / total_s}
    return out


def median_time_s(fn: Callable[[], Any], device: str, warmup: int, iters: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if device == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_rates(device: str = "auto", cpu_copy_bytes: int = 32 << 20, cpu_matmul_n: int = 512) -> DeviceRates:
    """Copy bandwidth and matmul rate of `device` (1 GiB copy, bf16 8192^3 on CUDA; fp32 on CPU,
    small by default; a CPU floor wants a copy larger than the caches and a matmul that reaches
    the cores' rate: `benchmark.cpu_bench` passes 512 MiB and 2048)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    nbytes, n, dtype = (1 << 30, 8192, torch.bfloat16) if cuda else (cpu_copy_bytes, cpu_matmul_n, torch.float32)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = median_time_s(lambda: dst.copy_(src), device, 3, 10)
    del src, dst
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    mm_s = median_time_s(lambda: a @ b, device, 3, 10)
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return DeviceRates(name, 2 * nbytes / copy_s, 2 * n**3 / mm_s, str(dtype).removeprefix("torch."))


def load_rates(path: Path) -> DeviceRates:
    doc = json.loads(Path(path).read_text())
    return DeviceRates(doc["device"], float(doc["copy_bytes_per_s"]), float(doc["matmul_flop_per_s"]),
                       doc.get("matmul_dtype", "bfloat16"))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--out", type=Path, required=True, help="JSON file for the measured rates")
    args = p.parse_args(argv)
    rates = measure_rates(args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rates.to_json(), indent=2) + "\n")
    print(f"{rates.device}: copy {rates.copy_bytes_per_s / 1e9:.0f} GB/s, "
          f"{rates.matmul_dtype} matmul {rates.matmul_flop_per_s / 1e12:.1f} TFLOP/s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
