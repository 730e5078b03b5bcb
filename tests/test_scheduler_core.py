"""Scheduler core driven by a fake executor that keeps a paged KV store and checks every step:
admission, chunked prefill, blocks, stops, run-ahead (depth 1 vs 2), aborts, preemption, soak."""

from __future__ import annotations

import dataclasses
import random

import pytest
from scheduler_driver import (
    EOS,
    STOP,
    Driver,
    TokenFn,
    expected_tokens,
    make_limits,
    make_request,
    plain_token,
    prompt_of,
    results,
    run_all,
    stops_at,
)

from ipc.messages import RequestRejected, TokenDelta, TokenizedRequest
from stages.scheduler.sequence import SeqStatus

# ---------------------------------------------------------------- admission and budget


def test_admission_stops_at_max_num_seqs() -> None:
    driver = Driver(make_limits(max_num_seqs=2, depth=1))
    for rid in "abcd":
        driver.add(make_request(rid, 3, max_tokens=2))
    (step,) = driver.plan()
    assert [r.request_id for r in step.rows] == ["a", "b"]
    assert sorted(step.new_slots) == [0, 1]
    assert [s.request_id for s in driver.core.waiting] == ["c", "d"]


def test_freed_slot_admits_the_next_request() -> None:
    driver = Driver(make_limits(max_num_seqs=1, depth=1))
    driver.add(make_request("a", 3, max_tokens=1))
    driver.add(make_request("b", 3, max_tokens=1))
    driver.tick()
    assert driver.finished["a"].finish_reason == "length"
    (step,) = driver.plan()
    assert [r.request_id for r in step.rows] == ["b"] and step.new_slots == (0,)


def test_long_prompt_is_prefilled_in_chunks() -> None:
    driver = Driver(make_limits(max_num_batched_tokens=8, depth=1))
    driver.add(make_request("a", 20, max_tokens=1))
    driver.run()
    rows = [s.rows[0] for s in driver.history]
    assert [len(r.token_ids) for r in rows] == [8, 8, 4]
    assert [r.context_len for r in rows] == [8, 16, 20]
    assert [r.do_sample for r in rows] == [False, False, True]
    assert [t for r in rows for t in r.token_ids] == prompt_of("a", 20)


def test_prefill_chunks_run_ahead_at_depth_two() -> None:
    driver = Driver(make_limits(max_num_batched_tokens=8, depth=2))
    driver.add(make_request("a", 20, max_tokens=1))
    steps = driver.plan()
    assert [s.rows[0].context_len for s in steps] == [8, 16]


def test_decodes_are_planned_before_prefill_chunks() -> None:
    driver = Driver(make_limits(max_num_batched_tokens=8, depth=1))
    driver.add(make_request("a", 3, max_tokens=10))
    driver.tick()
    driver.add(make_request("b", 20, max_tokens=1))
    (step,) = driver.plan()
    assert [(r.request_id, len(r.token_ids)) for r in step.rows] == [("a", 1), ("b", 7)]


def test_budget_left_after_decodes_admits_new_prompts() -> None:
    driver = Driver(make_limits(max_num_batched_tokens=10, depth=1))
    driver.add(make_request("a", 6, max_tokens=5))
    driver.add(make_request("b", 6, max_tokens=5))
    (first,) = driver.plan()
    assert [(r.request_id, len(r.token_ids)) for r in first.rows] == [("a", 6), ("b", 4)]
    assert first.rows[1].do_sample is False


# ---------------------------------------------------------------- blocks


def test_blocks_grow_with_the_sequence() -> None:
    driver = Driver(make_limits(block_size=4, depth=1))
    driver.add(make_request("a", 5, max_tokens=8))
    seq = driver.core.seq("a")
    sizes = []
    while "a" not in driver.finished:
        driver.tick()
        sizes.append((seq.num_computed, len(seq.blocks)))
    assert sizes[:6] == [(5, 2), (6, 2), (7, 2), (8, 2), (9, 3), (10, 3)]
    assert driver.core.allocator.num_free == driver.limits.num_blocks


def test_block_updates_name_the_slot_and_index() -> None:
    driver = Driver(make_limits(block_size=4, depth=1))
    driver.add(make_request("a", 9, max_tokens=1))
    (step,) = driver.plan()
    slot = step.rows[0].slot
    assert [(s, i) for s, i, _ in step.block_updates] == [(slot, 0), (slot, 1), (slot, 2)]
    assert [b for _, _, b in step.block_updates] == driver.core.seq("a").blocks


def test_blocks_are_freed_on_finish() -> None:
    driver = Driver(make_limits(depth=1))
    driver.add(make_request("a", 7, max_tokens=3))
    driver.tick()
    assert driver.core.allocator.num_free == driver.limits.num_blocks - 2
    driver.run()
    driver.check_idle()


def test_blocks_are_freed_on_abort() -> None:
    driver = Driver(make_limits(depth=1))
    driver.add(make_request("a", 7))
    driver.tick()
    driver.tick()
    assert driver.core.allocator.num_free < driver.limits.num_blocks
    driver.abort("a")
    assert driver.core.allocator.num_free == driver.limits.num_blocks
    driver.collect()
    assert driver.finished["a"].finish_reason == "abort"
    driver.check_idle()


# ---------------------------------------------------------------- stop conditions


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_eos_stops_the_request(depth: int) -> None:
    fn = stops_at({"a": (3, EOS)})
    driver = run_all(make_limits(depth=depth), {0: [make_request("a", 5, max_tokens=20)]}, fn)
    assert driver.outputs["a"] == expected_tokens("a", 4, fn)
    assert driver.outputs["a"][-1] == EOS
    assert driver.finished["a"].finish_reason == "stop"


def test_ignore_eos_runs_past_eos() -> None:
    fn = stops_at({"a": (3, EOS)})
    req = make_request("a", 5, max_tokens=8, ignore_eos=True)
    driver = run_all(make_limits(), {0: [req]}, fn)
    assert driver.outputs["a"] == expected_tokens("a", 8, fn)
    assert driver.finished["a"].finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    fn = stops_at({"a": (2, STOP)})
    req = make_request("a", 5, max_tokens=8, ignore_eos=True, stop_token_ids=[STOP])
    driver = run_all(make_limits(), {0: [req]}, fn)
    assert driver.outputs["a"] == expected_tokens("a", 3, fn)
    assert driver.finished["a"].finish_reason == "stop"


def test_stop_token_not_listed_does_not_stop() -> None:
    fn = stops_at({"a": (2, STOP)})
    driver = run_all(make_limits(), {0: [make_request("a", 5, max_tokens=6)]}, fn)
    assert len(driver.outputs["a"]) == 6


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_max_tokens_stops_with_length(depth: int) -> None:
    driver = run_all(make_limits(depth=depth), {0: [make_request("a", 5, max_tokens=7)]})
    assert driver.outputs["a"] == expected_tokens("a", 7)
    assert driver.finished["a"].finish_reason == "length"
    num_samples = sum(r.do_sample for s in driver.history for r in s.rows)
    assert num_samples == 7, "no step may be planned past max_tokens"


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_max_model_len_stops_with_length(depth: int) -> None:
    driver = run_all(make_limits(max_model_len=16, depth=depth), {0: [make_request("a", 10)]})
    assert driver.outputs["a"] == expected_tokens("a", 6)
    assert driver.finished["a"].finish_reason == "length"
    assert max(r.context_len for s in driver.history for r in s.rows) == 15


def test_max_tokens_one_finishes_after_prefill() -> None:
    driver = run_all(make_limits(), {0: [make_request("a", 5, max_tokens=1)]})
    assert driver.outputs["a"] == expected_tokens("a", 1)
    assert len(driver.history) == 1


# ---------------------------------------------------------------- run-ahead


def staggered_arrivals() -> dict[int, list[TokenizedRequest]]:
    return {
        0: [make_request("a", 5, max_tokens=9), make_request("b", 17)],
        1: [make_request("c", 3, max_tokens=4)],
        3: [make_request("d", 30, max_tokens=6), make_request("e", 1, max_tokens=12)],
        4: [make_request("f", 8, stop_token_ids=[STOP])],
        9: [make_request("g", 2, max_tokens=3, ignore_eos=True)],
    }


STAGGERED_STOPS = stops_at({"b": (5, EOS), "e": (0, EOS), "f": (4, STOP), "g": (1, EOS)})


def test_depth_one_and_two_give_identical_outputs() -> None:
    limits = make_limits(max_num_seqs=3, max_num_batched_tokens=12, max_model_len=40)
    one = run_all(dataclasses.replace(limits, depth=1), staggered_arrivals(), STAGGERED_STOPS)
    two = run_all(dataclasses.replace(limits, depth=2), staggered_arrivals(), STAGGERED_STOPS)
    three = run_all(dataclasses.replace(limits, depth=3), staggered_arrivals(), STAGGERED_STOPS)
    assert results(one) == results(two) == results(three)
    assert set(results(one)) == set("abcdefg")
    assert results(one)["e"] == ([EOS], "stop")
    assert results(one)["g"][0] == expected_tokens("g", 3, STAGGERED_STOPS)


def test_depth_one_never_uses_a_placeholder() -> None:
    driver = run_all(make_limits(depth=1), staggered_arrivals(), STAGGERED_STOPS)
    assert all(-1 not in r.token_ids for s in driver.history for r in s.rows)


def test_depth_two_feeds_the_pending_token_as_a_placeholder() -> None:
    driver = Driver(make_limits(depth=2))
    driver.add(make_request("a", 4, max_tokens=5))
    first, second = driver.plan()
    assert first.rows[0].token_ids == tuple(prompt_of("a", 4))
    assert second.rows[0].token_ids == (-1,) and second.rows[0].context_len == 5
    driver.report()
    (third,) = driver.plan()
    assert third.rows[0].token_ids == (-1,) and third.rows[0].context_len == 6


def test_in_flight_token_after_a_stop_is_dropped_and_blocks_wait_for_it() -> None:
    limits = make_limits(depth=2, block_size=4)
    driver = Driver(limits, stops_at({"a": (1, EOS)}))
    driver.add(make_request("a", 4))
    seq = driver.core.seq("a")
    assert len(driver.plan()) == 2  # prefill, then a decode of the pending first token
    driver.report()
    assert len(driver.plan()) == 1  # a decode of the pending EOS: the step already planned
    driver.report()  # EOS arrives; one step with the sequence is still in flight
    driver.collect()
    assert driver.finished["a"].finish_reason == "stop"
    assert driver.outputs["a"] == [plain_token("a", 0), EOS]
    assert seq.status is SeqStatus.FINISHED and seq.slot is not None
    assert driver.core.allocator.num_free == limits.num_blocks - 2
    assert driver.plan() == []
    driver.report()  # the extra token
    assert driver.collect() == []
    assert driver.outputs["a"] == [plain_token("a", 0), EOS]
    driver.check_idle()


@pytest.mark.parametrize("depth", [2, 3])
def test_stop_run_ahead_never_leaks_the_extra_tokens(depth: int) -> None:
    """Each sequence that stops at EOS has up to depth - 1 steps planned past it; their
    tokens are dropped, and counted."""
    table = {rid: (k, EOS) for k, rid in enumerate("abcdef")}
    arrivals = {i: [make_request(rid, 3 + i)] for i, rid in enumerate("abcdef")}
    driver = run_all(make_limits(depth=depth), arrivals, stops_at(table))
    for k, rid in enumerate("abcdef"):
        assert driver.outputs[rid] == expected_tokens(rid, k + 1, stops_at(table))
    # (the driver plans as deep as it may: depth - 1 steps past each EOS)
    assert driver.core.discarded_tokens == 6 * (depth - 1)
    assert driver.core.stats().discarded_tokens == driver.core.discarded_tokens


# ---------------------------------------------------------------- aborts


def test_abort_of_a_waiting_request() -> None:
    driver = Driver(make_limits(max_num_seqs=1, depth=1))
    driver.add(make_request("a", 3, max_tokens=4))
    driver.add(make_request("b", 3, max_tokens=4))
    driver.tick()
    driver.abort("b")
    driver.run()
    assert driver.finished["b"] == TokenDelta("b", [], "abort")
    assert all(r.request_id != "b" for s in driver.history for r in s.rows)
    assert len(driver.outputs["a"]) == 4
    driver.check_idle()


def test_abort_of_a_prefilling_request_waits_for_its_chunk() -> None:
    limits = make_limits(max_num_batched_tokens=8, depth=2)
    driver = Driver(limits)
    driver.add(make_request("a", 30))
    driver.plan()
    driver.abort("a")
    driver.collect()
    assert driver.finished["a"] == TokenDelta("a", [], "abort")
    assert driver.core.allocator.num_free == limits.num_blocks - 4
    assert driver.plan() == []
    driver.report()
    assert driver.core.allocator.num_free == limits.num_blocks - 4
    driver.report()
    driver.check_idle()
    assert driver.collect() == []


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_abort_of_a_running_request(depth: int) -> None:
    driver = Driver(make_limits(depth=depth))
    driver.add(make_request("a", 5))
    for _ in range(4):
        driver.tick()
    driver.abort("a")
    driver.run()
    out = driver.outputs["a"]
    assert driver.finished["a"].finish_reason == "abort"
    assert out == expected_tokens("a", len(out)) and len(out) >= 3
    driver.check_idle()


def test_abort_of_a_finished_request_is_ignored() -> None:
    driver = run_all(make_limits(), {0: [make_request("a", 5, max_tokens=2)]})
    driver.abort("a")
    assert driver.collect() == []
    assert driver.finished["a"].finish_reason == "length"
    driver.check_idle()


def test_abort_of_a_request_finished_but_still_in_flight() -> None:
    driver = Driver(make_limits(depth=2), stops_at({"a": (1, EOS)}))
    driver.add(make_request("a", 4))
    driver.plan()
    driver.report()
    driver.plan()
    driver.report()
    driver.abort("a")
    driver.collect()
    assert driver.finished["a"].finish_reason == "stop"
    driver.run()
    driver.check_idle()


def test_abort_before_the_request_arrives() -> None:
    driver = Driver(make_limits())
    driver.abort("early")
    driver.add(make_request("early", 5))
    infos, deltas, rejected, _ = driver.core.take_outputs()
    assert infos == [] and deltas == []
    assert rejected == [RequestRejected("early", "client", "abort", None, 5)]
    assert driver.plan() == []
    driver.check_idle()


def test_early_abort_is_used_once() -> None:
    driver = Driver(make_limits())
    driver.abort("x")
    driver.add(make_request("x", 3))
    driver.core.take_outputs()
    driver.add(make_request("y", 3, max_tokens=1))
    driver.run()
    assert driver.finished["y"].finish_reason == "length"


# ---------------------------------------------------------------- request errors


def test_duplicate_request_id_is_an_error() -> None:
    driver = Driver(make_limits())
    driver.add(make_request("a", 5, max_tokens=3))
    driver.add(make_request("a", 9, max_tokens=3))
    infos, deltas, rejected, _ = driver.core.take_outputs()
    assert [i.request_id for i in infos] == ["a"] and deltas == []  # the first one lives on
    assert len(rejected) == 1 and rejected[0].finish_reason == "error"
    assert "already in use" in (rejected[0].error or "")
    driver.run()
    assert driver.outputs["a"] == expected_tokens("a", 3)
    assert driver.history[0].rows[0].prompt == tuple(prompt_of("a", 5))


def test_prompt_larger_than_the_cache_is_an_error() -> None:
    driver = Driver(make_limits(num_blocks=4, block_size=4))
    driver.add(make_request("big", 16))
    driver.collect()
    assert driver.finished["big"].finish_reason == "error"
    assert "KV blocks" in (driver.finished["big"].error or "")
    assert not driver.core.requests and driver.plan() == []


def test_prompt_that_just_fits_the_cache_runs() -> None:
    limits = make_limits(num_blocks=4, block_size=4, max_num_batched_tokens=8)
    driver = run_all(limits, {0: [make_request("fit", 15, max_tokens=1)]})
    assert driver.finished["fit"].finish_reason == "length"


# ---------------------------------------------------------------- preemption


TINY = make_limits(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                   max_model_len=24)


def crowded_arrivals() -> dict[int, list[TokenizedRequest]]:
    return {
        0: [make_request(rid, 5, max_tokens=10) for rid in "abc"],
        2: [make_request("d", 9, max_tokens=8), make_request("e", 2)],
        6: [make_request("f", 12, max_tokens=5)],
    }


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_preemption_finishes_every_request_with_the_same_outputs(depth: int) -> None:
    roomy = run_all(make_limits(max_model_len=24, depth=depth), crowded_arrivals())
    tiny = run_all(dataclasses.replace(TINY, depth=depth), crowded_arrivals())
    assert tiny.core.num_preemptions > 0
    assert roomy.core.num_preemptions == 0
    assert results(tiny) == results(roomy)
    assert set(results(tiny)) == set("abcdef")


def test_a_preempted_victim_is_not_planned_in_the_same_step() -> None:
    """a's decode needs a block: b (3 blocks) is preempted. It must not be planned in that very
    step, neither as if still running nor re-admitted (it would thrash): it waits a step, then
    comes back with a new slot, from token 0."""
    limits = make_limits(num_blocks=4, block_size=4, max_num_batched_tokens=8, depth=1)
    driver = Driver(limits)
    driver.add(make_request("a", 2, max_tokens=6))
    driver.add(make_request("b", 10, max_tokens=4))
    for _ in range(3):
        driver.tick()
    b = driver.core.seq("b")
    assert driver.core.allocator.num_free == 0 and len(b.blocks) == 3
    (step,) = driver.plan()
    assert driver.core.num_preemptions == 1 and b.num_preemptions == 1
    (a_row,) = step.rows
    assert a_row.request_id == "a" and a_row.token_ids == (plain_token("a", 2),)
    assert a_row.context_len == 5 and step.new_slots == ()
    assert b.blocks == [] and b.slot is None and b in driver.core.waiting
    while True:  # b comes back once blocks are free, with a new slot, at a block boundary
        driver.report()
        driver.collect()
        b_rows = [(s, r) for s in driver.plan() for r in s.rows if r.request_id == "b"]
        if b_rows:
            break
    step, b_row = b_rows[0]
    assert step.new_slots == (b_row.slot,)
    start = b_row.context_len - len(b_row.token_ids)
    assert start % limits.block_size == 0
    assert b_row.token_ids[0] == prompt_of("b", start + 1)[start]
    driver.run()
    driver.check_idle()
    assert results(driver) == {"a": (expected_tokens("a", 6), "length"),
                               "b": (expected_tokens("b", 4), "length")}


def test_a_sequence_outgrowing_the_whole_cache_finishes() -> None:
    """max_model_len allows more tokens than the cache holds: finish with 'length'."""
    limits = make_limits(num_blocks=6, block_size=4, max_model_len=64)
    for depth in (1, 2):
        driver = run_all(dataclasses.replace(limits, depth=depth), {0: [make_request("a", 5)]})
        assert driver.finished["a"].finish_reason == "length"
        assert driver.outputs["a"] == expected_tokens("a", 24 - 5)


# ---------------------------------------------------------------- soak


def random_request(rng: random.Random, rid: str) -> tuple[TokenizedRequest, int | None]:
    params = {
        "max_tokens": rng.choice([None, rng.randint(1, 30)]),
        "ignore_eos": rng.random() < 0.2,
        "stop_token_ids": [STOP] if rng.random() < 0.3 else [],
    }
    stop_at = rng.choice([None, None, rng.randint(0, 25)])
    return make_request(rid, rng.randint(1, 40), **params), stop_at


def soak_plan(seed: int) -> tuple[dict[int, list[TokenizedRequest]], dict[int, list[str]],
                                  TokenFn]:
    rng = random.Random(seed)
    arrivals: dict[int, list[TokenizedRequest]] = {}
    aborts: dict[int, list[str]] = {}
    stops: dict[str, tuple[int, int]] = {}
    for n in range(60):
        rid = f"r{n}"
        req, stop_at = random_request(rng, rid)
        tick = rng.randint(0, 250)
        arrivals.setdefault(tick, []).append(req)
        if stop_at is not None:
            stops[rid] = (stop_at, rng.choice([EOS, STOP]))
        if rng.random() < 0.25:
            aborts.setdefault(max(0, tick + rng.randint(-3, 40)), []).append(rid)
    return arrivals, aborts, stops_at(stops)


def check_soak_outputs(driver: Driver, arrivals: dict[int, list[TokenizedRequest]],
                       token_fn: TokenFn) -> None:
    requests = [r for reqs in arrivals.values() for r in reqs]
    assert set(driver.finished) == {r.request_id for r in requests}
    for req in requests:
        out = driver.outputs.get(req.request_id, [])
        assert out == expected_tokens(req.request_id, len(out), token_fn)
        reason = driver.finished[req.request_id].finish_reason
        assert reason in ("stop", "length", "abort")
        if reason == "stop":
            assert out[-1] in (EOS, STOP)
        seq = driver.seqs[req.request_id]
        if seq is not None:
            assert out == seq.output_ids


@pytest.mark.parametrize("num_blocks", [14, 40])  # a thrashing cache, a roomier one
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("depth", [1, 2])
def test_soak(seed: int, depth: int, num_blocks: int) -> None:
    arrivals, aborts, token_fn = soak_plan(seed)
    limits = make_limits(num_blocks=num_blocks, block_size=4, max_num_seqs=5,
                         max_num_batched_tokens=16, max_model_len=48, depth=depth)
    driver = Driver(limits, token_fn)
    driver.run(arrivals, aborts)
    driver.check_idle()
    check_soak_outputs(driver, arrivals, token_fn)
    assert len(driver.history) > 200


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_soak_without_aborts_is_the_same_at_any_depth(seed: int) -> None:
    arrivals, _, token_fn = soak_plan(seed)
    limits = make_limits(num_blocks=14, block_size=4, max_num_seqs=5,
                         max_num_batched_tokens=16, max_model_len=48)
    runs = [run_all(dataclasses.replace(limits, depth=d), arrivals, token_fn) for d in (1, 2)]
    assert results(runs[0]) == results(runs[1])
    assert runs[0].core.num_preemptions > 0 and runs[1].core.num_preemptions > 0
