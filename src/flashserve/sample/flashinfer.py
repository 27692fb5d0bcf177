"""Token sampling on CUDA with FlashInfer's sorting-free kernels; same contract as `Sampler`.

Penalties and min_tokens run first, with the CPU sampler's own torch helpers (they work on any
device). Then greedy rows take the argmax, and the rest go through FlashInfer: a softmax with each
row's temperature, then top-k / top-p (top-k first, as the CPU sampler) or min-p by rejection
sampling. Unseeded rows share the sampler's generator in one batched call; a seeded request is
drawn alone from a generator seeded by (seed, output length), so its tokens do not depend on the
batch it lands in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashserve.message.sampling_params import SamplingParams
from flashserve.sample.sampler import Sampler, SamplingRow, _to_device, step_seed


class FlashInferSampler(Sampler):
    """`Sampler` with the random draw on FlashInfer's kernels; penalties, min_tokens, the greedy
    fast path and the generators are the base class's."""

    def __init__(self, seed: int = 0) -> None:
        import flashinfer.sampling

        super().__init__(seed)
        self._fi = flashinfer.sampling

    def _sample_random(self, logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
        """One token per row: the argmax for greedy rows, a FlashInfer draw for the others."""
        device = logits.device
        params = [r.params for r in requests]
        if any(p.greedy for p in params):
            ids = logits.argmax(dim=-1)
        else:
            ids = torch.empty(len(requests), dtype=torch.long, device=device)
        temps = _to_device([1.0 if p.greedy else p.temperature for p in params], device, torch.float32)
        probs = self._fi.softmax(logits, temperature=temps)

        unseeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is None]
        if len(unseeded) == len(params):
            ids.copy_(self._draw(probs, params, self._generator(device)))
        elif unseeded:
            rows = _to_device(unseeded, device)
            drawn = self._draw(probs.index_select(0, rows), [params[i] for i in unseeded], self._generator(device))
            ids.index_copy_(0, rows, drawn.long())
        for i, r in enumerate(requests):
            if r.params.greedy or r.params.seed is None:
                continue
            # Alone in its call: the row index enters the Philox stream, so a batch would shift it.
            gen = torch.Generator(device=device)
            gen.manual_seed(step_seed(r.params.seed, r.num_prior_outputs))
            ids[i : i + 1] = self._draw(probs[i : i + 1], [r.params], gen)
        return ids

    def _draw(self, probs: torch.Tensor, params: Sequence[SamplingParams], gen: torch.Generator) -> torch.Tensor:
        """One token per row of `probs` [N, V] under each row's top-k, top-p and min-p."""
        fi, device, vocab = self._fi, probs.device, probs.shape[1]
        use_k = any(0 < p.top_k < vocab for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        # In a batch where only some rows filter, top_k = vocab and top_p = 1 leave a row as is.
        top_k = _per_row([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device, torch.int32) if use_k else 0
        top_p = _per_row([p.top_p for p in params], device, torch.float32) if use_p else 1.0
        if use_min_p:
            # min-p is relative to the largest kept probability, so it applies after the
            # renormalising top-k and top-p filters.
            if use_k:
                probs = fi.top_k_renorm_probs(probs, top_k)
            if use_p:
                probs = fi.top_p_renorm_probs(probs, top_p)
            min_p = _per_row([p.min_p for p in params], device, torch.float32)
            return fi.min_p_sampling_from_probs(probs, min_p, generator=gen)
        if use_k and use_p:
            # What top_k_top_p_sampling_from_probs(filter_apply_order="top_k_first") does, spelled
            # out: with a scalar top_k <= 256 and a vocab >= 65536 it would switch to a radix
            # top-k kernel instead, one more module to build on first use.
            return fi.top_p_sampling_from_probs(fi.top_k_renorm_probs(probs, top_k), top_p, generator=gen)
        if use_k:
            return fi.top_k_sampling_from_probs(probs, top_k, generator=gen)
        if use_p:
            return fi.top_p_sampling_from_probs(probs, top_p, generator=gen)
        return fi.sampling_from_probs(probs, generator=gen)


def _per_row(values: list[int] | list[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor | int | float:
    """A [N] tensor of per-row values; a lone row (a seeded request) gets a scalar, which the
    kernels take as is, with no host-to-device copy."""
    return values[0] if len(values) == 1 else _to_device(values, device, dtype)


def chain_verify(probs: torch.Tensor, drafts: list[list[int]], generator: torch.Generator) -> list[list[int]]:
    """Rejection sampling of several rows' drafts in one FlashInfer call (`chain_speculative_sampling`).

    `probs` [sum(1 + k_i), V]: the target's distributions at each row's positions, in order;
    `drafts[i]`: row i's k_i n-gram drafts (one-hot draft distributions). Rows are padded to the
    longest k with drafts of token 0 and repeated target rows: a padded position's token is
    distributed as its target row whatever the draft (rejection sampling keeps the target's
    distribution for any draft), and a row keeps only its first 1 + k_i tokens.
    """
    import flashinfer.sampling

    device, vocab = probs.device, probs.shape[1]
    k = max(len(d) for d in drafts)
    rows = []
    offset = 0
    for d in drafts:
        index = [offset + min(j, len(d)) for j in range(k + 1)]
        rows.append(index)
        offset += len(d) + 1
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    target = probs.index_select(0, index.view(-1)).view(len(drafts), k + 1, vocab)
    draft_ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.int32).to(device,
                                                                                            non_blocking=True)
    draft_probs = torch.zeros(len(drafts), k, vocab, dtype=probs.dtype, device=device)
    draft_probs.scatter_(2, draft_ids.long().unsqueeze(2), 1.0)
    out = flashinfer.sampling.chain_speculative_sampling(draft_probs, draft_ids, target, generator=generator)
    if isinstance(out, tuple):  # releases that also return the acceptance counts
        out = out[0]
    result = []
    for d, tokens in zip(drafts, out.tolist()):
        kept = tokens[: len(d) + 1]
        result.append(kept[: kept.index(-1)] if -1 in kept else kept)
    return result
