"""Metrics of the scheduler process: histograms of step duration and tokens per step, the
device's recent idle fraction (from the device interval each executor report carries), and
how long finished requests spent in each phase."""

from __future__ import annotations

import bisect
from collections import deque

from ipc.messages import (
    REQUEST_PHASES,
    REQUEST_SECONDS_BOUNDS,
    STEP_SECONDS_BOUNDS,
    STEP_TOKENS_BOUNDS,
    Histogram,
)


class RequestPhases:
    """Histograms of finished requests' phases (REQUEST_PHASES): queue (arrival to first
    admission), prefill (admission to first token), decode (first token to the end),
    inference (admission to the end). Wall-clock seconds: the arrival time is the client's."""

    def __init__(self) -> None:
        self.buckets = {p: [0] * (len(REQUEST_SECONDS_BOUNDS) + 1) for p in REQUEST_PHASES}
        self.sums = dict.fromkeys(REQUEST_PHASES, 0.0)

    def record(self, arrival: float, admitted: float, first_token: float | None,
               end: float) -> None:
        first = first_token if first_token is not None else end
        for phase, seconds in (("queue", admitted - arrival), ("prefill", first - admitted),
                               ("decode", end - first), ("inference", end - admitted)):
            seconds = max(0.0, seconds)
            self.buckets[phase][bisect.bisect_left(REQUEST_SECONDS_BOUNDS, seconds)] += 1
            self.sums[phase] += seconds

    def snapshot(self) -> dict[str, Histogram]:
        return {p: Histogram(list(self.buckets[p]), self.sums[p]) for p in REQUEST_PHASES}


class StepMetrics:
    WINDOW_S = 5.0  # idle fraction over the steps of the last few seconds
    MAX_GAP_S = 0.5  # a longer gap between steps means there was no work, not an idle device

    def __init__(self) -> None:
        self.seconds = [0] * (len(STEP_SECONDS_BOUNDS) + 1)
        self.tokens = [0] * (len(STEP_TOKENS_BOUNDS) + 1)
        self.seconds_sum = 0.0
        self.tokens_sum = 0
        self._recent: deque[tuple[float, float]] = deque()

    def record(self, num_tokens: int, start: float, end: float) -> None:
        duration = max(0.0, end - start)
        self.seconds[bisect.bisect_left(STEP_SECONDS_BOUNDS, duration)] += 1
        self.tokens[bisect.bisect_left(STEP_TOKENS_BOUNDS, num_tokens)] += 1
        self.seconds_sum += duration
        self.tokens_sum += num_tokens
        self._recent.append((start, end))
        while self._recent and self._recent[0][1] < end - self.WINDOW_S:
            self._recent.popleft()

    @property
    def idle_fraction(self) -> float:
        steps = list(self._recent)
        busy = sum(e - s for s, e in steps)
        idle = sum(max(0.0, b[0] - a[1]) for a, b in zip(steps, steps[1:], strict=False)
                   if b[0] - a[1] < self.MAX_GAP_S)
        return idle / (busy + idle) if busy + idle > 0 else 0.0
