"""The default step size: 8192 tokens and 1024 requests on a GPU of 70 GiB or more (not an A100),
2048 and 256 on other GPUs, on a CPU 256 requests and the tokens one step computes in about 0.4 s."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from flashserve.worker import step_budget
from flashserve.worker.step_budget import (
    CPU_MIN_STEP_TOKENS,
    CPU_STEP_SECONDS,
    GPU_STEP_TOKENS,
    budget_from_rate,
    default_max_num_seqs,
    default_step_budget,
    large_gpu,
)

PAGE = 16


class ClockRunner:
    """A runner whose steps take `seconds_per_token` per scheduled token on a fake clock."""

    def __init__(self, seconds_per_token: float) -> None:
        self.seconds_per_token = seconds_per_token
        self.now = 0.0
        self.steps: list[int] = []

    def clock(self) -> float:
        return self.now

    def execute(self, out) -> list:  # noqa: ANN001 - a SchedulerOutput
        tokens = sum(r.num_new_tokens for r in out.requests)
        self.steps.append(tokens)
        self.now += tokens * self.seconds_per_token
        return [0] * len(out.requests)


def test_cuda_budget_is_2048_without_running_a_step() -> None:
    runner = ClockRunner(1.0)
    assert default_step_budget(runner, "cuda", num_pages=100, page_size=PAGE) == GPU_STEP_TOKENS == 2048
    assert runner.steps == []


def test_large_gpu_budget_is_8192_as_vllms() -> None:
    runner = ClockRunner(1.0)
    assert default_step_budget(runner, "cuda", num_pages=100, page_size=PAGE, large=True) == 8192
    assert runner.steps == []


def test_large_gpu_steps_hold_1024_requests_and_others_256() -> None:
    assert (default_max_num_seqs(True), default_max_num_seqs(False)) == (1024, 256)


@pytest.mark.parametrize(("name", "gib", "large"), [
    ("NVIDIA H100 80GB HBM3", 79.2, True), ("NVIDIA H200", 139.8, True), ("NVIDIA A100-SXM4-80GB", 79.2, False),
    ("NVIDIA L40S", 44.4, False), ("NVIDIA GeForce RTX 4090", 23.6, False),
])
def test_large_gpu_is_one_of_70_gib_or_more_other_than_an_a100(monkeypatch: pytest.MonkeyPatch, name: str,
                                                              gib: float, large: bool) -> None:
    props = SimpleNamespace(name=name, total_memory=int(gib * 2**30))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert large_gpu(torch.device("cuda", 0)) is large
    assert large_gpu("auto") is large  # --device's default names the GPU when there is one


def test_a_cpu_is_never_a_large_gpu() -> None:
    assert large_gpu(torch.device("cpu")) is False and large_gpu("cpu") is False


def test_cuda_without_a_gpu_is_not_a_large_gpu_and_leaves_the_error_to_the_device_pick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert large_gpu("cuda") is False and large_gpu("auto") is False


def test_cpu_budget_holds_the_tokens_one_step_computes_in_the_target_time(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ClockRunner(0.002)  # 500 tokens/s
    monkeypatch.setattr(step_budget.time, "perf_counter", runner.clock)
    budget = default_step_budget(runner, "cpu", num_pages=100, page_size=PAGE)
    assert budget == int(CPU_STEP_SECONDS / 0.002) // PAGE * PAGE == 192


def test_cpu_probe_writes_only_pages_past_the_scratch_page(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[int]] = []

    class Recorder(ClockRunner):
        def execute(self, out) -> list:  # noqa: ANN001
            seen.extend(r.page_ids for r in out.requests)
            return super().execute(out)

    runner = Recorder(0.001)
    monkeypatch.setattr(step_budget.time, "perf_counter", runner.clock)
    default_step_budget(runner, "cpu", num_pages=100, page_size=PAGE)
    assert seen and all(0 not in pages and max(pages) < 100 for pages in seen)


def test_cpu_probe_releases_its_row_with_a_finished_step(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[str] = []

    class Recorder(ClockRunner):
        def execute(self, out) -> list:  # noqa: ANN001
            released.extend(out.finished_ids)
            return super().execute(out)

    runner = Recorder(0.001)
    monkeypatch.setattr(step_budget.time, "perf_counter", runner.clock)
    default_step_budget(runner, "cpu", num_pages=100, page_size=PAGE)
    assert released == ["step-budget-probe"]


def test_budget_is_whole_pages() -> None:
    assert budget_from_rate(0.4 / 250, PAGE) == 240


def test_budget_never_exceeds_the_gpu_default_on_a_fast_machine() -> None:
    assert budget_from_rate(1e-6, PAGE) == GPU_STEP_TOKENS


def test_budget_keeps_a_floor_on_a_slow_or_busy_machine() -> None:
    assert budget_from_rate(1.0, PAGE) == CPU_MIN_STEP_TOKENS


def test_engine_on_a_cpu_resolves_the_auto_budget_before_scheduling(tmp_path) -> None:  # noqa: ANN001
    from flashserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from flashserve.entrypoints.llm import build_engine

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=str(tmp_path / "config.json"), load_format="dummy", device="cpu")
    stack = build_engine(model, CacheConfig(num_pages=32), SchedulerConfig())
    assert CPU_MIN_STEP_TOKENS <= stack.max_num_batched_tokens <= GPU_STEP_TOKENS
    assert stack.engine.scheduler.config.max_num_batched_tokens == stack.max_num_batched_tokens
    assert stack.engine.scheduler.config.max_num_seqs == 256  # resolved as well: no None reaches the scheduler


def test_cpu_steps_without_a_waiting_stream_may_hold_a_whole_8k_prompt() -> None:
    assert step_budget.default_prefill_only_budget("cpu", 160) == 8192
    assert step_budget.default_prefill_only_budget("cpu", 10_000) == 10_000


def test_gpu_steps_keep_the_step_budget_for_prefills_too() -> None:
    assert step_budget.default_prefill_only_budget("cuda", 2048) is None
