"""Waiting requests are admitted by priority (lower value first), then first come first served;
preempted sequences go back into that order."""

from __future__ import annotations

from scheduler_driver import Driver, make_limits, make_request

from stages.scheduler.sequence import SeqStatus


def admitted_order(driver: Driver) -> list[str]:
    order: list[str] = []
    for step in driver.history:
        for row in step.rows:
            if row.request_id not in order:
                order.append(row.request_id)
    return order


def test_lower_priority_value_is_admitted_first_then_fcfs() -> None:
    driver = Driver(make_limits(max_num_seqs=1, depth=1))
    for rid, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", -1), ("f", 0)]:
        driver.add(make_request(rid, 3, max_tokens=2, priority=priority))
    driver.run()
    driver.check_idle()
    assert admitted_order(driver) == ["c", "e", "a", "f", "b", "d"]


def test_a_high_priority_arrival_overtakes_the_waiting_queue() -> None:
    driver = Driver(make_limits(max_num_seqs=1, depth=1))
    driver.run({0: [make_request("a", 3, max_tokens=4)],
                1: [make_request("b", 3, max_tokens=4), make_request("c", 3, max_tokens=4)],
                2: [make_request("urgent", 3, max_tokens=4, priority=-10)]})
    driver.check_idle()
    assert admitted_order(driver) == ["a", "urgent", "b", "c"]


def three_on_a_small_cache(order: list[tuple[str, int]]) -> Driver:
    """Three sequences, added in this order with these priorities, on 9 blocks: they all
    run, then one must be preempted."""
    limits = make_limits(num_blocks=9, block_size=4, max_num_seqs=3, max_num_batched_tokens=64,
                         depth=1)
    driver = Driver(limits)
    for rid, priority in order:
        driver.add(make_request(rid, 4, max_tokens=12, priority=priority))
    return driver


def test_the_lowest_priority_running_sequence_is_preempted() -> None:
    """Blocks run out while three sequences run: the victim is the one of lowest priority,
    even though it arrived first."""
    driver = three_on_a_small_cache([("low", 3), ("mid", 1), ("high", 0)])
    while driver.core.num_preemptions == 0:
        driver.tick()
    assert driver.core.seq("low").num_preemptions == 1
    assert driver.core.seq("mid").num_preemptions == 0
    driver.run()
    driver.check_idle()


def test_priority_outranks_the_just_resumed_guard() -> None:
    """A low-priority sequence that was just resumed is still preempted before a
    high-priority one: the guard only orders sequences of the same priority."""
    driver = three_on_a_small_cache([("high", 0), ("mid", 1), ("low", 3)])
    driver.tick()
    low = driver.core.seq("low")
    low.num_preemptions, low.resumed_at = 1, len(low.output_ids) + 1  # as if resumed
    while driver.core.num_preemptions == 0:
        driver.tick()
        if low.num_preemptions == 1 and low.status is not SeqStatus.PREEMPTING:
            low.resumed_at = len(low.output_ids)
    assert low.status is SeqStatus.PREEMPTING or low.status.value == "waiting"
    assert driver.core.seq("mid").num_preemptions == 0
    driver.run()
    driver.check_idle()
