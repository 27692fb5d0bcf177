"""SchedulerOutput -> input tensors -> forward -> logits -> sampled ids, once per step.

The runner is handed a ready model (`StepModel`: `models/`'s native or generic forward, built by
`model_loader.load`) and an attention backend; it imports neither. `worker/assembly.py` holds the
pieces a runner builder puts together (device, backend, KV cache size, sampler, warm-up, graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from flashserve.attention.base import AttentionBackend
from flashserve.attention.cascade import CascadePolicy
from flashserve.distributed.comm import SingleRankGroup, TPGroup
from flashserve.engine.outputs import NOTHING, SampledTokens, SchedulerOutput, sample_error
from flashserve.lora.manager import LoRAManager
from flashserve.message.lora import LoRAAdapterError, LoRARequest
from flashserve.sample.logprobs import PromptLogprobs, compute_logprobs
from flashserve.sample.rejection import verify_step
from flashserve.structured.grammar import TokenBitmask
from flashserve.worker.input_batch import BatchRow, InputBatch, append_sampled
from flashserve.worker.launched_step import LaunchedStep
from flashserve.worker.step_inputs import StepInputBuilder, StepInputs
from flashserve.worker.verify_graph import is_uniform_verify_step

__all__ = ["LaunchedStep", "ModelRunner", "StepModel", "TokenSampler"]

logger = logging.getLogger(__name__)


class TokenSampler(Protocol):
    def sample_ids(
        self, logits: torch.Tensor, requests: Sequence[BatchRow], bitmask: TokenBitmask | None = None
    ) -> torch.Tensor:
        """`logits` [B, V] -> B token ids on the logits' device, without waiting for them."""
        ...


class StepModel(Protocol):
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """input_ids/positions [T] (backend already planned) -> float32 logits [len(logits_indices), V]."""
        ...

    def decode_logits(self, backend: AttentionBackend) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """`(input_ids, positions) -> logits` of every row: what a decode-step CUDA graph captures."""
        ...


class ModelRunner:
    """Runs one scheduled step: packs its tokens, plans the backend, runs the model, samples.

    A step may be launched while the one before it is still on the device (`launch(out,
    previous)`): rows whose last token is in flight take it from `previous`'s sampled ids there.

    group: the tensor-parallel ranks whose shard `model` is (default: one rank, the whole model).
    Every rank's runner takes the same steps; a request's last token, sampled on rank 0's device
    and never on the host, reaches the other ranks by a broadcast of the step's token ids (rank 0
    fills them in from the step before, the others receive them), so that every rank embeds the
    same tokens. `before_forward(out, prompt_rows)`, when set, runs before each forward: rank 0's
    executor sends the step to the other ranks there.
    """

    overlap_capable = True  # the engine may schedule a step behind one still running
    timing_steps = False  # CUDA events around each step (`start_timing`)
    # Speculative decoding is configured (n-gram drafts from the scheduler, or `drafter`): steps may
    # carry draft tokens to verify. Off: `_launch` never looks for them. `build_runner` sets it.
    speculative = False

    def __init__(
        self,
        model: StepModel,
        device: torch.device,
        backend: AttentionBackend,
        sampler: TokenSampler,
        page_size: int,
        cascade: CascadePolicy | None = None,
        group: TPGroup | None = None,
    ) -> None:
        self.model = model
        self.group: TPGroup = group if group is not None else SingleRankGroup()
        self.before_forward: Callable[[SchedulerOutput, Sequence[int]], None] | None = None
        self.device = device
        self.backend = backend
        self.sampler = sampler
        self.page_size = page_size
        self.cascade = cascade  # None: every step attends flat
        self.graphs: Any = None  # a CudaGraphRunner for decode-only steps, once captured
        self.verify_graphs: Any = None  # a VerifyGraphRunner for uniform verify steps, once captured
        # A PiecewiseGraphRunner for other steps of few tokens (prompts, chunks), once captured.
        self.piecewise_graphs: Any = None
        self.batch = InputBatch()  # the running requests, kept across steps
        self.inputs = StepInputBuilder(self.device, page_size)
        self.drafter: Any = None  # speculative decoding's draft model (`worker/drafter.py`), if any
        # With --enable-lora (`lora.manager.enable_lora`): the adapters and the model's device slots.
        self.lora: LoRAManager | None = None

    def add_lora(self, lora: LoRARequest) -> None:
        """Loads and checks an adapter into the host cache (raises LoRAAdapterError); steps whose
        rows name its `lora_int_id` apply it."""
        if self.lora is None:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: LoRA is not enabled (start with --enable-lora)")
        self.lora.add(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter; False when it was not loaded."""
        return self.lora.remove(lora_int_id) if self.lora is not None else False

    def list_loras(self) -> set[int]:
        return self.lora.ids() if self.lora is not None else set()

    def forward(self, out: SchedulerOutput, prompt_rows: Sequence[int] = (),
                previous: LaunchedStep | None = None, rows: list[BatchRow] | None = None) -> torch.Tensor:
        """float32 logits: one row per request with sample=True, in schedule order, then the
        token rows `prompt_rows` (indices into the step's tokens) for prompt logprobs.
        `previous`: the step before, for the rows whose last token it samples. `rows`: the step's
        rows when the caller applied its diffs to the batch already."""
        if self.before_forward is not None:
            self.before_forward(out, prompt_rows)
        with torch.inference_mode():
            if rows is None:
                rows = self.batch.update(out)
            inputs = self._step_inputs(rows, prompt_rows, previous)
            adapters = self.lora is not None and self.lora.stack.active  # some row of the step uses an adapter
            if self.graphs is not None and inputs.logits_indices is None:
                # Every decode row samples; the graph (or its eager fallback) plans the backend.
                plain = self.lora is not None and not adapters  # no adapter rows: the graph without them
                return self.graphs(inputs.input_ids, inputs.positions, inputs.layout, plain=plain)
            if self.verify_graphs is not None and is_uniform_verify_step(rows, self.verify_graphs.num_draft_tokens,
                                                                         prompt_rows):
                # The logits of every token, which are the sampled ones in a uniform verify step.
                logits = self.verify_graphs(inputs.input_ids, inputs.positions, inputs.layout)
                if logits is not None:
                    return logits
            self.backend.plan(inputs.layout)
            pieces = self.piecewise_graphs
            if pieces is not None and not adapters and pieces.covers(inputs.input_ids.shape[0]):
                return pieces(inputs.input_ids, inputs.positions, inputs.logits_indices)
            return self.model.forward(inputs.input_ids, inputs.positions, self.backend, inputs.logits_indices)

    def _step_inputs(self, rows: list[BatchRow], prompt_rows: Sequence[int], previous: LaunchedStep | None) -> StepInputs:
        row_slots = None
        if self.lora is not None:  # the step's adapters into device slots; each row's slot + 1 (0: none)
            placed = self.lora.slots_for(r.lora_int_id for r in rows)
            row_slots = [placed[r.lora_int_id] + 1 if r.lora_int_id else 0 for r in rows]
        if self.group.world_size == 1:
            inputs = self.inputs.build(rows, prompt_rows, self.cascade, previous, row_lora_slots=row_slots)
        else:
            inputs = self.inputs.build(rows, prompt_rows, self.cascade, previous, fill_in_flight=self.group.rank == 0,
                                       row_lora_slots=row_slots)  # fmt: skip
            if inputs.has_in_flight:  # rank 0's ids, tokens in flight filled in, replace the placeholders
                inputs.input_ids = self.group.broadcast(inputs.input_ids)
        if self.lora is not None:
            assert inputs.lora_slots is not None
            self.lora.stack.set_step(inputs.lora_slots, bool(placed))
        return inputs

    def execute(self, out: SchedulerOutput) -> list[SampledTokens]:
        """One result per `out.requests`, in order (no tokens for a chunk that does not sample)."""
        return self.collect(self.launch(out))

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueues the step's forward, sampling and logprobs without waiting for the device.
        `previous`: the launched step whose sampled ids fill this step's tokens in flight."""
        started = None
        if self.timing_steps:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        step = self._launch(out, previous)
        if step.ids is not None:
            # Enqueued now, so that collect() waits for this step only, not for later ones.
            step.host_ids = step.ids.to("cpu", non_blocking=True)
            if step.logprobs is not None:
                step.logprobs = step.logprobs.to_cpu()
            if step.ids.is_cuda:
                step.ready = torch.cuda.Event(enable_timing=started is not None)
                step.ready.record()
                step.started = started
        return step

    def start_timing(self) -> bool:
        """Time every step on the device from now on (`device_seconds`); False where it cannot (a CPU)."""
        self.timing_steps = self.device.type == "cuda"
        return self.timing_steps

    def step_done(self, step: LaunchedStep) -> bool | None:
        """Whether a launched step's sampled ids are on the host, without waiting; None: unknown (on
        a CPU, or a step that samples nothing)."""
        return step.ready.query() if step.ready is not None else None

    def device_seconds(self, step: LaunchedStep) -> float | None:
        """A collected step's time on the GPU, from its launch's start to its sampled ids on the host
        (the engine's late launches, `engine/late_launch.py`); None: unknown."""
        if step.started is None or step.ready is None:
            return None
        return step.started.elapsed_time(step.ready) / 1e3

    def _launch(self, out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        rows = self.batch.update(out)
        sampling = [i for i, r in enumerate(rows) if r.sample]
        requests = [rows[i] for i in sampling]
        step = LaunchedStep(len(rows), sampling, [r.request_id for r in requests], requests)
        if out.is_empty:
            return step
        step.prompt_logprobs = PromptLogprobs.plan(rows)
        if self.drafter is not None:  # the draft model's K/V of the step's tokens, and its drafts
            self.drafter.fill(rows)
        logits = self.forward(out, step.prompt_logprobs.rows if step.prompt_logprobs is not None else (), previous,
                              rows)
        with torch.inference_mode():
            num_positions = len(sampling)
            if self.speculative:
                num_positions += sum(r.num_draft_tokens for r in requests)
            if step.prompt_logprobs is not None:
                step.prompt_logprobs.compute(logits[num_positions:])
            if not sampling:
                return step
            if num_positions > len(sampling):  # draft tokens to verify: the host needs the outcome now
                step.results = verify_step(self.sampler, logits[:num_positions], requests,  # type: ignore[arg-type]
                                           out.token_bitmask)
                return step
            logits = logits[: len(sampling)]
            try:
                step.ids = self.sampler.sample_ids(logits, requests, out.token_bitmask)
            except Exception:
                # One bad request must not fail the batch: retry row by row, failing only it.
                logger.exception("sampling the batch failed; retrying request by request")
                step.results = [self._sample_one(logits, j, r, out.token_bitmask) for j, r in enumerate(requests)]
                return step
            step.logprob_rows = [j for j, r in enumerate(requests) if r.params.logprobs is not None]
            if step.logprob_rows:
                step.logprob_top = [requests[j].params.logprobs or 0 for j in step.logprob_rows]
                index = torch.tensor(step.logprob_rows, dtype=torch.long).to(self.device, non_blocking=True)
                step.logprobs = compute_logprobs(logits.index_select(0, index), step.ids.index_select(0, index),
                                                 max(step.logprob_top))
        return step

    def collect(self, step: LaunchedStep) -> list[SampledTokens]:
        """Waits for a launched step: one result per request, as `execute` returns."""
        results: list[SampledTokens] = [NOTHING] * step.num_requests
        prompt = step.prompt_logprobs.to_host() if step.prompt_logprobs is not None else {}
        if step.results is not None:
            for i, result in zip(step.sampling, step.results):
                results[i] = result
            for row, result in zip(step.sampled_rows, step.results):
                row.output_token_ids.extend(result.token_ids)
        elif step.ids is not None:
            if step.ready is not None:
                step.ready.synchronize()
            assert step.host_ids is not None  # launch() enqueues the copy with the ids
            ids = step.host_ids.tolist()
            append_sampled(step.sampled_rows, ids)
            logprobs: dict[int, object] = {}
            if step.logprobs is not None:
                chosen = [ids[j] for j in step.logprob_rows]
                logprobs = dict(zip(step.logprob_rows, step.logprobs.to_host(chosen, step.logprob_top)))
            for j, (i, token) in enumerate(zip(step.sampling, ids)):
                lp = logprobs.get(j)
                results[i] = SampledTokens([token], [lp] if lp is not None else None)  # type: ignore[list-item]
        for i, entries in prompt.items():
            results[i] = SampledTokens(results[i].token_ids, results[i].logprobs, entries, results[i].error)
        return results

    def _sample_one(self, logits: torch.Tensor, row: int, request: BatchRow,
                    bitmask: TokenBitmask | None) -> SampledTokens:
        mask = None
        if bitmask is not None and row in bitmask.rows:
            j = bitmask.rows.index(row)
            mask = TokenBitmask([0], bitmask.array()[j : j + 1])
        try:
            token = int(self.sampler.sample_ids(logits[row : row + 1], [request], mask)[0])
        except Exception as exc:  # noqa: BLE001 - the request fails alone, with its message
            return sample_error(str(exc) or type(exc).__name__)
        lp = None
        if request.params.logprobs is not None:
            pending = compute_logprobs(logits[row : row + 1], torch.tensor([token], device=logits.device),
                                       request.params.logprobs)
            lp = pending.to_host([token], [request.params.logprobs])
        return SampledTokens([token], lp)
