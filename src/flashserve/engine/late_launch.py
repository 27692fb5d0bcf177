"""When to schedule the next step under overlap scheduling: just before the step on the device ends.

With overlap scheduling the engine schedules step N+1 as soon as step N is on the device, so a prompt
that arrives while N+1 runs waits for N+2, which starts only after N+1 ends: up to two steps before
its prefill begins, where scheduling N+2 at the end of N+1 would start it after one. `LateLaunch`
keeps the overlap and takes back that step: for a step of decode rows only (whose device time the
steps before it predict), it gives the engine loop a deadline shortly before the step's predicted
end, until which the loop keeps receiving requests; then it schedules and launches the next step,
which reaches the device before this one ends and takes what arrived meanwhile.

What it needs from the executor (`DeviceTimes`): a collected step's device time (on a GPU, CUDA
events around the step, recorded once `start_timing` asks for them), and whether a launched step
has ended (the end event's query). Executors without them (the CPU, whose `launch` computes the
step) get no late launches. From the engine's own
calls it takes the host's launch time (scheduling a step and handing it to the executor) and when a
wait for a step ended, which is when the device moved on to the step behind it.

The deadline leaves the launch time and a margin before the predicted end. A launch at a deadline
that finds the step before it already ended (the device waited) doubles the margin, up to half a
decode step; each one in time narrows it by a tenth, down to `MIN_MARGIN_S`. Steps with prompt or
draft tokens get no deadline (the next step is scheduled at once, as without this): their times vary
with what they carry.

With `min_decode_s` (the server's default, `AUTO_MIN_DECODE_S`) decode steps shorter than that get
no deadline either. A late launch idles the device for about the host's launch time, whatever the
step's length, while what a prompt gains is a step: on two H200s the 70B's shapes (decode steps of
9-21 ms) gained 2-19 ms of median TTFT, the 8B (3.4-7.5 ms) gained 0-5 ms in one A/B and lost 0.3 ms
of median ITL in another (`benchmark/results/NVIDIA_H200/late_launch/README.md`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from flashserve.engine.outputs import SchedulerOutput

ALPHA = 0.2  # the weight of a new measurement in the running averages
MIN_MARGIN_S = 0.0005  # the least margin left before a step's predicted end, beyond the launch time
GROW, SHRINK = 2.0, 0.9  # the margin after a late launch / after one in time
MAX_MARGIN = 0.5  # the widest margin, as a share of a decode step
WAITED_S = 0.0002  # a wait at least this long: the step ended during it, so its end time is known
AUTO_MIN_DECODE_S = 0.008  # by default, decode steps at least this long on the device get late launches


class DeviceTimes(Protocol):
    def start_timing(self) -> bool:
        """Time every step on the device from now on; False where the executor cannot."""
        ...

    def step_done(self, handle: Any) -> bool | None:
        """Whether a launched step has ended on the device, without waiting; None: unknown."""
        ...

    def device_seconds(self, handle: Any) -> float | None:
        """A collected step's time on the device; None: unknown."""
        ...


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class LateLaunch:
    """Times the engine's launches and waits (`launched`, `collected`, on one clock) and gives the
    engine loop its deadline for receiving requests (`deadline`)."""

    def __init__(self, min_decode_s: float = 0.0) -> None:
        self.min_decode_s = min_decode_s  # shorter decode steps get no deadline
        self.decode_s: float | None = None  # a decode step's device time
        self.launch_s: float | None = None  # the host's time to schedule and launch a step
        self.margin_s = MIN_MARGIN_S
        self.num_deadlines = 0  # launches held to a deadline
        self.num_late = 0  # of those, launches that found the step before them ended
        # Whether each launched step not yet collected is `out.decode_only`, oldest first: steps are
        # collected in the order they were launched.
        self._decode_steps: deque[bool] = deque()
        self._last_end: float | None = None  # when the last wait for a step ended, if it waited

    def launched(self, out: SchedulerOutput, start: float, end: float, *, at_deadline: bool = False,
                 found_done: bool | None = None) -> None:
        """A step was scheduled from `start` and handed to the executor by `end`. `at_deadline`: the
        engine loop held it to a deadline; `found_done`: the step it was launched behind had ended by
        then (None: unknown, or launched behind none)."""
        self.launch_s = _average(self.launch_s, end - start)
        self._decode_steps.append(out.decode_only)
        if at_deadline and found_done is not None:
            self.num_deadlines += 1
            if found_done:
                self.num_late += 1
                self.margin_s = min(self.margin_s * GROW, MAX_MARGIN * (self.decode_s or 0.0))
            else:
                self.margin_s = max(MIN_MARGIN_S, self.margin_s * SHRINK)

    def collected(self, start: float, end: float, device_s: float | None) -> None:
        """The engine waited for its oldest launched step from `start` to `end`; `device_s`: the step's
        device time, if the executor knows it."""
        if self._decode_steps.popleft() if self._decode_steps else False:
            if device_s is not None:
                self.decode_s = _average(self.decode_s, device_s)
        self._last_end = end if end - start >= WAITED_S else None

    def deadline(self) -> float | None:
        """Until when the engine loop may receive requests before it schedules the next step (on the
        clock of `launched` and `collected`); None: schedule it at once."""
        running_decode = bool(self._decode_steps) and self._decode_steps[0]  # the step launched behind
        if not running_decode or self._last_end is None or self.decode_s is None or self.launch_s is None:
            return None
        if self.decode_s < self.min_decode_s:
            return None
        margin = self.launch_s + self.margin_s
        if margin >= self.decode_s:
            return None
        return self._last_end + self.decode_s - margin
