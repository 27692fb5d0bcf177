"""The draft-model method of speculative decoding: a second, smaller model with the target's
vocabulary proposes each decoding row's k draft tokens greedily, in the runner, before the target
verifies them in the same step.

The draft has KV pages of its own: a pool of as many pages as the target's, addressed by the same
page tables, so that the scheduler's pages (and the prefix cache's sharing of them) serve both
models. Every step the draft first computes the K/V of every row's known tokens (prefill chunks and
each decoding row's last token) and, from the last one's logits, its first draft; then one decode
forward per further draft, each also writing the K/V of the draft it takes. Draft K/V past what
the target accepts is overwritten by later steps, as the target's is. The scheduler reserves the
rows' draft slots (tokens 0) and rolls back the rejected ones as for n-gram drafts; the draft
tokens are written into the rows here, before the target's forward reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flashserve.attention.base import BatchLayout
from flashserve.worker.input_batch import BatchRow


def _draft_row(row: BatchRow, num_computed_tokens: int, new_token_ids: list[int]) -> BatchRow:
    """The request's row as one draft forward reads it: `new_token_ids` after `num_computed_tokens`
    (its state shared with the step's row, not copied)."""
    return BatchRow(row.request_id, row.params, row.prompt_token_ids, row.output_token_ids, row.page_ids,
                    new_token_ids, num_computed_tokens)


class Drafter:
    def __init__(self, model: Any, backend: Any, device: torch.device, page_size: int) -> None:
        self.model = model  # a `worker.runner.StepModel`
        self.backend = backend  # the draft's own attention backend and KV pool
        self.device = device
        self.page_size = page_size

    def fill(self, rows: Sequence[BatchRow]) -> None:
        """Computes the draft's K/V of the step's known tokens and writes each row's draft tokens
        (its last `num_draft_tokens` of `new_token_ids`, reserved by the scheduler) in place."""
        known = [_draft_row(r, r.num_computed_tokens, r.new_token_ids[: r.num_new_tokens - r.num_draft_tokens])
                 for r in rows]
        drafting = [i for i, r in enumerate(rows) if r.num_draft_tokens]
        with torch.inference_mode():
            tokens = self._forward(known, [known[i] for i in drafting])
            j = 0  # the draft being written, 0-based
            while drafting:
                for i, token in zip(drafting, tokens):
                    rows[i].new_token_ids[len(rows[i].new_token_ids) - rows[i].num_draft_tokens + j] = token
                # Draft j fed back: its K/V, and draft j + 1 from its logits for the rows that want one.
                fed = [_draft_row(rows[i], known[i].kv_len + j, [token]) for i, token in zip(drafting, tokens)]
                after = self._forward(fed, fed)
                wanting = [k for k, i in enumerate(drafting) if rows[i].num_draft_tokens > j + 1]
                drafting, tokens = [drafting[k] for k in wanting], [after[k] for k in wanting]
                j += 1

    def _forward(self, rows: list[BatchRow], sampled: list[BatchRow]) -> list[int]:
        """One draft forward over `rows`; the argmax after each of `sampled`'s last token."""
        rows = [r for r in rows if r.new_token_ids]
        if not rows:
            return []
        layout = BatchLayout.build(rows, self.page_size)
        ids = torch.tensor([t for r in rows for t in r.new_token_ids], dtype=torch.long).to(self.device)
        positions = torch.tensor(layout.positions, dtype=torch.long).to(self.device)
        ends = {id(r): layout.qo_indptr[k + 1] - 1 for k, r in enumerate(rows)}
        index = torch.tensor([ends[id(r)] for r in sampled], dtype=torch.long).to(self.device)
        self.backend.plan(layout)
        logits = self.model.forward(ids, positions, self.backend, index)
        return logits.argmax(dim=-1).tolist()
