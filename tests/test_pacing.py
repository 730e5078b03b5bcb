"""Planning the run-ahead step late (stages/scheduler/pacing.py): the pacer's expected step
durations and planning times, the core's test of whether an arrival could still join the next
step, and, live, a request that arrives while a step runs joins the step right after it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from live import live_config
from scheduler_driver import Driver, make_limits, make_request

from ipc.messages import SamplingParams
from pipeline.runtime.launcher import Pipeline
from stages.scheduler.pacing import IDLE_POLL_MS, StepPacer, poll_wait_ms


def test_the_pacer_plans_shortly_before_the_expected_end() -> None:
    pacer = StepPacer()
    assert pacer.expected(64) is None
    assert pacer.plan_at(10.0, 64) == 10.0 + StepPacer.GRACE_S  # nothing measured yet
    pacer.observe(64, 0.100)
    pacer.observe(64, 0.060)  # running averages of the steps of about that size
    step = 0.100 + StepPacer.WEIGHT * (0.060 - 0.100)
    assert pacer.expected(64) == pytest.approx(step)
    assert pacer.plan_at(10.0, 64) == pytest.approx(
        10.0 + step * StepPacer.SHARE - StepPacer.LEAD_S)
    # Within the size (64-127 tokens) the estimate errs short: below the average size, the
    # rate per token times the tokens; above it, the average step
    assert pacer.expected(40) == pytest.approx(40 * step / 64)  # (as 40 < 64)
    pacer.observe(100, 0.100)
    per_token = (0.100 / 64 + StepPacer.WEIGHT * (0.060 / 64 - 0.100 / 64))
    per_token += StepPacer.WEIGHT * (0.100 / 100 - per_token)
    step += StepPacer.WEIGHT * (0.100 - step)
    assert pacer.expected(127) == pytest.approx(min(step, 127 * per_token))
    assert pacer.expected(127) <= 127 * per_token and pacer.expected(127) <= step
    # A size not seen yet: the fastest rate per token seen (short of the truth: too soon,
    # which loses nothing)
    assert pacer.expected(2048) == pytest.approx(2048 * per_token)
    pacer.observe(1, 0.004)  # short steps: the step behind is planned at once
    assert pacer.plan_at(10.0, 1) == 10.0


def test_the_wait_for_a_due_plan_is_whole_milliseconds_rounded_up() -> None:
    assert poll_wait_ms(0.0, 100.0) == IDLE_POLL_MS  # no plan due
    assert poll_wait_ms(100.0003, 100.0) == 1  # (0 would poll again and again: a spin)
    assert poll_wait_ms(100.0121, 100.0) == 13
    assert poll_wait_ms(99.0, 100.0) == 0  # due already
    assert poll_wait_ms(101.0, 100.0) == IDLE_POLL_MS  # messages are still looked at


def test_room_for_an_arrival_needs_a_free_slot_and_budget_left() -> None:
    driver = Driver(make_limits(max_num_seqs=2, max_num_batched_tokens=16, depth=2))
    assert driver.core.has_room()
    driver.add(make_request("a", 10, max_tokens=4))
    assert driver.core.has_room()  # 10 prompt tokens of 16, a slot the waiting one leaves
    driver.plan()  # a runs (its prompt computed); one slot left
    assert driver.core.has_room()
    driver.add(make_request("b", 4, max_tokens=4))
    assert not driver.core.has_room()  # the one free slot is b's
    driver = Driver(make_limits(max_num_seqs=4, max_num_batched_tokens=16, depth=2))
    driver.add(make_request("a", 20, max_tokens=4))
    assert not driver.core.has_room()  # the known prompt fills the step


@pytest.mark.live
@pytest.mark.timeout(120)
def test_a_request_arriving_while_a_step_runs_joins_the_step_after_it(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Steps of 200 ms (the timed device). While one request decodes, a second is sent
    just after a token of the first came back (its next step has just started): it joins
    the step right after that one, where planning that step at once would have left it for
    the step after."""
    cfg = live_config(tiny_model_dir, depth=2, max_num_seqs=4, device="timed:200,0")
    trace = tmp_path / "trace.json"
    pipe = Pipeline(cfg, trace_path=str(trace))
    try:
        pipe.start()
        sent = asyncio.run(_second_request_mid_step(pipe))
    finally:
        pipe.stop()
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps = sorted((e for e in events if e.get("name") == "device" and e.get("ph") == "X"),
                   key=lambda e: e["ts"])
    running = next((i for i, e in enumerate(steps) if e["ts"] <= sent <= e["ts"] + e["dur"]),
                   None)
    assert running is not None, "the second request was sent while no step ran"
    assert steps[running]["args"]["seqs"] == 1
    assert steps[running + 1]["args"]["seqs"] == 2


async def _second_request_mid_step(pipe: Pipeline) -> float:
    """Streams a first request; after its third token, sends a second. Returns when the
    second was sent (the trace's clock, microseconds)."""
    client = pipe.client()
    first = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    second = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    sent = 0.0
    tasks = []
    seen = 0
    async for out in client.stream([5, 6, 7, 8], first, request_id="first"):
        seen += len(out.token_ids)
        if seen >= 3 and not tasks:
            sent = time.perf_counter_ns() / 1e3
            tasks.append(asyncio.ensure_future(_drain(client.stream([9, 10, 11], second,
                                                                     request_id="second"))))
    await asyncio.gather(*tasks)
    return sent


async def _drain(stream) -> None:  # type: ignore[no-untyped-def]
    async for _ in stream:
        pass
