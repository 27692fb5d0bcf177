"""One step's inputs, built once from the input batch's rows: what every consumer of a step reads.

`StepInputs` holds the layout (which every attention backend plans from, eagerly or for a CUDA
graph) and the token ids, positions and logits rows on the device (which the eager forward, a
decode graph and every tensor-parallel rank read). On a GPU the step's host arrays go up in one
copy from a pinned buffer: a copy from pageable memory would first wait for the device to finish
the step before, which is exactly the wait that scheduling ahead (overlap) avoids.

A row whose last token is in flight takes it from the sampled ids of the step before, on the
device (`previous`); a decode step that continues the rows of the step before in their order
(steady decoding) takes them in one slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashserve.attention.base import BatchLayout
from flashserve.attention.cascade import CascadePolicy
from flashserve.pinned_staging import PinnedStaging
from flashserve.worker.input_batch import BatchRow
from flashserve.worker.launched_step import LaunchedStep


@dataclass(slots=True)
class StepInputs:
    layout: BatchLayout
    input_ids: torch.Tensor  # [T] long: the step's tokens, those in flight filled in
    positions: torch.Tensor  # [T] long
    # Token rows whose logits the step needs (sampling rows in order, then prompt-logprob rows);
    # None: every row, in a decode step where each samples (what a decode graph computes).
    logits_indices: torch.Tensor | None
    has_in_flight: bool  # some rows' last token is in flight (tensor-parallel ranks share them)
    # With LoRA: each token's adapter slot + 1 (0: the base model), long [T]; None without LoRA.
    lora_slots: torch.Tensor | None = None


class StepInputBuilder:
    """Builds `StepInputs` on one device, through one reused pinned buffer on a GPU."""

    def __init__(self, device: torch.device, page_size: int) -> None:
        self.device = device
        self.page_size = page_size
        self._staging = PinnedStaging(device) if device.type == "cuda" else None

    def build(self, rows: Sequence[BatchRow], prompt_rows: Sequence[int], cascade: CascadePolicy | None,
              previous: LaunchedStep | None, fill_in_flight: bool = True,
              row_lora_slots: Sequence[int] | None = None) -> StepInputs:
        """`fill_in_flight`: this rank has `previous` (rank 0); another rank's placeholders stay
        and get rank 0's ids by a broadcast. `row_lora_slots`: with LoRA, each row's adapter
        slot + 1 (0: none), uploaded per token with the rest."""
        layout = BatchLayout.build(rows, self.page_size, cascade)
        qo = layout.qo_indptr
        token_ids = [t for r in rows for t in r.new_token_ids]
        every_row = layout.is_decode_only and not prompt_rows and all(r.sample for r in rows)
        arrays: list[Sequence[int]] = [token_ids, layout.positions]
        if not every_row:
            # A row with draft tokens needs logits at each of them and at the token before.
            arrays.append([j for i, r in enumerate(rows) if r.sample for j in range(qo[i + 1] - 1 - r.num_draft_tokens,
                                                                                    qo[i + 1])] + list(prompt_rows))
        if row_lora_slots is not None:
            lora_at = len(arrays)
            arrays.append([s for r, s in zip(rows, row_lora_slots) for _ in range(len(r.new_token_ids))])
        dst = [qo[i + 1] - 1 for i, r in enumerate(rows) if r.last_token_in_flight]
        steady, src = False, None
        if dst and fill_in_flight:
            if previous is None:
                raise ValueError("a step with tokens in flight needs the step that samples them")
            ids = [r.request_id for r in rows if r.last_token_in_flight]
            k = len(dst)
            # Steady decoding: the step opens with the requests that sampled last step, in their order.
            steady = dst[-1] == k - 1 and ids == previous.sampled_request_ids[:k]
            row_of = None if steady else {rid: j for j, rid in enumerate(previous.sampled_request_ids)}
            src = dst if row_of is None else [row_of[rid] for rid in ids]
            if previous.ids is None:  # sampled row by row: the ids are on the host already
                assert previous.results is not None
                for d, j in zip(dst, src):
                    token_ids[d] = previous.results[j].token_ids[0] if previous.results[j].token_ids else 0
                steady, src = False, None
            elif not steady:
                arrays += [dst, src]
        dev = self._upload(arrays)
        input_ids, positions = dev[0].long(), dev[1].long()
        logits_indices = None if every_row else dev[2].long()
        if steady:
            assert previous is not None and previous.ids is not None
            input_ids[: len(dst)] = previous.ids[: len(dst)]
        elif src is not None:
            assert previous is not None and previous.ids is not None
            dst_d, src_d = dev[-2].long(), dev[-1].long()
            input_ids.index_copy_(0, dst_d, previous.ids.index_select(0, src_d).long())
        lora_slots = None if row_lora_slots is None else dev[lora_at].long()
        return StepInputs(layout, input_ids, positions, logits_indices, bool(dst), lora_slots)

    def _upload(self, arrays: list[Sequence[int]]) -> list[torch.Tensor]:
        if self._staging is None:
            return [torch.tensor(a, dtype=torch.long) for a in arrays]
        self._staging.begin()
        _, dev = self._staging.upload(arrays)
        self._staging.end()
        return dev
