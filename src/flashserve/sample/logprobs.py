"""Logprobs of chosen tokens and the most likely tokens at their positions, and grammar masks.

Both run on the logits' device in one batched pass and cost nothing for a step whose requests did
not ask: the runner calls them only with the rows that need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashserve.message.outputs import TokenLogprob
from flashserve.pinned_staging import PinnedStaging
from flashserve.structured.grammar import TokenBitmask

if TYPE_CHECKING:
    from flashserve.worker.input_batch import BatchRow


@dataclass
class PendingLogprobs:
    """Logprobs computed on the device, not yet copied to the host."""

    chosen: torch.Tensor  # [N] the chosen tokens' logprobs
    top_ids: torch.Tensor  # [N, k]
    top_logprobs: torch.Tensor  # [N, k]

    def to_cpu(self) -> PendingLogprobs:
        """Copies to the host enqueued on the device's stream (a CUDA event tells when they are
        there; `ModelRunner.launch` records one after them)."""
        return PendingLogprobs(*(t.to("cpu", non_blocking=True) for t in (self.chosen, self.top_ids,
                                                                         self.top_logprobs)))

    def to_host(self, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
        """One TokenLogprob per row: `token_ids[i]` with its logprob and the row's first
        `num_top[i]` top tokens."""
        chosen = self.chosen.tolist()
        top_ids = self.top_ids.tolist()
        top_lp = self.top_logprobs.tolist()
        return [
            TokenLogprob(t, lp, tuple(zip(ids[:k], lps[:k])))
            for t, lp, ids, lps, k in zip(token_ids, chosen, top_ids, top_lp, num_top)
        ]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> PendingLogprobs:
    """`logits` [N, V] (raw, any float dtype), `token_ids` [N] on the same device: the log-softmax
    in float32, each row's chosen token's entry, and its `num_top` largest entries."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1).long()).squeeze(1)
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    empty = logprobs.new_empty((logits.shape[0], 0))
    return PendingLogprobs(
        chosen,
        top.indices if top is not None else empty.long(),
        top.values if top is not None else empty,
    )


@dataclass
class PromptLogprobs:
    """A step's prompt logprobs: every token of a chunk whose next token is also in the prompt
    gives the logprob of that next token, for the requests that ask."""

    rows: list[int] = field(default_factory=list)  # indices into the step's tokens
    targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (request index, rows, top tokens)
    pending: PendingLogprobs | None = None

    @classmethod
    def plan(cls, requests: Sequence[BatchRow]) -> PromptLogprobs | None:
        """None when no request of the step asks (the usual case)."""
        plan: PromptLogprobs | None = None
        offset = 0
        for i, r in enumerate(requests):
            top = r.params.prompt_logprobs
            end = min(r.kv_len, len(r.prompt_token_ids) - 1)  # positions whose next token is in the prompt
            if top is not None and end > r.num_computed_tokens:
                plan = plan or cls()
                count = end - r.num_computed_tokens
                plan.rows.extend(range(offset, offset + count))
                plan.targets.extend(r.prompt_token_ids[r.num_computed_tokens + 1 : end + 1])
                plan.spans.append((i, count, top))
            offset += r.num_new_tokens
        return plan

    def compute(self, logits: torch.Tensor) -> None:
        """`logits` [len(rows), V], the rows' logits in order; stays on the device."""
        targets = torch.tensor(self.targets, dtype=torch.long).to(logits.device, non_blocking=True)
        self.pending = compute_logprobs(logits, targets, max(k for _, _, k in self.spans))

    def to_host(self) -> dict[int, list[TokenLogprob]]:
        """Request index -> its chunk's entries (waits for the device)."""
        assert self.pending is not None
        entries = self.pending.to_host(self.targets, [k for _, count, k in self.spans for _ in range(count)])
        out: dict[int, list[TokenLogprob]] = {}
        start = 0
        for i, count, _ in self.spans:
            out[i] = entries[start : start + count]
            start += count
        return out


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask, staging: PinnedStaging | None = None) -> None:
    """In place: tokens a row's grammar does not allow get -inf (`mask.rows` index `logits`' rows).
    Unpacked on the logits' device, after one upload of the packed words and the rows through
    `staging` (not needed on the CPU)."""
    device = logits.device
    vocab = logits.shape[1]
    packed = mask.array()
    if device.type == "cpu":
        words, rows = torch.from_numpy(packed), torch.tensor(mask.rows, dtype=torch.long)
    else:
        if staging is None:
            raise ValueError("a mask for a GPU's logits goes up through a PinnedStaging")
        staging.begin()
        _, (flat, rows) = staging.upload([packed.reshape(-1), mask.rows])
        staging.end()
        words, rows = flat.view(packed.shape), rows.long()
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # logits wider than the mask's vocabulary: the rest is not allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    selected = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, selected)
