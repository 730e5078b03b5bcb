"""No request waits forever: the starvation probe under each kind of hog (the scheduler core
with the harness's executor; waiting is counted in steps, so nothing here depends on timing).
The probe is a short request from another sender; alone it finishes in a few steps, and under
every hog it must finish within 10 times that. (`scripts/bench fairness` measures the same in
seconds on the live pipeline.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from scheduler_driver import Driver, make_limits, make_request

from ipc.messages import TokenizedRequest
from stages.scheduler.core import MAX_SENDERS

LIMITS = make_limits(num_blocks=1024, block_size=16, max_num_seqs=16,
                     max_num_batched_tokens=1024, max_model_len=4096)
Hog = Callable[[int], list[TokenizedRequest]]
PROBE_AT = 100  # the hog has filled the engine by then


def probe_steps(hog: Hog, probe_at: int = PROBE_AT, probe_user: str = "probe",
                limit: int = 5000) -> int:
    """Steps from the probe's arrival until its last token."""
    driver = Driver(LIMITS)
    probe = make_request("probe", 16, max_tokens=8, user=probe_user)
    for tick in range(probe_at + limit):
        for req in hog(tick):
            driver.add(req)
        if tick == probe_at:
            driver.add(probe)
        driver.tick()
        if hog is stopped_early:  # as the detokenizer does when a stop string shows
            for key, out in driver.outputs.items():
                if key.startswith("s") and len(out) >= 3 and key not in driver.finished:
                    driver.core.stop_sample(key, 0)
        if "probe" in driver.finished:
            return tick - probe_at
    raise AssertionError(f"the probe did not finish in {limit} steps")


def no_hog(tick: int) -> list[TokenizedRequest]:
    return []


def many_samples(tick: int) -> list[TokenizedRequest]:
    """One request with n = 64: four times the engine's slots."""
    return [make_request("hog", 32, n=64, max_tokens=300)] if tick == 0 else []


def long_prompts(tick: int) -> list[TokenizedRequest]:
    """A flood of prompts of 2,000 tokens, faster than the engine serves them."""
    return [make_request(f"long{tick}", 2000, max_tokens=50)] if tick < 400 else []


def many_requests(tick: int) -> list[TokenizedRequest]:
    return [make_request(f"r{tick}.{i}", 32, max_tokens=200) for i in range(3)]


def stopped_early(tick: int) -> list[TokenizedRequest]:
    """Requests asking for 1,000 tokens that a stop string ends after 3, without pause."""
    return [make_request(f"s{tick}.{i}", 32, max_tokens=1000) for i in range(4)]


def urgent_traffic(tick: int) -> list[TokenizedRequest]:
    """Requests of a better priority than the probe's, arriving without pause."""
    return [make_request(f"u{tick}", 32, max_tokens=100, priority=-1)]


def test_the_probe_alone_takes_a_few_steps() -> None:
    assert probe_steps(no_hog) <= 12


@pytest.mark.parametrize("hog", [many_samples, long_prompts, many_requests, stopped_early,
                                 urgent_traffic], ids=lambda h: h.__name__)
def test_the_probe_finishes_within_ten_times_its_alone_time(hog: Hog) -> None:
    alone = probe_steps(no_hog)
    assert probe_steps(hog) <= 10 * alone


@pytest.mark.parametrize("hog", [many_samples, long_prompts, many_requests, stopped_early,
                                 urgent_traffic], ids=lambda h: h.__name__)
def test_from_the_hogs_own_sender_the_probe_finishes_within_ten_times(hog: Hog) -> None:
    """The probe sent by the hog's sender (one client, no user: the normal case behind a
    proxy) is not queued behind the rest of the hog: within a sender, requests are weighted
    fair queued (a request of n = 64 is 64 turns of its cost; the probe is one short one)."""
    alone = probe_steps(no_hog)
    assert probe_steps(hog, probe_user="") <= 10 * alone


def test_within_one_sender_equal_requests_are_first_come_first_served() -> None:
    """Arrival breaks the tie between equal requests of one sender; a shorter one that
    arrives while they run takes the slot of the one that would finish last."""
    driver = Driver(make_limits(max_num_seqs=2))
    for i in range(6):
        driver.add(make_request(f"r{i}", 8, max_tokens=20))
    admitted: list[str] = []
    while len(driver.finished) < 7:
        driver.tick()
        if admitted == ["r0", "r1"] and "short" not in driver.core.requests:
            driver.add(make_request("short", 8, max_tokens=2))
        for seq in driver.core.running:
            if seq.request_id not in admitted:
                admitted.append(seq.request_id)
    assert admitted == ["r0", "r1", "short", "r2", "r3", "r4", "r5"]
    assert driver.core.num_preemptions == 1  # r1, for the short one; never for an equal one
    assert all(len(driver.outputs[f"r{i}"]) == 20 for i in range(6))


def test_a_sender_holding_every_slot_makes_room_without_thrashing() -> None:
    """Sender a holds every slot with one request of n = 40. Sender b's request of n = 40
    gets a slot within a few steps (one of a's samples is preempted for it), and as a's
    samples finish the two settle at half the slots each, with a handful of preemptions in
    all: never one of a sender at or below its share."""
    driver = Driver(LIMITS)
    driver.add(make_request("a", 32, n=40, max_tokens=120))
    for _ in range(30):
        driver.tick()
    assert len(driver.core.running) == LIMITS.max_num_seqs
    driver.add(make_request("b", 32, n=40, max_tokens=120, user="b"))
    for _ in range(4):
        driver.tick()
    assert [s.request_id for s in driver.core.running].count("b") == 1
    for _ in range(150):
        driver.tick()
    running = [s.request_id for s in driver.core.running]
    assert running.count("a") == running.count("b") == LIMITS.max_num_seqs // 2
    driver.run()
    driver.check_idle()
    assert driver.core.num_preemptions <= 8
    assert len(driver.outputs) == 80 and all(len(v) == 120 for v in driver.outputs.values())


def test_senders_are_forgotten_once_caught_up() -> None:
    """Each sender costs an entry until the virtual time passes its work: the table of
    senders stays bounded however many distinct users send."""
    driver = Driver(LIMITS)
    for i in range(MAX_SENDERS + 100):
        driver.add(make_request(f"r{i}", 4, max_tokens=1, user=f"u{i}"))
        if i % 50 == 0:
            driver.run()
    driver.run()
    assert len(driver.core.queue.sender_end) <= MAX_SENDERS + 1


def test_a_priority_outside_the_engines_range_is_refused() -> None:
    driver = Driver(make_limits(priority_range=(0, 10)))
    driver.add(make_request("urgent", 4, max_tokens=2, priority=-1))
    driver.add(make_request("batch", 4, max_tokens=2, priority=10))
    driver.run()
    assert [r.request_id for r in driver.rejected] == ["urgent"]
    assert "priority must be between 0 and 10" in (driver.rejected[0].error or "")
    assert len(driver.outputs["batch"]) == 2


def test_fair_sharing_survives_slots_held_only_by_finished_sequences() -> None:
    """Every slot belongs to a sequence that finished with a step still in flight while
    another waits: nothing to share (and no crash); the waiting one runs once they drain."""
    driver = Driver(make_limits(max_num_seqs=4))
    for i in range(6):
        driver.add(make_request(f"r{i}", 4, max_tokens=50))
    driver.plan()
    for i in range(4):
        driver.abort(f"r{i}")
    driver.run()
    driver.check_idle()
    assert len(driver.outputs["r5"]) == 50


def test_a_preempted_sample_waits_behind_the_one_it_made_room_for() -> None:
    """Sender a fills every slot with n = 16; sender b's request, of a worse priority and so
    a later tag than the virtual time, still takes the freed slot: one preemption, no
    thrash."""
    driver = Driver(make_limits(num_blocks=512, max_num_seqs=16, max_num_batched_tokens=256,
                                max_model_len=512))
    driver.add(make_request("a", 8, n=16, max_tokens=400))
    for _ in range(20):
        driver.tick()
    driver.add(make_request("b", 8, max_tokens=4, user="b", priority=1))
    for _ in range(20):
        driver.tick()
    assert "b" in driver.finished and driver.core.num_preemptions == 1


def test_within_one_sender_priority_orders_equal_requests() -> None:
    """Within a sender, a request of a better priority goes first among equal ones, and
    takes the slot of a running one of a worse priority (one preemption)."""
    driver = Driver(make_limits(max_num_seqs=1))
    driver.add(make_request("running", 8, max_tokens=20))
    driver.tick()
    order = [s.request_id for s in driver.core.running]
    for i in range(3):
        driver.add(make_request(f"later{i}", 8, max_tokens=20))
    driver.add(make_request("urgent", 8, max_tokens=20, priority=-1))
    while len(driver.finished) < 5:
        driver.tick()
        order += [s.request_id for s in driver.core.running if s.request_id not in order]
    assert order == ["running", "urgent", "later0", "later1", "later2"]
    assert driver.core.num_preemptions <= 1


def test_a_stream_of_short_requests_does_not_starve_a_long_one_of_the_same_sender() -> None:
    """Short requests that keep arriving (as fast as the engine serves them) from the
    sender of a long waiting one go first, but the sender's virtual time moves with what it
    is served: the long one ends within twice its time without them."""

    def run(with_shorts: bool) -> int:
        driver = Driver(make_limits(max_num_seqs=2))
        driver.add(make_request("a", 8, max_tokens=40))
        driver.add(make_request("b", 8, max_tokens=40))
        driver.tick()
        driver.add(make_request("long", 8, max_tokens=40))
        for tick in range(1000):
            if with_shorts and tick % 2 == 0:
                driver.add(make_request(f"short{tick}", 8, max_tokens=2))
            driver.tick()
            if "long" in driver.finished:
                return tick
        raise AssertionError("the long request never finished")

    assert run(True) <= 2 * run(False)

