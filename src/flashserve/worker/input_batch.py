"""The runner's persistent batch: what it knows of every running request, kept across steps.

The scheduler tells a runner of a request once, in its first row (new: sampling parameters, the
tokens known so far, its page table), and afterwards sends only diffs: the tokens a step computes
and the pages added to the table. `InputBatch.update` applies a step's diffs and returns its rows
in schedule order; the step's inputs (layout, token ids, positions, sampling rows) are built from
those rows, by every rank alike. Requests that left the running set (`finished_ids`,
`preempted_ids`) lose their rows; a preempted one comes back as a new row.

A row's outputs are the tokens the runner itself sampled for it (`append_sampled`, when a step is
collected): penalties and per-token seeds read them here, not from the scheduler's lists. A rank
that does not sample keeps rows without outputs, which its forward never reads.

Pure Python (no torch): the scheduler's tests check their steps against it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Sequence

from flashserve.engine.outputs import SchedulerOutput
from flashserve.message.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class BatchRow:
    """One running request's state in the runner, and its share of the current step."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: array  # int32 ids
    output_token_ids: array  # int32: the outputs known on the host (sampled here, or resent)
    page_ids: array  # int32: the request's whole page table
    # This step's share (`ScheduledRequest`'s fields of the same names).
    new_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sample: bool = False
    last_token_in_flight: bool = False
    lora_int_id: int = 0  # the request's LoRA adapter (0: the base model), set with the new row
    num_draft_tokens: int = 0  # the last this many of new_token_ids are draft tokens to verify

    @property
    def num_new_tokens(self) -> int:
        return len(self.new_token_ids)

    @property
    def kv_len(self) -> int:
        return self.num_computed_tokens + len(self.new_token_ids)

    @property
    def num_prior_outputs(self) -> int:
        """Outputs before the one this row samples (min_tokens and per-token seeds count them),
        the one in flight included."""
        return len(self.output_token_ids) + self.last_token_in_flight


class InputBatch:
    """Rows of the running requests by id, updated by each step's diffs."""

    def __init__(self) -> None:
        self.rows: dict[str, BatchRow] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def update(self, out: SchedulerOutput) -> list[BatchRow]:
        """Applies the step's diffs; its rows, in schedule order."""
        rows = self.rows
        for rid in out.finished_ids:
            rows.pop(rid, None)
        for rid in out.preempted_ids:
            rows.pop(rid, None)
        step = []
        for r in out.requests:
            if r.params is not None:  # new (again, after a preemption): the state is rebuilt
                row = rows[r.request_id] = BatchRow(
                    r.request_id, r.params, array("i", r.prompt_token_ids), array("i", r.output_token_ids),
                    array("i", r.page_ids), lora_int_id=r.lora_int_id)
            else:
                row = rows.get(r.request_id)  # type: ignore[assignment]
                if row is None:
                    raise ValueError(f"a step continues request {r.request_id!r}, which the runner has no row for")
                if r.page_ids:
                    row.page_ids.extend(r.page_ids)
            row.new_token_ids = r.new_token_ids
            row.num_computed_tokens = r.num_computed_tokens
            row.sample = r.sample
            row.last_token_in_flight = r.last_token_in_flight
            row.num_draft_tokens = r.num_draft_tokens
            step.append(row)
        return step

    def clear(self) -> None:
        """Drops every row (after steps that no scheduler released: warm-up, probes)."""
        self.rows.clear()


def append_sampled(rows: Sequence[BatchRow], token_ids: Sequence[int]) -> None:
    """Each sampling row's token, as collected; a row that left the batch since is not read again."""
    for row, token in zip(rows, token_ids):
        row.output_token_ids.append(token)

