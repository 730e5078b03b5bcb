"""When to plan the step that runs ahead of the device (stages/scheduler/process.py).

A step planned the moment the one before it starts is fixed from then on: a request that
arrives while that step runs waits for the step after the one already planned, a whole step
more before its first token. Under a burst it is worse: the first step takes the few prompts
that had arrived, the step planned at once behind it only their next tokens, and the rest of
the burst waits two steps (traced: a 7-token step of 56 ms between a 7-prompt step and the
first full one). So the run-ahead step is planned late, shortly before the running step is
expected to end, with every request that has come by then; at once where waiting can gain
nothing (no free slot for an arrival, the known work already filling the step's budget) or
where the running step is short.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

IDLE_POLL_MS = 50  # the scheduler's wait for a message when no plan is due


class StepPacer:
    """Expected step durations by size (from running averages of the recent steps of about
    that many tokens, erring short), and the time to plan the step behind a running one."""

    MIN_STEP_S = 0.010  # behind a shorter running step, plan at once: little to gain
    LEAD_S = 0.003  # planned this long before the expected end: planning, transfer, preparation
    SHARE = 0.8  # of the expected duration (steps of a size vary by a few tens of percent here)
    WEIGHT = 0.25  # of the newest step in the running average
    # With no step measured yet (a fresh engine), the step behind the first waits this long
    # for the rest of a burst whose first requests the first step took (64 requests reached
    # the scheduler over 10-20 ms here; at 5 ms the step behind held one token). At worst the
    # device waits out the difference, once, behind a first step shorter than this.
    GRACE_S = 0.020

    def __init__(self) -> None:
        # by num_tokens.bit_length(): running averages of a step's seconds, and of its
        # seconds per token
        self._seconds: dict[int, float] = {}
        self._per_token: dict[int, float] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        key = num_tokens.bit_length()
        for table, value in ((self._seconds, seconds),
                             (self._per_token, seconds / max(1, num_tokens))):
            before = table.get(key)
            table[key] = value if before is None else before + self.WEIGHT * (value - before)

    def expected(self, num_tokens: int) -> float | None:
        """The duration of a step of num_tokens, erring short (planning early loses only
        what waiting would have gained): of its size's averages, the lesser of the step's
        and of the rate per token times num_tokens (a step costs less than its tokens' share
        above the average size, and less than the average step below it); for a size not
        seen, the fastest rate per token seen; None before any step."""
        key = num_tokens.bit_length()
        if key in self._seconds:
            return min(self._seconds[key], self._per_token[key] * num_tokens)
        if not self._per_token:
            return None
        return num_tokens * min(self._per_token.values())

    def plan_at(self, started: float, num_tokens: int) -> float:
        """When to plan the step behind one of num_tokens that started at `started` (a
        time.monotonic() time): `started` itself (at once) when it is expected short."""
        expected = self.expected(num_tokens)
        if expected is None:
            return started + self.GRACE_S
        if expected < self.MIN_STEP_S:
            return started
        return started + expected * self.SHARE - self.LEAD_S


class RunAheadDepth:
    """--run-ahead-depth auto: how many steps may be in flight. With d in flight, planning
    step N + d waits for step N's tokens, so the chain from the end of step N on the device
    to the launch of step N + d (the report, on_sampled, schedule, the ring write, the
    executor's preparation and launch) has d - 1 device steps to run in: behind short steps
    (a GPU's decode, CUDA graphs, small models) one step is too little. A step more costs a
    plan fixed a step earlier (an arrival joins a step later) and one more discarded token
    per finished sequence, so it is taken only while the steps are short: 2 until MIN_SEEN
    steps were timed, then `deepest` while the median of the last WINDOW device steps is
    under `short_ms`, back to 2 once it passes `short_ms` * HYSTERESIS."""

    WINDOW = 32
    MIN_SEEN = 8
    HYSTERESIS = 1.25  # (so a median near the threshold does not flip the depth each step)

    def __init__(self, deepest: int, short_ms: float) -> None:
        self.deepest, self.short_s = deepest, short_ms / 1e3
        self.depth = min(2, deepest)
        self._recent: deque[float] = deque(maxlen=self.WINDOW)

    def observe(self, seconds: float) -> int:
        """A step took `seconds` on the device: the depth from now on."""
        self._recent.append(seconds)
        if len(self._recent) >= self.MIN_SEEN:
            median = statistics.median(self._recent)
            if median < self.short_s:
                self.depth = self.deepest
            elif median > self.short_s * self.HYSTERESIS:
                self.depth = min(2, self.deepest)
        return self.depth


def poll_wait_ms(plan_at: float, now: float) -> int:
    """The scheduler's wait for a message, in whole milliseconds (zmq truncates a float, and
    a wait under 1 ms would become poll(0) again and again until the plan is due): up to
    `plan_at` (a time.monotonic() time; 0: none due), rounded up, at most IDLE_POLL_MS."""
    if not plan_at:
        return IDLE_POLL_MS
    return min(IDLE_POLL_MS, max(0, math.ceil((plan_at - now) * 1e3)))
