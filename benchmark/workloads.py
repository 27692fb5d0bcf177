"""The workloads of PERFORMANCE.md, generated from fixed seeds.

Every generator returns plain `BenchRequest`s, so the same prompts can be sent over HTTP
(`benchmark.serve_bench`) or handed to an in-process offline runner. Token-id prompts have exact
lengths; text prompts are runs of common English words (about one token per word in the usual BPE
vocabularies), so their real length is whatever the server reports in `usage.prompt_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np

PromptKind = Literal["token_ids", "text"]
# How a workload's "+-r" is drawn: "centered" is [len * (1 - r), len * (1 + r)] (PERFORMANCE.md's
# workloads, vLLM's bench); "sglang" is [len * (1 - r), len], as SGLang's bench_serving draws lengths
# for --random-range-ratio 1 - r (its figures, e.g. "2048/256 x0.75", use this).
LengthRange = Literal["centered", "sglang"]
LENGTH_RANGES: tuple[str, ...] = ("centered", "sglang")


def sglang_range(range_ratio: float) -> tuple[float, LengthRange]:
    """The (r, lengths) that draw as SGLang's `--random-range-ratio range_ratio` does: uniform in
    [len * range_ratio, len]. The seed protocol's 0.25 gives inputs in [512, 2048], outputs in [64, 256]."""
    if not 0 < range_ratio <= 1:
        raise ValueError(f"range ratio {range_ratio} is outside (0, 1]")
    return 1 - range_ratio, "sglang"
WORKLOAD_NAMES: tuple[str, ...] = ("latency", "random", "goodput", "concurrency", "offline", "shared_prefix",
                                   "max_throughput")

# Words that are a single token (with their leading space) in the Llama, GPT and SmolLM vocabularies.
COMMON_WORDS: tuple[str, ...] = tuple(
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their has been if more when will would "
    "who so no time people year way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program question work "
    "number night point home water room mother area money story fact month lot right study book".split()
)
CHAT_PROMPT = "Write a long story about a lighthouse keeper who finds a door at the bottom of the sea."


@dataclass(frozen=True)
class BenchRequest:
    """One request. `prompt` is token ids or text; lengths are in tokens."""

    prompt: str | list[int]
    prompt_len: int  # exact for token ids, approximate for text
    output_len: int  # sent as max_tokens, with ignore_eos


@dataclass(frozen=True)
class Phase:
    """One measured run of a workload: its requests and how they are offered to the server.

    `concurrency` caps the streams in flight; `request_rate` (req/s) spaces arrivals (Poisson unless
    the run says otherwise); neither means all at once. `rounds` > 1 splits the requests into that
    many equal batches sent one after another (the latency workload's repeated batches).
    """

    name: str
    requests: list[BenchRequest]
    concurrency: int | None = None
    request_rate: float | None = None
    rounds: int = 1


@dataclass(frozen=True)
class PromptSpec:
    """How prompts are made. `tokenizer` (optional, with `encode`/`decode`) makes text lengths exact."""

    kind: PromptKind = "token_ids"
    token_id_low: int = 100  # inclusive; above the special tokens of common vocabularies
    token_id_high: int = 10_000  # exclusive; inside every common vocabulary
    tokenizer: Any = None


def make_prompt(rng: np.random.Generator, length: int, spec: PromptSpec) -> tuple[str | list[int], int]:
    """A prompt of about `length` tokens and its length as far as the client knows it."""
    if spec.kind == "token_ids":
        ids = rng.integers(spec.token_id_low, spec.token_id_high, size=length)
        return [int(i) for i in ids], length
    words = rng.choice(len(COMMON_WORDS), size=length)
    text = " ".join(COMMON_WORDS[i] for i in words)
    if spec.tokenizer is not None:
        ids = spec.tokenizer.encode(text, add_special_tokens=False)[:length]
        text = spec.tokenizer.decode(ids)
        return text, len(ids)
    return text, length


def fixed_requests(num: int, input_len: int, output_len: int, spec: PromptSpec, seed: int) -> list[BenchRequest]:
    """`num` distinct prompts of `input_len` tokens, each asking for `output_len` tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        prompt, plen = make_prompt(rng, input_len, spec)
        out.append(BenchRequest(prompt, plen, output_len))
    return out


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, spec: PromptSpec, seed: int,
    lengths: LengthRange = "centered",
) -> list[BenchRequest]:
    """Lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)], inclusive; with
    `lengths="sglang"` in [len * (1 - range_ratio), len] (at least 1)."""
    if lengths not in LENGTH_RANGES:
        raise ValueError(f"unknown length range {lengths!r}; expected one of {LENGTH_RANGES}")
    top = 1.0 if lengths == "sglang" else 1 + range_ratio
    lo_hi = [(max(int(n * (1 - range_ratio)), 1), int(n * top)) for n in (input_len, output_len)]
    return uniform_requests(num, lo_hi[0], lo_hi[1], spec, seed)


def uniform_requests(
    num: int, input_range: tuple[int, int], output_range: tuple[int, int], spec: PromptSpec, seed: int
) -> list[BenchRequest]:
    """Input and output lengths drawn independently and uniformly from inclusive ranges."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_range[0], input_range[1] + 1, size=num)
    out_lens = rng.integers(output_range[0], output_range[1] + 1, size=num)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        prompt, plen = make_prompt(rng, int(n_in), spec)
        out.append(BenchRequest(prompt, plen, int(n_out)))
    return out


def chat_requests(num: int, output_len: int, spec: PromptSpec, seed: int) -> list[BenchRequest]:
    """The concurrency workload's short chat prompt (24 random ids when prompts are token ids)."""
    if spec.kind == "token_ids":
        return fixed_requests(num, 24, output_len, spec, seed)
    plen = len(CHAT_PROMPT.split()) + 2
    return [BenchRequest(CHAT_PROMPT, plen, output_len) for _ in range(num)]


def latency_phases(spec: PromptSpec, seed: int = 0, repeats: int = 5) -> list[Phase]:
    """Batch 1 (128 in / 128 out) and batch 8 (32 in / 128 out), each batch repeated `repeats` times."""
    return [
        Phase("bs1", fixed_requests(repeats, 128, 128, spec, seed), concurrency=1, rounds=repeats),
        Phase("bs8", fixed_requests(8 * repeats, 32, 128, spec, seed + 1), concurrency=8, rounds=repeats),
    ]


def random_phases(
    spec: PromptSpec,
    seed: int = 0,
    num_requests: int = 256,
    request_rates: Sequence[float] = (8.0,),
    concurrencies: Sequence[int] = (),
    lengths: LengthRange = "centered",
    range_ratio: float = 0.25,
) -> list[Phase]:
    """In 2048 +-r, out 256 +-r (r = 25% unless `range_ratio` says otherwise): one phase per request
    rate, or per concurrency if given."""
    reqs = random_requests(num_requests, 2048, 256, range_ratio, spec, seed, lengths)
    if concurrencies:
        return [Phase(f"c{c}", reqs, concurrency=c) for c in concurrencies]
    return [Phase(f"rate{r:g}", reqs, request_rate=r) for r in request_rates]


def concurrency_phases(
    spec: PromptSpec, seed: int = 0, levels: Sequence[int] = (5, 10, 25, 50, 100), repeats: int = 3
) -> list[Phase]:
    """Short chat prompt, 384 out, at each number of concurrent streams (`repeats` requests per stream)."""
    return [Phase(f"c{c}", chat_requests(c * repeats, 384, spec, seed + c), concurrency=c) for c in levels]


def offline_phases(spec: PromptSpec, seed: int = 0, num_requests: int = 256) -> list[Phase]:
    """`num_requests` x 512 in / 128 out, and `num_requests` with in/out uniform in [100, 1024]; all at once."""
    return [
        Phase("fixed512x128", fixed_requests(num_requests, 512, 128, spec, seed)),
        Phase("uniform100to1024", uniform_requests(num_requests, (100, 1024), (100, 1024), spec, seed + 1)),
    ]


def shared_prefix_requests(
    groups: int, spec: PromptSpec, seed: int = 0, per_group: int = 16, prefix_len: int = 2048,
    question_len: int = 128, output_len: int = 256,
) -> list[BenchRequest]:
    """`groups` x `per_group` prompts, each its group's `prefix_len`-token system prompt followed by
    a `question_len`-token question of its own, shuffled (SGLang's generated-shared-prefix)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        prefix, prefix_n = make_prompt(rng, prefix_len, spec)
        for _ in range(per_group):
            question, question_n = make_prompt(rng, question_len, spec)
            prompt = prefix + question if isinstance(prefix, list) else f"{prefix} {question}"  # type: ignore[operator]
            out.append(BenchRequest(prompt, prefix_n + question_n, output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def shared_prefix_phases(spec: PromptSpec, seed: int = 0, groups: Sequence[int] = (16,)) -> list[Phase]:
    """G groups x 16 prompts (2048-token group prefix + 128-token question), 256 out, all at once."""
    return [Phase(f"g{g}x16", shared_prefix_requests(g, spec, seed + g)) for g in groups]


def build_phases(
    workload: str,
    spec: PromptSpec,
    seed: int = 0,
    *,
    num_requests: int | None = None,
    request_rates: Sequence[float] = (),
    concurrencies: Sequence[int] = (),
    repeats: int | None = None,
    lengths: LengthRange = "centered",
    range_ratio: float | None = None,
) -> list[Phase]:
    """The phases of a named workload (all but `goodput`, which searches over rates instead).
    `lengths` says how the random and max_throughput workloads draw lengths around their means;
    `range_ratio`, SGLang's `--random-range-ratio`, draws the random workload's lengths as SGLang does."""
    if workload == "latency":
        return latency_phases(spec, seed, repeats or 5)
    if workload == "random":
        ratio, lengths = (0.25, lengths) if range_ratio is None else sglang_range(range_ratio)
        return random_phases(spec, seed, num_requests or 256, request_rates or (8.0,), concurrencies, lengths, ratio)
    if workload == "concurrency":
        return concurrency_phases(spec, seed, concurrencies or (5, 10, 25, 50, 100), repeats or 3)
    if workload == "offline":
        return offline_phases(spec, seed, num_requests or 256)
    if workload == "max_throughput":  # in 1024 +-50%, out 256 +-50%, all at once (SGLang bench_serving's defaults)
        reqs = random_requests(num_requests or 512, 1024, 256, 0.5, spec, seed, lengths)
        return [Phase(f"all{num_requests or 512}", reqs)]
    if workload == "shared_prefix":  # --concurrency names the group counts here
        return shared_prefix_phases(spec, seed, concurrencies or (16,))
    raise ValueError(f"unknown workload {workload!r}; expected one of {WORKLOAD_NAMES}")
