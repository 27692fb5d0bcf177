"""Late launches under overlap scheduling: the deadline that `LateLaunch` gives the engine loop, from
the times of the engine's launches and waits; and, with an executor whose steps take real time, a
prompt that arrives while a decode step runs starting in the step right behind it."""

from __future__ import annotations

import asyncio
import time

from test_engine import VOCAB, ScriptedExecutor
from test_engine_core import CoreThread, _collect

from flashserve.config import SchedulerConfig
from flashserve.engine.late_launch import AUTO_MIN_DECODE_S, MIN_MARGIN_S, LateLaunch
from flashserve.engine.llm_engine import LLMEngine
from flashserve.engine.outputs import ScheduledRequest, SchedulerOutput
from flashserve.engine.scheduler import Scheduler
from flashserve.kv_cache.manager import KVCacheManager
from flashserve.message.sampling_params import SamplingParams

MS = 1e-3


def decode_step(n: int = 4) -> SchedulerOutput:
    rows = [ScheduledRequest(f"r{i}", [0], 100, [], True, last_token_in_flight=True) for i in range(n)]
    return SchedulerOutput(rows, decode_only=True)


def prompt_step() -> SchedulerOutput:
    rows = [ScheduledRequest("p", list(range(300)), 0, [1, 2], True, params=SamplingParams())]
    return SchedulerOutput(rows + decode_step().requests)


def steady(late: LateLaunch, steps: int, device_s: float = 10 * MS, launch_s: float = 1 * MS,
           step: SchedulerOutput | None = None) -> float:
    """`steps` steps of `device_s` on the device, each launched `launch_s` after the wait for the one
    before it ended (the overlap schedule without deadlines); returns when the last wait ended."""
    step = step or decode_step()
    late.launched(step, 0.0, launch_s)  # the first step, alone: it starts as its launch ends
    late.launched(step, launch_s, 2 * launch_s)  # the second, behind it
    late.collected(2 * launch_s, launch_s + device_s, device_s)
    end = launch_s + device_s
    for _ in range(steps):  # each next step launched as the wait for the one before it ends
        late.launched(step, end, end + launch_s)
        late.collected(end + launch_s, end + device_s, device_s)
        end += device_s
    return end


def test_a_decode_step_on_the_device_gets_a_deadline_its_launch_time_and_a_margin_before_its_end():
    late = LateLaunch()
    end = steady(late, 5)
    assert late.decode_s is not None and abs(late.decode_s - 10 * MS) < 1e-9
    assert late.deadline() == end + 10 * MS - (1 * MS + MIN_MARGIN_S)


def test_a_step_with_prompt_tokens_on_the_device_gets_no_deadline():
    late = LateLaunch()
    end = steady(late, 5)
    late.launched(prompt_step(), end, end + 1 * MS)
    late.collected(end + 1 * MS, end + 10 * MS, 10 * MS)
    assert late.deadline() is None


def test_decode_steps_shorter_than_the_least_asked_get_no_deadline():
    late = LateLaunch(min_decode_s=AUTO_MIN_DECODE_S)
    steady(late, 5, device_s=AUTO_MIN_DECODE_S / 2)
    assert late.deadline() is None


def test_decode_steps_at_least_as_long_as_the_least_asked_get_a_deadline():
    late = LateLaunch(min_decode_s=AUTO_MIN_DECODE_S)
    steady(late, 5, device_s=2 * AUTO_MIN_DECODE_S)
    assert late.deadline() is not None


def test_no_deadline_follows_a_wait_that_ended_at_once():
    late = LateLaunch()
    end = steady(late, 5)
    late.launched(decode_step(), end, end + 20 * MS)  # the host took longer than the device
    late.collected(end + 20 * MS, end + 20 * MS, 10 * MS)
    assert late.deadline() is None


def test_a_launch_that_finds_the_step_before_it_ended_widens_the_margin_and_one_in_time_narrows_it():
    late = LateLaunch()
    end = steady(late, 5)
    deadline = late.deadline()
    assert deadline is not None
    late.launched(decode_step(), deadline, deadline + 1 * MS, at_deadline=True, found_done=True)
    assert late.num_late == 1 and late.margin_s == 2 * MIN_MARGIN_S
    late.collected(deadline + 1 * MS, deadline + 1 * MS, 10 * MS)
    late.launched(decode_step(), end, end + 1 * MS, at_deadline=True, found_done=False)
    assert late.num_late == 1 and late.num_deadlines == 2 and late.margin_s < 2 * MIN_MARGIN_S


class DeviceExecutor(ScriptedExecutor):
    """Steps that take `step_s` on a device of their own: a launch returns at once, the step starts when
    the one before it ends, and `collect` waits for its end; the device times of a GPU's runner.
    Records each step's (start, end, rows)."""

    def __init__(self, script: list[int], step_s: float) -> None:
        super().__init__(script)
        self.step_s = step_s
        self.free_at = 0.0
        self.steps_run: list[tuple[float, float, list[str]]] = []

    def launch(self, out, previous=None):  # noqa: ANN001, ANN201
        start = max(time.monotonic(), self.free_at)
        self.free_at = start + self.step_s
        self.steps_run.append((start, self.free_at, [r.request_id for r in out.requests]))
        return super().launch(out, previous), self.free_at

    def collect(self, handle):  # noqa: ANN001, ANN201
        results, end = handle
        time.sleep(max(0.0, end - time.monotonic()))
        return results

    def start_timing(self) -> bool:
        return True

    def step_done(self, handle) -> bool:  # noqa: ANN001
        return time.monotonic() >= handle[1]

    def device_seconds(self, handle) -> float:  # noqa: ANN001
        return self.step_s


def device_engine(step_s: float, late_launch: bool | None = True) -> LLMEngine:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(config, KVCacheManager(64, 16), max_model_len=512)
    return LLMEngine(sched, DeviceExecutor([5], step_s), None, vocab_size=VOCAB, overlap=True, late_launch=late_launch)


def first_step_of(executor: DeviceExecutor, request_id: str) -> int:
    return next(i for i, (_, _, rows) in enumerate(executor.steps_run) if request_id in rows)


def test_a_prompt_that_arrives_while_a_decode_step_runs_starts_in_the_step_right_behind_it():
    step_s = 0.05
    engine = device_engine(step_s)
    executor = engine.executor

    async def main() -> float:
        core = CoreThread(engine)
        (client,) = core.clients()
        running = asyncio.create_task(_collect(client, "long", [1], SamplingParams(max_tokens=30, ignore_eos=True)))
        while len(executor.steps_run) < 8:  # decode steps back to back, timed
            await asyncio.sleep(0.005)
        start, _, _ = executor.steps_run[-1]  # the step on the device now, or about to be
        await asyncio.sleep(max(0.0, start + 0.4 * step_s - time.monotonic()))
        arrived = time.monotonic()
        await _collect(client, "new", [2, 3], SamplingParams(max_tokens=1))
        await running
        client.shutdown()
        core.thread.join(5)
        return arrived

    arrived = asyncio.run(main())
    during = next(i for i, (s, e, _) in enumerate(executor.steps_run) if s <= arrived < e)
    assert first_step_of(executor, "new") == during + 1, executor.steps_run


def test_late_launches_keep_the_device_busy_between_decode_steps():
    engine = device_engine(0.02)
    executor = engine.executor

    async def main() -> None:
        core = CoreThread(engine)
        (client,) = core.clients()
        await _collect(client, "long", [1], SamplingParams(max_tokens=40, ignore_eos=True))
        client.shutdown()
        core.thread.join(5)

    asyncio.run(main())
    assert engine.late is not None and engine.late.num_deadlines > 10  # launches were held to deadlines
    idle = [start - end for (_, end, _), (start, _, _) in zip(executor.steps_run, executor.steps_run[1:])]
    assert sum(gap > 0.005 for gap in idle) <= 3, idle


def deadlines_given(step_s: float, late_launch: bool | None) -> int:
    """How many of a 12-token stream's launches an engine holds to a deadline with steps of `step_s`."""
    engine = device_engine(step_s, late_launch=late_launch)
    engine.add_request("long", [1], SamplingParams(max_tokens=12, ignore_eos=True))
    held = 0
    while engine.has_unfinished:
        held += engine.launch_deadline() is not None
        engine.step()
    return held


def test_by_default_launches_are_held_behind_decode_steps_of_at_least_8_ms():
    assert deadlines_given(2 * AUTO_MIN_DECODE_S, late_launch=None) > 0


def test_by_default_launches_are_not_held_behind_shorter_decode_steps():
    assert deadlines_given(AUTO_MIN_DECODE_S / 4, late_launch=None) == 0


def test_late_launch_true_holds_launches_behind_short_decode_steps_too():
    assert deadlines_given(AUTO_MIN_DECODE_S / 4, late_launch=True) > 0


def test_the_scheduler_marks_a_step_decode_only_when_it_carries_no_prompt_tokens():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(64, 16),
                      max_model_len=512)
    engine = LLMEngine(sched, ScriptedExecutor([5, 6, 7]), None, vocab_size=VOCAB)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    kinds = []
    schedule = sched.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        kinds.append(out.decode_only)
        return out

    sched.schedule = recording_schedule  # type: ignore[method-assign]
    while engine.has_unfinished:
        engine.step()
    assert kinds[:3] == [False, True, True]
