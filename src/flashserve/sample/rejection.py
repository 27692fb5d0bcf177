"""Verifying draft tokens: which of a row's drafts the target model accepts, and the token it adds.

A row with k drafts has logits at k + 1 positions: position j predicts the token after the row's
last known token and drafts[:j]. Each position is processed as the sampler processes a decode row
(logit_bias, penalties and min_tokens over the output as if drafts[:j] were accepted, the
grammar's mask at that point), so that what is accepted is what plain decoding would produce:

- greedy rows accept drafts while they equal the argmax, then add the argmax at the first
  mismatch (or after the last draft): token for token the output of plain greedy decoding;
- sampled rows use rejection sampling (Leviathan et al., Chen et al.): draft j is accepted with
  probability min(1, p_j(d) / q_j(d)), and at the first rejection a token is drawn from the
  residual max(0, p_j - q_j), renormalised; after k acceptances the bonus token is drawn from
  p_k. An n-gram proposer has no distribution of its own: q_j is one-hot on its draft, so the
  rule is "accept with probability p_j(d)" and the residual is p_j without d. The output is
  distributed exactly as the target's samples.

A seeded request draws each position's acceptance and token from generators seeded by (seed,
output position), so it is reproducible whatever batch it lands in. The draws of a position
follow the sampler's exponential race (`Sampler._sample_random`), so a seeded row without drafts
gets the token plain sampling would give it.

On CUDA the unseeded sampled rows with drafts of a step go through FlashInfer's
`chain_speculative_sampling` in one call (`sample/flashinfer.py`, chain_verify); the torch path
here serves the CPU and seeded rows.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from flashserve.engine.outputs import SampledTokens, sample_error
from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.logprobs import compute_logprobs
from flashserve.sample.sampler import Sampler, step_seed
from flashserve.structured.grammar import TokenBitmask

# The acceptance draws of a seeded request use other generator seeds than its token draws.
_ACCEPT_SALT = 0x5EC_DEC0DE


@dataclass(slots=True)
class DraftPosition:
    """One position of a verified row, as the sampler reads a row (`sample.sampler.SamplingRow`)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # the row's outputs and the drafts before this position
    num_prior_outputs: int


class VerifyRow(Protocol):
    """What verifying reads of a row (`worker.input_batch.BatchRow`)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    new_token_ids: Sequence[int]
    num_draft_tokens: int

    @property
    def num_prior_outputs(self) -> int: ...


def drafts_of(row: VerifyRow) -> list[int]:
    d = row.num_draft_tokens
    return list(row.new_token_ids[len(row.new_token_ids) - d :]) if d else []


def positions(rows: Sequence[VerifyRow]) -> list[DraftPosition]:
    """The positions of the rows, in order: 1 + drafts each."""
    out: list[DraftPosition] = []
    for r in rows:
        drafts = drafts_of(r)
        for j in range(len(drafts) + 1):
            # Penalties count the drafts before the position as outputs (only they read the history).
            history = (r.output_token_ids if not j or not r.params.needs_penalties
                       else array("i", r.output_token_ids) + array("i", drafts[:j]))
            out.append(DraftPosition(r.request_id, r.params, r.prompt_token_ids, history, r.num_prior_outputs + j))
    return out


def verify(sampler: Sampler, logits: torch.Tensor, rows: Sequence[VerifyRow],
           bitmask: TokenBitmask | None = None) -> list[list[int]]:
    """`logits` [sum(1 + drafts), V] float32, the rows' positions in order; returns each row's
    tokens: its accepted drafts, then the target's own token (1 to 1 + drafts ids)."""
    pos = positions(rows)
    if logits.shape[0] != len(pos):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(pos)} positions")
    processed = sampler.processed_logits(logits, pos, bitmask)
    greedy_ids = processed.argmax(dim=-1).tolist() if any(p.params.greedy for p in pos) else []
    sampled = [i for i, p in enumerate(pos) if not p.params.greedy]
    probs = None
    if sampled:
        index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        probs = sampler.filtered_probs(processed.index_select(0, index).float(), [pos[i].params for i in sampled])
    prob_row = {i: j for j, i in enumerate(sampled)}
    chained = _chained(sampler, probs, rows) if probs is not None and probs.is_cuda else {}
    results: list[list[int]] = []
    offset = 0
    for i, r in enumerate(rows):
        drafts = drafts_of(r)
        d, params = len(drafts), r.params
        if i in chained:
            results.append(chained[i])
        elif params.greedy:
            targets = greedy_ids[offset : offset + d + 1]
            a = 0
            while a < d and drafts[a] == targets[a]:
                a += 1
            results.append(targets[: a + 1])
        else:
            assert probs is not None
            first = prob_row[offset]
            results.append(_rejection_sample(sampler, probs[first : first + d + 1], drafts, params,
                                             pos[offset].num_prior_outputs))
        offset += d + 1
    return results


def _chained(sampler: Sampler, probs: torch.Tensor, rows: Sequence[VerifyRow]) -> dict[int, list[int]]:
    """On CUDA, the unseeded sampled rows with drafts through FlashInfer in one call: row index ->
    its tokens. Seeded rows stay on the torch path (their draws depend on their seed alone)."""
    from flashserve.sample.flashinfer import FlashInferSampler, chain_verify

    if not isinstance(sampler, FlashInferSampler):
        return {}
    picked, spans, drafts = [], [], []
    first = 0  # the row's first position among the sampled rows' probabilities
    for i, r in enumerate(rows):
        n = 1 + r.num_draft_tokens
        if not r.params.greedy:
            if r.params.seed is None and r.num_draft_tokens:
                picked.append(i)
                spans.extend(range(first, first + n))
                drafts.append(drafts_of(r))
            first += n
    if not picked:
        return {}
    index = torch.tensor(spans, dtype=torch.long, device=probs.device)
    tokens = chain_verify(probs.index_select(0, index), drafts, sampler._generator(probs.device))
    return dict(zip(picked, tokens))


def _rejection_sample(sampler: Sampler, probs: torch.Tensor, drafts: list[int], params: SamplingParams,
                      num_prior_outputs: int) -> list[int]:
    """One sampled row: `probs` [k + 1, V] the target's distributions, `drafts` its k drafts."""
    device = probs.device
    k = len(drafts)
    accepted = 0
    if k:
        if params.seed is None:
            u = torch.rand(k, generator=sampler._generator(device), device=device)
        else:
            u = torch.empty(k, device=device)
            for j in range(k):
                gen = torch.Generator(device=device)
                gen.manual_seed(step_seed(params.seed ^ _ACCEPT_SALT, num_prior_outputs + j))
                u[j : j + 1].uniform_(generator=gen)
        draft_ids = torch.tensor(drafts, dtype=torch.long, device=device)
        p_draft = probs[:k].gather(1, draft_ids.unsqueeze(1)).squeeze(1)
        ok = (u < p_draft).tolist()
        while accepted < k and ok[accepted]:
            accepted += 1
    p = probs[accepted].clone()
    if accepted < k:
        p[drafts[accepted]] = 0.0  # the residual of a one-hot draft: the target without the rejected token
    noise = torch.empty_like(p)
    if params.seed is None:
        noise.exponential_(generator=sampler._generator(device))
    else:
        gen = torch.Generator(device=device)
        gen.manual_seed(step_seed(params.seed, num_prior_outputs + accepted))
        noise.exponential_(generator=gen)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    token = int(p.div_(noise).argmax())
    return drafts[:accepted] + [token]


def verify_step(sampler: Sampler, logits: torch.Tensor, rows: Sequence[VerifyRow],
                bitmask: TokenBitmask | None = None) -> list[SampledTokens]:
    """A step's sampling rows verified (`verify`), with the target's logprobs of the tokens each
    row keeps; if the batch fails, row by row, so that one bad request fails alone. Waits for the
    device: the host needs the tokens to know the next step."""
    try:
        tokens = verify(sampler, logits, rows, bitmask)
    except Exception:  # noqa: BLE001 - retried row by row below, each failing alone
        return _verify_rows(sampler, logits, rows, bitmask)
    results = []
    offset = 0
    for r, ids in zip(rows, tokens):
        top = r.params.logprobs
        lps = None
        if top is not None:
            chosen = torch.tensor(ids, dtype=torch.long, device=logits.device)
            lps = compute_logprobs(logits[offset : offset + len(ids)], chosen, top).to_host(ids, [top] * len(ids))
        results.append(SampledTokens(ids, lps))
        offset += 1 + r.num_draft_tokens
    return results


def _verify_rows(sampler: Sampler, logits: torch.Tensor, rows: Sequence[VerifyRow],
                 bitmask: TokenBitmask | None) -> list[SampledTokens]:
    results = []
    offset = 0
    for r in rows:
        n = 1 + r.num_draft_tokens
        mask = None
        if bitmask is not None:
            mine = [j for j, row in enumerate(bitmask.rows) if offset <= row < offset + n]
            if mine:
                mask = TokenBitmask([bitmask.rows[j] - offset for j in mine], bitmask.array()[mine])
        try:
            results.append(verify_step(sampler, logits[offset : offset + n], [r], mask)[0]
                           if len(rows) > 1 else SampledTokens(verify(sampler, logits, [r], mask)[0]))
        except Exception as exc:  # noqa: BLE001 - the request fails alone, with its message
            results.append(sample_error(str(exc) or type(exc).__name__))
        offset += n
    return results
