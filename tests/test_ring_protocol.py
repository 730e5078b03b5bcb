"""The step-input ring never hands the executor a slot that is being rewritten: the stamps
that bracket each write are checked before and after the executor copies a slot out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipc.messages import SamplingParams, StepPlan, TokenizedRequest
from ipc.rings import RingRaceError, check_stamp, step_input_specs
from stages.executor.sampler import HostSlotParams
from stages.executor.step_inputs import prepare_host_step, staging_size
from stages.scheduler.core import Scheduler, SchedulerLimits
from stages.scheduler.process import make_plan, write_step

SEQS, TOKENS, UPDATES = 4, 64, 64


def _ring() -> dict[str, np.ndarray]:
    return {s.name: np.zeros(s.shape, dtype=s.dtype)
            for s in step_input_specs(SEQS, TOKENS, UPDATES)}


def _planned_step(step_count: int = 1) -> tuple[Scheduler, list]:
    core = Scheduler(SchedulerLimits(64, 4, SEQS, TOKENS, 128, UPDATES, (), depth=2))
    for i in range(3):
        core.add_request(TokenizedRequest(str(i), "", [5, 6, 7, 8, 9], SamplingParams(max_tokens=5),
                                          0.0))
    return core, [core.schedule() for _ in range(step_count)]


def _prepare(plan: StepPlan, ring: dict[str, np.ndarray]) -> None:
    staging = torch.zeros(staging_size(SEQS, TOKENS, UPDATES, 0), dtype=torch.int64)
    prepare_host_step(plan, ring, staging, HostSlotParams(SEQS), plan.ring_slot)


def test_a_completely_written_slot_is_accepted() -> None:
    _, (step,) = _planned_step()
    ring = _ring()
    write_step(step, ring)
    _prepare(make_plan(step), ring)


def test_a_slot_half_rewritten_by_the_next_step_is_refused() -> None:
    _, (step,) = _planned_step()
    ring = _ring()
    write_step(step, ring)
    ring["stamp"][0] = step.step_id + 3  # a later step began writing into the same slot
    with pytest.raises(RingRaceError, match="rewritten before the executor finished"):
        _prepare(make_plan(step), ring)


def test_a_slot_rewritten_while_it_is_being_read_is_refused(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The writer starts on the slot in the middle of the executor's copy."""
    _, (step,) = _planned_step()
    ring = _ring()
    write_step(step, ring)
    real_cumsum = np.cumsum

    def cumsum_while_rewritten(*args, **kwargs):  # type: ignore[no-untyped-def]
        ring["stamp"][0] = step.step_id + 3
        return real_cumsum(*args, **kwargs)

    monkeypatch.setattr(np, "cumsum", cumsum_while_rewritten)
    with pytest.raises(RingRaceError):
        _prepare(make_plan(step), ring)


def test_scheduler_never_reuses_a_ring_slot_still_in_flight() -> None:
    core, _ = _planned_step(step_count=0)
    seen_in_flight: set[int] = set()
    for _ in range(30):
        while (step := core.schedule()) is not None:
            assert step.ring_slot not in seen_in_flight
            seen_in_flight.add(step.ring_slot)
        if not core.inflight:
            break
        done = core.inflight[0]
        core.on_sampled(done.step_id, [11] * len(done.sampled_seqs))
        seen_in_flight.discard(done.ring_slot)
    assert sorted(core.free_ring_slots) == [0, 1, 2]
    check_stamp({"stamp": np.array([4, 4])}, 4)
