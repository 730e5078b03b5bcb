"""Abort at every point of a request's life frees every block, slot and ring slot it held:
waiting, prefilling (a chunk in flight), running, being preempted, preempted and waiting,
a sample held back for its first sibling, finished with a step still in flight."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from scheduler_driver import Driver, make_limits, make_request, prompt_of

from ipc.messages import SamplingParams, TokenizedRequest
from stages.scheduler.sequence import SeqStatus, Sequence


def run_until(driver: Driver, rid: str, state: Callable[[Sequence], bool],
              max_ticks: int = 200) -> None:
    """Tick (plan, report one step) until sample 0 of rid is in the given state; the check
    runs after planning too, so states that last only while a step is in flight are seen."""
    for _ in range(max_ticks):
        seqs = driver.core.requests.get(rid)
        if seqs and state(seqs[0]):
            return
        driver.plan()
        seqs = driver.core.requests.get(rid)
        if seqs and state(seqs[0]):
            return
        driver.report()
        driver.collect()
    raise AssertionError(f"{rid} never reached the state")


def waiting(s: Sequence) -> bool:
    return s.status is SeqStatus.WAITING and s.num_preemptions == 0


def prefilling(s: Sequence) -> bool:
    return s.status is SeqStatus.RUNNING and 0 < s.num_computed < len(s.prompt_ids)


def running(s: Sequence) -> bool:
    return s.status is SeqStatus.RUNNING and len(s.output_ids) >= 2 and s.num_inflight > 0


def being_preempted(s: Sequence) -> bool:
    return s.status is SeqStatus.PREEMPTING


def preempted_waiting(s: Sequence) -> bool:
    return s.status is SeqStatus.WAITING and s.num_preemptions > 0


STATES = {"waiting": waiting, "prefilling": prefilling, "running": running,
          "being-preempted": being_preempted, "preempted-waiting": preempted_waiting}


def crowded(depth: int) -> Driver:
    """Three sequences on a cache that cannot hold them all: the last one gets preempted."""
    limits = make_limits(num_blocks=10, block_size=4, max_num_seqs=3, max_num_batched_tokens=8,
                         depth=depth)
    driver = Driver(limits)
    driver.add(make_request("a", 6, max_tokens=20))
    driver.add(make_request("b", 6, max_tokens=20))
    driver.add(make_request("victim", 14, max_tokens=20))
    return driver


# At depth 1 nothing else is in flight when a victim is chosen: it is released at once.
CASES = [(s, d) for s in STATES for d in (1, 2) if (s, d) != ("being-preempted", 1)]


@pytest.mark.parametrize(("state", "depth"), CASES)
def test_abort_in_every_state_frees_everything(state: str, depth: int) -> None:
    driver = crowded(depth)
    run_until(driver, "victim", STATES[state])
    driver.abort("victim")
    driver.run()
    driver.check_idle()
    assert driver.finished["victim"].finish_reason == "abort"
    assert driver.finished["a"].finish_reason == "length"
    assert driver.core.stats().num_free_blocks == driver.limits.num_blocks


@pytest.mark.parametrize("depth", [1, 2])
def test_abort_of_samples_held_for_their_first_sibling(depth: int) -> None:
    driver = Driver(make_limits(num_blocks=40, block_size=4, max_num_batched_tokens=8,
                                depth=depth))
    driver.add(TokenizedRequest("n", "c", prompt_of("n", 20), SamplingParams(n=3), 0.0))
    run_until(driver, "n", prefilling)
    assert len(driver.core.book.held["n"]) == 2
    driver.abort("n")
    driver.run()
    driver.check_idle()
    assert not driver.core.book.held
    assert {driver.finished[k].finish_reason for k in ("n", "n#1", "n#2")} == {"abort"}
