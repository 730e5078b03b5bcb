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


class StepPacer:
    """Expected step durations by size (an average of the recent steps of about that many
    tokens), and the time to plan the step behind a running one."""

    MIN_STEP_S = 0.010  # behind a shorter running step, plan at once: little to gain
    LEAD_S = 0.003  # planned this long before the expected end: planning, transfer, preparation
    SHARE = 0.8  # of the expected duration (steps of a size vary by a few tens of percent here)
    WEIGHT = 0.25  # of the newest step in the running average
    # With no step measured yet (a fresh engine), the step behind the first waits this long
    # for the rest of a burst whose first requests the first step took (its requests reach
    # the scheduler over ~10 ms here).
    GRACE_S = 0.005

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # by num_tokens.bit_length()

    def observe(self, num_tokens: int, seconds: float) -> None:
        key = num_tokens.bit_length()
        before = self._seconds.get(key)
        self._seconds[key] = seconds if before is None else before + self.WEIGHT * (
            seconds - before)

    def expected(self, num_tokens: int) -> float | None:
        """The duration of a step of num_tokens: its size's average, else the fastest rate
        per token of the sizes seen (short of it: sooner is safe), else None."""
        key = num_tokens.bit_length()
        if key in self._seconds:
            return self._seconds[key]
        if not self._seconds:
            return None
        return num_tokens * min(s / (1 << k) for k, s in self._seconds.items())

    def plan_at(self, started: float, num_tokens: int) -> float:
        """When to plan the step behind one of num_tokens that started at `started` (a
        time.monotonic() time): `started` itself (at once) when it is expected short."""
        expected = self.expected(num_tokens)
        if expected is None:
            return started + self.GRACE_S
        if expected < self.MIN_STEP_S:
            return started
        return started + expected * self.SHARE - self.LEAD_S
