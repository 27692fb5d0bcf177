"""The mechanics of speculative decoding on a GPU: the verify step against a decode step, the draft
model's step, and a measured per-token latency at a given acceptance.

    python -m benchmark.spec_gpu [--model llama-3.1-8b] [--draft-model llama-3.2-1b] [--k 4]
        [--batches 1 8 32] [--kv-len 512] --acceptance benchmark/results/cpu/spec_decode/spec_bench.json
        [--e2e-batches 1 64] [--out DIR]
    python -m benchmark.spec_gpu --model smollm2-135m --draft-model smollm2-135m --device cpu \\
        --batches 1 2 --e2e-batches 1 2 --kv-len 64 --e2e-tokens 8 --steps 5 --repeat 1 \\
        --acceptance 0.8 0.6 0.45 0.3     # a smoke check on a CPU

Dummy weights (`--load-format dummy` shapes): their acceptance means nothing and n-gram lookup finds
nothing in their output, so this measures the mechanics only, and says so in its output.

1. Steps, timed with CUDA events over the runner (`runner.forward`: the model's forward and the
   logits of the positions that need them) of an engine built for speculation, so that its verify
   graphs are captured and a step made by hand with k drafts in every row replays them; median
   over `--steps`: a decode step of `batch`
   one-token rows at `kv-len` cached tokens each, and the verify step of the same rows carrying
   k draft tokens each (k + 1 tokens a row, logits at all of them). Both read the weights once, so
   at batch 1 the verify step should cost little more than the decode step (target <= 1.15x). The
   draft model's decode step at the same batches, when `--draft-model` is given.
2. What those steps imply at the acceptance measured on the CPU (`--acceptance`: the
   spec_bench.json of `benchmark.spec_bench`, its n-gram row of k draft tokens, or the shares
   accepted at each draft position given as numbers): a verified step yields its mean accepted
   length of tokens, so the per-token latency is verify / mean length (n-gram: proposing costs
   nothing on the GPU), or (verify + k draft steps) / mean length with a draft model.
3. Measured, not inferred: `LLM.generate` at batch `--e2e-batches` with speculation off, and on
   with k drafts a request at every step, of which each verify step keeps a number drawn from the
   acceptance above (`ForcedAcceptance`, `--e2e-drafts forced`, the default): the real verify
   steps, graphs, bookkeeping and KV writes run, only which tokens are kept is forced. Dummy
   weights need that: on an H200 their logits were so flat that a replay of the off run's greedy
   output (`ReplayProposer`, `--e2e-drafts replay`, for weights whose greedy runs repeat) had its
   first draft rejected every time (mean accepted length 1.0 against 3.82 injected) and no output
   equal to the off run's, a verify step summing in another order than a decode step. Per-token
   latency is the time of `--e2e-tokens` + 1 output tokens less that of 1, over `--e2e-tokens` (the
   prompt's prefill taken out); the acceptance the engine counted is reported beside the one
   injected.

Prints a table; writes spec_gpu.json under `--out`/<GPU name>/spec_decode/ (default
benchmark/results/local/; "cpu" names the folder of a CPU run).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmark import LOCAL_RESULTS

PAGE = 16


class ReplayProposer:
    """Drafts for a request from the recorded greedy output of its prompt, with a miss injected.

    `recorded` maps a prompt (its token ids) to the output greedy decoding gave it with speculation
    off. For each proposal, the number of drafts that will match is drawn so that the draft at
    position i (0-based) matches with probability `acceptance[i]` overall (the share of drafts
    accepted at that position, as the engine reports it): the drafts after it are the recorded
    tokens, the one at the miss another token. Deterministic for a seed and the request's position.
    """

    def __init__(self, recorded: dict[tuple[int, ...], list[int]], acceptance: Sequence[float], vocab_size: int,
                 seed: int = 0) -> None:
        self.recorded = recorded
        self.acceptance = list(acceptance)
        self.vocab_size = vocab_size
        self.seed = seed
        self.prompt_lens = sorted({len(p) for p in recorded})

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The engine's proposer call: `token_ids` are the request's prompt and outputs so far."""
        for n in self.prompt_lens:
            output = self.recorded.get(tuple(token_ids[:n]))
            if output is not None:
                break
        else:
            return []
        done = len(token_ids) - n
        drafts = list(output[done : done + k])
        if not drafts:
            return []
        rng = random.Random(hash((self.seed, n, done, tuple(token_ids[n - 8 : n]))))
        draw = rng.random()
        matched = sum(draw < a for a in self.acceptance[: len(drafts)])  # acceptance falls with position
        if matched < len(drafts):
            drafts[matched] = (drafts[matched] + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return drafts


class EveryStepProposer:
    """Benchmark-only: k draft tokens for every decoding request at every step (its last token
    repeated), so that every verify step is uniform (k drafts a row) and replays its graph."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [int(token_ids[-1])] * k if len(token_ids) and k > 0 else []


class ForcedAcceptance:
    """Benchmark-only: each verify step keeps, per row, a number of its drafts drawn at the given
    acceptance per position (the draft at position i kept with probability `acceptance[i]`
    overall), whatever the target's logits say, then one more token (the target's first). The real
    verification runs first, so its cost counts; only the tokens kept are forced. Dummy weights
    make this necessary: their logits are so flat that a verify step and a decode step, which sum
    in other orders, pick different greedy tokens (a replayed run diverges at once)."""

    def __init__(self, acceptance: Sequence[float], seed: int = 0) -> None:
        self.acceptance = list(acceptance)
        self.rng = random.Random(seed)

    def kept(self, num_drafts: int) -> int:
        draw = self.rng.random()
        return min(num_drafts, sum(draw < a for a in self.acceptance))

    def __call__(self, real: Callable[..., Any], sampler: Any, logits: Any, rows: Sequence[Any], bitmask: Any = None) -> Any:
        from flashserve.engine.outputs import SampledTokens
        from flashserve.sample.rejection import drafts_of

        results = real(sampler, logits, rows, bitmask)
        forced = []
        for row, result in zip(rows, results):
            drafts = drafts_of(row)
            if not drafts or not result.token_ids:
                forced.append(result)
                continue
            forced.append(SampledTokens(drafts[: self.kept(len(drafts))] + [result.token_ids[0]]))
        return forced


def acceptance_from(source: Sequence[str], k: int) -> tuple[list[float], str]:
    """The shares accepted at each draft position: numbers given, or a spec_bench.json's n-gram row of k."""
    if len(source) == 1 and not re.fullmatch(r"[0-9.]+", source[0]):
        doc = json.loads(Path(source[0]).read_text())
        rows = [r for r in doc["rows"] if r["config"] == f"ngram k={k}"] or [r for r in doc["rows"] if r["acceptance_per_position"]]
        if not rows:
            raise ValueError(f"{source[0]} has no acceptance per position")
        per_pos = rows[0]["acceptance_per_position"]
        return (per_pos + [0.0] * k)[:k], f"{source[0]}: {rows[0]['config']}"
    values = [float(v) for v in source]
    if sorted(values, reverse=True) != values or not all(0 <= v <= 1 for v in values):
        raise ValueError("acceptance per position: shares in [0, 1], falling with the position")
    return (values + [0.0] * k)[:k], "given"


def decode_rows(runner: Any, name: str, batch: int, kv_len: int, first_page: int, draft: int = 0) -> tuple[Any, int]:
    """Rows of `batch` requests at `kv_len` cached tokens, new in the runner's batch now, and the
    step that continues them (diff rows: 1 + `draft` tokens each, `draft` of them draft tokens),
    repeatable: every replay writes the same positions. Returns the step and the next free page."""
    from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
    from flashserve.message.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0)
    per = (kv_len + 1 + draft + PAGE - 1) // PAGE
    new = [ScheduledRequest(f"{name}{i}", [1], kv_len, list(range(first_page + i * per, first_page + (i + 1) * per)),
                            True, params, [1] * kv_len, [1]) for i in range(batch)]  # fmt: skip
    runner.forward(SchedulerOutput(new))
    step = SchedulerOutput([ScheduledRequest(f"{name}{i}", [1] * (1 + draft), kv_len, (), True, num_draft_tokens=draft)
                            for i in range(batch)])  # fmt: skip
    return step, first_page + batch * per


def drop_rows(runner: Any, step: Any) -> None:
    from flashserve.engine.outputs import SchedulerOutput

    runner.batch.update(SchedulerOutput([], finished_ids=[r.request_id for r in step.requests]))


def time_ms(fn: Callable[[], Any], device: str, steps: int, warmup: int = 5) -> float:
    """Median ms of `fn`: CUDA events around each call on a GPU, the host's clock on a CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step_times(llm: Any, batches: Sequence[int], kv_len: int, k: int, device: str, steps: int) -> list[dict[str, Any]]:
    """Per batch: the decode step and (k > 0) the verify step of k draft tokens, in ms."""
    runner = llm.engine.executor
    rows = []
    for b in batches:
        decode, page = decode_rows(runner, "d", b, kv_len, 1)
        row: dict[str, Any] = {"batch": b, "kv_len": kv_len,
                               "decode_ms": time_ms(lambda: runner.forward(decode), device, steps)}
        drop_rows(runner, decode)
        if k:
            verify, _ = decode_rows(runner, "v", b, kv_len, page, draft=k)
            row["verify_ms"] = time_ms(lambda: runner.forward(verify), device, steps)
            row["verify_over_decode"] = row["verify_ms"] / row["decode_ms"]
            drop_rows(runner, verify)
        rows.append(row)
    return rows


def implied(rows: list[dict[str, Any]], draft_rows: list[dict[str, Any]] | None, acceptance: list[float],
            k: int) -> None:
    """Adds to each row the per-token latency its steps imply at `acceptance`: a verified step
    yields 1 + sum(acceptance) tokens."""
    mean_length = 1 + sum(acceptance[:k])
    draft_ms = {r["batch"]: r["decode_ms"] for r in draft_rows or []}
    for row in rows:
        row["mean_accepted_length"] = mean_length
        row["ngram_ms_per_token"] = row["verify_ms"] / mean_length
        row["ngram_over_decode"] = row["ngram_ms_per_token"] / row["decode_ms"]
        if row["batch"] in draft_ms:
            row["draft_decode_ms"] = draft_ms[row["batch"]]
            row["draft_model_ms_per_token"] = (row["verify_ms"] + k * draft_ms[row["batch"]]) / mean_length
            row["draft_model_over_decode"] = row["draft_model_ms_per_token"] / row["decode_ms"]


def spec_counts(llm: Any) -> tuple[int, int, int]:
    stats = llm.engine.scheduler.spec_stats
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) if stats is not None else (0, 0, 0)


def per_token_ms(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """ms per output token of `prompts` run together: the time of `tokens` + 1 tokens less that of
    1, over `tokens`; and the outputs of the longer run."""
    from flashserve.message.sampling_params import SamplingParams

    def run(n: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0, [list(o.token_ids) for o in outs]

    one, _ = run(1)
    many, outputs = run(tokens + 1)
    return (many - one) / tokens * 1e3, outputs


def end_to_end(args: argparse.Namespace, acceptance: list[float], build: Callable[..., Any]) -> list[dict[str, Any]]:
    """Per batch of `--e2e-batches`: per-token latency with speculation off, then on, `--repeat`
    times each in turn (the best kept). On: drafts from `EveryStepProposer`, kept at the given
    acceptance by `ForcedAcceptance` (`--e2e-drafts forced`), or replayed from the off run's greedy
    output with misses injected (`replay`: for real weights, whose greedy runs repeat)."""
    import flashserve.worker.runner as runner_module

    off = build(None)
    on = build({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 1,
                "min_acceptance_rate": 0.0})  # fmt: skip
    scheduler = on.engine.scheduler
    if getattr(getattr(scheduler, "speculator", None), "proposer", None) is None:
        raise RuntimeError("the scheduler has no speculator.proposer to replace")
    forced = args.e2e_drafts == "forced"
    if forced:
        scheduler.speculator.proposer = EveryStepProposer()
    vocab = off.stack.loaded.vocab_size
    rng = random.Random(args.seed)
    real_verify = runner_module.verify_step
    rows = []
    for b in args.e2e_batches:
        prompts = [[rng.randrange(1000, vocab - 1) for _ in range(args.kv_len)] for _ in range(b)]
        off_ms, recorded = [], None
        on_ms = []
        counts = []
        for _ in range(args.repeat):
            ms, outputs = per_token_ms(off, prompts, args.e2e_tokens)
            off_ms.append(ms)
            if recorded is None and not forced:
                recorded = {tuple(p): o for p, o in zip(prompts, outputs)}
                scheduler.speculator.proposer = ReplayProposer(recorded, acceptance, vocab, args.seed)
            before = spec_counts(on)
            if forced:
                runner_module.verify_step = functools.partial(ForcedAcceptance(acceptance, args.seed), real_verify)
            try:
                ms, spec_outputs = per_token_ms(on, prompts, args.e2e_tokens)
            finally:
                runner_module.verify_step = real_verify
            on_ms.append(ms)
            after = spec_counts(on)
            counts.append([a - c for a, c in zip(after, before)])
        drafts, draft_tokens, accepted = (sum(c[i] for c in counts) for i in range(3))
        identical = "forced" if forced else f"{sum(a == b for a, b in zip(spec_outputs, outputs))}/{b}"
        rows.append({"batch": b, "prompt_len": args.kv_len, "tokens": args.e2e_tokens, "drafts": args.e2e_drafts,
                     "off_ms_per_token": min(off_ms), "on_ms_per_token": min(on_ms),
                     "on_over_off": min(on_ms) / min(off_ms),
                     "off_tokens_per_s": b / min(off_ms) * 1e3, "on_tokens_per_s": b / min(on_ms) * 1e3,
                     "injected_mean_accepted_length": 1 + sum(acceptance),
                     "measured_mean_accepted_length": 1 + accepted / drafts if drafts else None,
                     "measured_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                     "identical_outputs": identical})  # fmt: skip
        print(f"  e2e batch {b}: off {min(off_ms):.2f} ms/token, on {min(on_ms):.2f} ms/token "
              f"({min(on_ms) / min(off_ms):.2f}x), mean accepted length {rows[-1]['measured_mean_accepted_length']}",
              flush=True)
    for llm in (off, on):
        llm.close()
    return rows


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.spec_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="a dummy shape or config.json (dummy weights)")
    p.add_argument("--draft-model", default="llama-3.2-1b", help="the draft's shape ('' for none)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--k", type=int, default=4, help="draft tokens per verify step")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--kv-len", type=int, default=512, help="cached tokens a request (and the end-to-end prompts' length)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--acceptance", nargs="+", required=True,
                   help="a spec_bench.json (its n-gram row of k; the committed CPU run's is named above) or the "
                        "shares accepted at each draft position")
    p.add_argument("--e2e-batches", type=int, nargs="*", default=[1, 64])
    p.add_argument("--e2e-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=2, help="end-to-end runs of each, in turn (the best kept)")
    p.add_argument("--e2e-drafts", choices=("forced", "replay"), default="forced",
                   help="forced: drafts kept at the acceptance whatever the logits (dummy weights); replay: the "
                        "off run's greedy output replayed with misses injected (weights whose greedy runs repeat)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each engine's KV share of the free memory")
    p.add_argument("--out", type=Path, default=LOCAL_RESULTS)
    args = p.parse_args(argv)

    import torch

    from benchmark.batchllm_bench import free_device
    from flashserve.entrypoints.llm import LLM

    acceptance, acceptance_source = acceptance_from(args.acceptance, args.k)
    largest = max(args.batches + args.e2e_batches)

    def build(speculative: dict[str, Any] | None, model: str = args.model) -> Any:
        # No prefix caching: the end-to-end runs send the same prompts twice (1 token, then many)
        # and take the difference, which a cached prefill would shrink.
        kwargs: dict[str, Any] = {"load_format": "dummy", "device": args.device, "max_num_seqs": max(2 * largest, 64),
                                  "enable_prefix_caching": False}
        if args.device == "cuda":
            kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
        else:
            kwargs["cpu_kv_cache_gb"] = 0.5
        if speculative is not None:
            kwargs["speculative_config"] = speculative
        return LLM(model, **kwargs)

    gpu = device_name(args.device)
    doc: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__, "model": args.model, "draft_model": args.draft_model,
                           "weights": "dummy: acceptance comes from the CPU run, not from these weights",
                           "k": args.k, "acceptance_per_position": acceptance, "acceptance_source": acceptance_source}
    print(f"{gpu}: {args.model} (dummy weights), k = {args.k}, KV of {args.kv_len} tokens a request; acceptance "
          f"{' '.join(f'{a:.2f}' for a in acceptance)} ({acceptance_source})", flush=True)
    path = args.out / re.sub(r"[^A-Za-z0-9._-]+", "_", gpu) / "spec_decode" / "spec_gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def section(name: str, fn: Callable[[], Any]) -> Any:
        """Runs one part; a failure is written down and the next part runs."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - the other parts still measure
            traceback.print_exc()
            doc.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:1000]
            return None
        finally:
            free_device()
            path.write_text(json.dumps(doc, indent=1) + "\n")

    def steps_of(model: str, k: int) -> list[dict[str, Any]]:
        # With k > 0 the engine is built for speculation, so that it captures its verify graphs
        # (the n-gram proposer never runs here: the steps are made by hand).
        llm = build({"method": "ngram", "num_speculative_tokens": k} if k else None, model)
        try:
            if model == args.model:
                doc["decode_graphs"] = llm.engine.executor.graphs is not None
                doc["verify_graphs"] = getattr(llm.engine.executor, "verify_graphs", None) is not None
            return step_times(llm, args.batches, args.kv_len, k, args.device, args.steps)
        finally:
            llm.close()

    doc["steps"] = section("steps", lambda: steps_of(args.model, args.k))
    draft_rows = section("draft_steps", lambda: steps_of(args.draft_model, 0)) if args.draft_model else None
    if doc["steps"]:
        implied(doc["steps"], draft_rows, acceptance, args.k)
    if args.e2e_batches:
        doc["end_to_end"] = section("end_to_end", lambda: end_to_end(args, acceptance, build))
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    print(f"-> {path}")
    return 0


def table(doc: dict[str, Any]) -> str:
    def num(v: float | None, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    lines = [f"mean accepted length at this acceptance: {1 + sum(doc['acceptance_per_position']):.2f} (k = {doc['k']})",
             "| batch | decode ms | verify ms (k+1 tokens) | verify / decode | draft step ms | n-gram ms/token (x decode) "
             "| draft model ms/token (x decode) |", "|---" * 7 + "|"]
    for r in doc["steps"] or []:
        lines.append(f"| {r['batch']} | {r['decode_ms']:.3f} | {r['verify_ms']:.3f} | {r['verify_over_decode']:.2f}x "
                     f"| {num(r.get('draft_decode_ms'))} | {r['ngram_ms_per_token']:.3f} ({r['ngram_over_decode']:.2f}x) "
                     f"| {num(r.get('draft_model_ms_per_token'))} ({num(r.get('draft_model_over_decode'), '.2f')}x) |")
    if doc.get("end_to_end"):
        lines += ["", "| batch | off ms/token | on ms/token | on / off | tokens/s off -> on "
                  "| mean accepted length injected / measured | identical outputs |", "|---" * 7 + "|"]
        for r in doc["end_to_end"]:
            lines.append(f"| {r['batch']} | {r['off_ms_per_token']:.3f} | {r['on_ms_per_token']:.3f} | {r['on_over_off']:.2f}x "
                         f"| {r['off_tokens_per_s']:.0f} -> {r['on_tokens_per_s']:.0f} "
                         f"| {r['injected_mean_accepted_length']:.2f} / {num(r['measured_mean_accepted_length'], '.2f')} "
                         f"| {r['identical_outputs']} |")
    for name, error in doc.get("errors", {}).items():
        lines.append(f"{name} failed: {error}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
