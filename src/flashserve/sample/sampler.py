"""Batched token sampling in plain PyTorch: penalties, min_tokens, temperature, top-k/top-p/min-p.

Every row of the batch carries its own parameters; they become per-row tensors so that one pass
serves the whole batch. The logits never leave their device: the only host sync is the final
`.tolist()`. Works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

import torch

from flashserve.message.sampling_params import SamplingParams
from flashserve.pinned_staging import PinnedStaging
from flashserve.sample.logprobs import apply_token_bitmask
from flashserve.structured.grammar import TokenBitmask

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: spreads nearby inputs (seed, seed + 1, ...) over all 64 bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request at output position `step` (a pure function, so
    the same request draws the same noise alone, in any batch, and after a recompute)."""
    return _mix64(_mix64(seed & _MASK64) ^ step)


def _to_device(data: Sequence[float] | Sequence[int] | torch.Tensor, device: torch.device,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data -> device without a host sync: staged in pinned memory and queued on the
    stream (a plain copy from pageable memory would wait for the stream to drain)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class SamplingRow(Protocol):
    """What the sampler reads of a row (`input_batch.BatchRow`): its parameters, its token
    history for penalties and its output count for min_tokens and per-token seeds."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]

    @property
    def num_prior_outputs(self) -> int: ...


def apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> None:
    """In place on `logits` [B, V]: HF's repetition penalty over prompt + output tokens, then
    OpenAI's frequency and presence penalties over output tokens. The rows' histories are int32
    arrays kept by the input batch, so this costs a memcpy per row, not a conversion of ints."""
    batch, vocab = logits.shape
    device = logits.device
    rep_rows = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        seen = _token_counts(
            [(requests[i].prompt_token_ids, requests[i].output_token_ids) for i in rep_rows], rep_rows, batch, vocab, device
        ) > 0
        penalty = _to_device([r.params.repetition_penalty for r in requests], device).unsqueeze(1)
        # Dividing a negative logit would raise it: shrink both signs towards "less likely".
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    out_rows = [
        i for i, r in enumerate(requests)
        if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if out_rows:
        counts = _token_counts(
            [(requests[i].output_token_ids,) for i in out_rows], out_rows, batch, vocab, device
        )
        freq_pres = _to_device(
            [(r.params.frequency_penalty, r.params.presence_penalty) for r in requests], device
        )
        logits -= freq_pres[:, :1] * counts
        logits -= freq_pres[:, 1:] * (counts > 0).to(logits.dtype)


def _token_counts(
    token_arrays: Sequence[Sequence[Sequence[int]]], rows: list[int], batch: int, vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """[B, V] float32 occurrence counts; row rows[j] counts the ids of all arrays in
    token_arrays[j], the other rows stay zero."""
    flat = array("i")
    lengths = []
    for arrays in token_arrays:
        start = len(flat)
        for ids in arrays:
            flat.extend(ids)
        lengths.append(len(flat) - start)
    tokens_cpu = torch.frombuffer(flat, dtype=torch.int32) if flat else torch.empty(0, dtype=torch.int32)
    tokens = _to_device(tokens_cpu, device)
    rows_lengths = _to_device([rows, lengths], device)
    # output_size: the total is known here, and repeat_interleave would sync to learn it.
    row_ids = torch.repeat_interleave(rows_lengths[0], rows_lengths[1], output_size=len(flat))
    # Flat indices into a [B, V + 1] table: ids past the model's vocab (a tokenizer larger than
    # the embedding) land in the spare last column, which is cut off.
    flat_idx = row_ids * (vocab + 1) + tokens.long().clamp_(0, vocab)
    counts = torch.zeros(batch * (vocab + 1), dtype=torch.float32, device=device)
    # index_add_ (atomics) rather than index_put_(accumulate=True), which sorts the indices.
    counts.index_add_(0, flat_idx, torch.ones(flat_idx.numel(), device=device))
    return counts.view(batch, vocab + 1)[:, :vocab]


def apply_min_tokens(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> None:
    """In place: until a request has min_tokens outputs, its EOS (unless ignore_eos) and stop
    token ids get -inf, so that it cannot end early."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        if r.num_prior_outputs >= r.params.min_tokens:
            continue
        banned = set(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            banned.update(r.params.eos_token_ids)
        for t in sorted(banned):
            if t < vocab:
                rows.append(i)
                cols.append(t)
    if rows:
        # index_fill_ on the flat view: `logits[rows, cols] = x` copies x to the device and syncs.
        flat_idx = _to_device([r * vocab + c for r, c in zip(rows, cols)], logits.device)
        logits.view(-1).index_fill_(0, flat_idx, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> None:
    """In place: each request's logit_bias added to its row (OpenAI's logit_bias; -100 bans a
    token in practice, +100 all but forces it)."""
    vocab = logits.shape[1]
    index: list[int] = []
    bias: list[float] = []
    for i, r in enumerate(requests):
        for token, value in r.params.logit_bias:
            index.append(i * vocab + token)
            bias.append(value)
    if index:
        # One upload for each list; index_add_ accumulates, so a repeated id adds up as in OpenAI.
        logits.view(-1).index_add_(0, _to_device(index, logits.device),
                                   _to_device(bias, logits.device, torch.float32))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks to -inf what top-k and then top-p drop; returns a new [B, V] tensor.

    `top_k` [B] long in [1, V] (V disables it); `top_p` [B] float in (0, 1] (1 disables it).
    Top-p keeps the smallest set of most likely tokens whose probability reaches p, and always
    the most likely token. Tokens tied with the k-th largest logit are kept too.
    """
    # Ascending sort, as in vLLM/HF: the tokens to drop form a prefix of each row.
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if top_k is not None:
        kth = logits_sort.gather(1, (vocab - top_k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if top_p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when it and all smaller ones together hold at most 1 - p of the mass.
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        logits_sort.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p [B] times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    """Turns a step's logits into one token id per request.

    Order, as in vLLM: penalties and min_tokens, then greedy rows take the argmax; the other rows
    are divided by their temperature, filtered by top-k, top-p and min-p, and sampled with the
    exponential race (argmax of probs / Exponential(1) noise, equivalent to a multinomial draw).
    A seeded request draws its noise from a generator seeded by (seed, output length), so its
    tokens do not depend on the batch; unseeded rows share the sampler's own generator.
    """

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._staging: PinnedStaging | None = None  # grammar masks' uploads, on a GPU

    def _mask_staging(self, device: torch.device) -> PinnedStaging | None:
        if device.type == "cpu":
            return None
        if self._staging is None or self._staging.device != device:
            self._staging = PinnedStaging(device, capacity=1 << 20)
        return self._staging

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def sample(self, logits: torch.Tensor, requests: Sequence[SamplingRow],
               bitmask: TokenBitmask | None = None) -> list[int]:
        """`logits` [B, V] (float32), row i for requests[i]; returns B token ids. `bitmask`: the
        tokens that rows following a grammar may take (applied after penalties and bias)."""
        return self.sample_ids(logits, requests, bitmask).tolist()

    def sample_ids(self, logits: torch.Tensor, requests: Sequence[SamplingRow],
                   bitmask: TokenBitmask | None = None) -> torch.Tensor:
        """As `sample`, but the ids stay on the logits' device ([B] int64), not synchronised: the
        host may do other work while the device computes them."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(requests)} requests")
        if not requests:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        processed = self.processed_logits(logits, requests, bitmask)
        if all(r.params.greedy for r in requests):
            return processed.argmax(dim=-1)
        if processed is logits:  # the random draw works in place: the caller's logits stay untouched
            processed = logits.to(torch.float32, copy=True)
        return self._sample_random(processed, requests)

    def processed_logits(self, logits: torch.Tensor, requests: Sequence[SamplingRow],
                         bitmask: TokenBitmask | None = None) -> torch.Tensor:
        """`logits` [B, V] after logit_bias, penalties, min_tokens and the grammar masks: a float32
        copy, or the caller's tensor itself when no row needs any of them (do not write to it)."""
        needs_min_tokens = any(r.num_prior_outputs < r.params.min_tokens for r in requests)
        needs_penalties = any(r.params.needs_penalties for r in requests)
        needs_bias = any(r.params.logit_bias for r in requests)
        if not needs_penalties and not needs_min_tokens and not needs_bias and bitmask is None:
            return logits
        # A float32 copy: the caller's logits stay untouched.
        logits = logits.to(torch.float32, copy=True)
        if needs_bias:
            apply_logit_bias(logits, requests)
        if needs_penalties:
            apply_penalties(logits, requests)
        if needs_min_tokens:
            apply_min_tokens(logits, requests)
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask, self._mask_staging(logits.device))
        return logits

    def filtered_probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from, [B, V] float32: `logits` (processed, float32,
        overwritten) divided by the row's temperature (1 for a greedy row), then top-k, top-p and
        min-p, softmaxed."""
        device = logits.device
        vocab = logits.shape[1]
        # One host -> device copy for every per-row parameter.
        rows = _to_device(
            [
                (1.0 if p.greedy else p.temperature, p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p)
                for p in params
            ],
            device,
        )
        logits.div_(rows[:, 0:1])
        use_k = any(0 < p.top_k < vocab for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        if use_k or use_p:
            top_k = rows[:, 1].long() if use_k else None
            logits = apply_top_k_top_p(logits, top_k, rows[:, 2] if use_p else None)
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(logits, rows[:, 3])
        return logits.softmax(dim=-1)

    def _sample_random(
        self, logits: torch.Tensor, requests: Sequence[SamplingRow]
    ) -> torch.Tensor:
        device = logits.device
        params = [r.params for r in requests]
        greedy = [p.greedy for p in params]
        # Greedy rows' samples are replaced by the argmax of the unscaled logits below.
        greedy_ids = logits.argmax(dim=-1) if any(greedy) else None
        probs = self.filtered_probs(logits, params)
        noise = torch.ones_like(probs)
        if not all(p.seed is not None or p.greedy for p in params):
            noise.exponential_(generator=self._generator(device))
        for i, r in enumerate(requests):
            if r.params.seed is not None and not greedy[i]:
                gen = torch.Generator(device=device)
                gen.manual_seed(step_seed(r.params.seed, r.num_prior_outputs))
                noise[i].exponential_(generator=gen)
        # A zero draw would make 0/0 = nan for a masked token, and argmax picks nan.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        sampled = probs.div_(noise).argmax(dim=-1)
        if greedy_ids is not None:
            is_greedy = _to_device([float(g) for g in greedy], device)
            sampled = torch.where(is_greedy > 0, greedy_ids, sampled)
        return sampled
