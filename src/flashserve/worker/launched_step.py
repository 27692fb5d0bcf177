"""A step launched on the device and not yet collected: what `ModelRunner.collect` waits for, and
what the next step's inputs take the tokens in flight from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashserve.engine.outputs import SampledTokens
from flashserve.sample.logprobs import PendingLogprobs, PromptLogprobs
from flashserve.worker.input_batch import BatchRow


@dataclass
class LaunchedStep:
    """A step whose forward and sampling were enqueued on the device; `ModelRunner.collect` waits."""

    num_requests: int
    sampling: list[int]  # indices of the requests that sample
    sampled_request_ids: list[str] = field(default_factory=list)  # their ids, in that order
    sampled_rows: list[BatchRow] = field(default_factory=list)  # their rows, which collect extends
    ids: torch.Tensor | None = None  # their token ids, still on the device
    results: list[SampledTokens] | None = None  # or already on the host (per-row fallback)
    # Copies to the host, enqueued behind the sampling, and the event that says they are there:
    # collecting a step must not wait for a step launched after it.
    host_ids: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    # On a GPU, recorded as the launch began: with `ready`, the step's time on the device.
    started: torch.cuda.Event | None = None
    # Sampling rows (positions in `sampling`) that asked for logprobs, and how many top tokens.
    logprob_rows: list[int] = field(default_factory=list)
    logprob_top: list[int] = field(default_factory=list)
    logprobs: PendingLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # the chunks' rows that give prompt logprobs
