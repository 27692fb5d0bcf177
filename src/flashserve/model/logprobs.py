"""Logprobs of chosen tokens and the most likely tokens at their positions, and grammar masks.

Both run on the logits' device in one batched pass and cost nothing for a step whose requests did
not ask: the runner calls them only with the rows that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashserve.engine.grammar import TokenBitmask
from flashserve.engine.outputs import TokenLogprob


@dataclass
class PendingLogprobs:
    """Logprobs computed on the device, not yet copied to the host."""

    chosen: torch.Tensor  # [N] the chosen tokens' logprobs
    top_ids: torch.Tensor  # [N, k]
    top_logprobs: torch.Tensor  # [N, k]

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


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """In place: tokens a row's grammar does not allow get -inf (`mask.rows` index `logits`' rows).
    Unpacked on the logits' device, after one upload of the packed words."""
    device = logits.device
    vocab = logits.shape[1]
    words = torch.from_numpy(mask.array())
    rows = torch.tensor(mask.rows, dtype=torch.long)
    if device.type != "cpu":
        words = words.pin_memory().to(device, non_blocking=True)
        rows = rows.pin_memory().to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # logits wider than the mask's vocabulary: the rest is not allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    selected = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, selected)
