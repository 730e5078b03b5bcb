"""Issue 55's scheduler side, with no processes: with P pipeline stages the core keeps up to
P x depth steps in flight, and no step k carries a sequence whose sample is still in one of
steps k - P + 1 .. k - 1 (the first stage would wait for it), but where nothing else could
run; the running sequences take turns in P sets within a row of each other's size; and every
request ends with the tokens one stage gives it."""

from __future__ import annotations

import dataclasses
import random

import pytest
from scheduler_driver import (
    STOP,
    Driver,
    DriverLimits,
    Step,
    TokenFn,
    make_limits,
    make_request,
    plain_token,
    results,
    run_all,
    stops_at,
)

from ipc.config import EngineLimits
from ipc.errors import ConfigError
from ipc.messages import TokenizedRequest
from stages.scheduler.core import Scheduler
from stages.scheduler.planned import PlannedStep


class PipelineDriver(Driver):
    """The harness's driver, which also notes which steps were in flight beside each one as it
    was planned, and checks their ring slots and number there."""

    def __init__(self, limits: DriverLimits, token_fn: TokenFn = plain_token) -> None:
        super().__init__(limits, token_fn)
        self.inflight_at: dict[int, list[int]] = {}  # step id -> ids in flight, it included
        self.most_inflight = 0

    def plan(self) -> list[Step]:
        planned = super().plan()
        # Nothing reports while plan() runs: what was in flight as a step was planned is what
        # is in flight now, up to it.
        inflight = list(self.core.inflight)
        for step in planned:
            beside = [s for s in inflight if s.step_id <= step.step_id]
            slots = [s.ring_slot for s in beside]
            assert len(set(slots)) == len(slots), f"ring slots collide: {slots}"
            assert all(0 <= s < self.core.limits.num_ring_slots for s in slots)
            assert len(beside) <= self.limits.max_inflight
            self.inflight_at[step.step_id] = [s.step_id for s in beside]
            self.most_inflight = max(self.most_inflight, len(beside))
        return planned


def bubble_rows(driver: PipelineDriver, stages: int) -> dict[int, tuple[int, int]]:
    """Per step: (rows whose placeholder is sampled by one of the P - 1 steps before it,
    which were then in flight beside it; all its rows)."""
    last_sampled: dict[str, int] = {}
    found: dict[int, tuple[int, int]] = {}
    for step in driver.history:
        k = step.step_id
        waits = 0
        for row in step.rows:
            if -1 in row.token_ids:
                source = last_sampled[row.request_id]
                assert source in driver.inflight_at[k]  # (a placeholder's step is in flight)
                waits += k - source < stages
        for row in step.rows:
            if row.do_sample:
                last_sampled[row.request_id] = k
        found[k] = (waits, len(step.rows))
    return found


def sampling_ids(step: Step) -> list[str]:
    """The requests a step samples: its set (prompt chunks short of their end join none)."""
    return [r.request_id for r in step.rows if r.do_sample]


def assert_no_bubble_but_fallback(driver: PipelineDriver, stages: int) -> None:
    """(a): a step holds a row that waits on the pipeline only where every row of it does
    (nothing else was ready: the fallback)."""
    for k, (waits, num_rows) in bubble_rows(driver, stages).items():
        assert waits in (0, num_rows), f"step {k}: {waits} of {num_rows} rows wait"


def pipeline_limits(stages: int, depth: int, **overrides: object) -> DriverLimits:
    base = dict(num_blocks=400, block_size=4, max_num_seqs=12, max_num_batched_tokens=64,
                max_model_len=96, depth=depth, pipeline_stages=stages)
    return make_limits(**{**base, **overrides})


def run_pipeline(limits: DriverLimits, arrivals: dict[int, list[TokenizedRequest]],
                 token_fn: TokenFn = plain_token) -> PipelineDriver:
    driver = run_all(limits, arrivals, token_fn, PipelineDriver)
    assert isinstance(driver, PipelineDriver)
    return driver


def random_arrivals(seed: int, num: int = 40) -> tuple[dict[int, list[TokenizedRequest]],
                                                      TokenFn]:
    """Requests of random prompt and output lengths arriving over the first 60 ticks, some
    ending on a stop id."""
    rng = random.Random(seed)
    arrivals: dict[int, list[TokenizedRequest]] = {}
    stops: dict[str, tuple[int, int]] = {}
    for n in range(num):
        rid = f"r{n}"
        arrivals.setdefault(rng.randint(0, 60), []).append(
            make_request(rid, rng.randint(1, 30), max_tokens=rng.randint(1, 40),
                         stop_token_ids=[STOP]))
        if rng.random() < 0.3:
            stops[rid] = (rng.randint(0, 30), STOP)
    return arrivals, stops_at(stops)


# ---------------------------------------------------------------- limits


def test_limits_count_every_stage_in_flight() -> None:
    one = EngineLimits(4, 32, 4, 64, 1000, depth=2)
    assert (one.pipeline_stages, one.max_inflight, one.num_ring_slots) == (1, 2, 3)
    four = dataclasses.replace(one, pipeline_stages=4, depth=3)
    assert (four.max_inflight, four.num_ring_slots) == (12, 13)
    with pytest.raises(ConfigError, match="pipeline_stages must be at least 1"):
        dataclasses.replace(one, pipeline_stages=0)


def test_auto_depth_keeps_each_set_two_deep_to_start() -> None:
    """auto: each of the P sets runs 2 deep until the shell sees short steps (then 3), so
    2 P steps are in flight; the rings have a slot more than 3 P."""
    limits = dataclasses.replace(pipeline_limits(3, 3).engine, auto_depth=True)
    core = Scheduler(limits, 400)
    for n in range(12):
        core.add_request(make_request(f"r{n}", 3, max_tokens=20))
    while core.schedule() is not None:
        pass
    assert core.depth == 2 and len(core.inflight) == 2 * 3
    core.depth = 3  # (what process.py sets from pacing.py RunAheadDepth)
    while core.schedule() is not None:
        pass
    assert len(core.inflight) == 3 * 3 and len(core.free_ring_slots) == 1


# ---------------------------------------------------------------- random workloads


@pytest.mark.parametrize("num_blocks", [40, 400])  # a thrashing cache, a roomy one
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("stages", [2, 4])
def test_random_requests_match_one_stage_and_leave_no_bubble(seed: int, depth: int,
                                                             stages: int,
                                                             num_blocks: int) -> None:
    arrivals, token_fn = random_arrivals(seed)
    limits = pipeline_limits(stages, depth, num_blocks=num_blocks, max_model_len=72)
    staged = run_pipeline(limits, arrivals, token_fn)
    single = run_pipeline(dataclasses.replace(limits, pipeline_stages=1), arrivals, token_fn)
    # (c) the same tokens and finish reasons as one stage
    assert set(staged.finished) == {r.request_id for rs in arrivals.values() for r in rs}
    assert results(staged) == results(single)
    # (a) and (e)
    assert_no_bubble_but_fallback(staged, stages)
    assert staged.most_inflight == stages * depth
    assert staged.core.num_preemptions > 0 or num_blocks > 40


def steady_windows(history: list[Step], stages: int) -> list[list[Step]]:
    """Runs of P steps of decodes only, in which the same sequences (P or more) take part as
    in the P steps before them, which are decodes too: nothing joins, leaves or prefills."""
    windows = []
    for end in range(2 * stages, len(history) + 1):
        before = history[end - 2 * stages:end - stages]
        window = history[end - stages:end]
        if any(len(r.token_ids) != 1 or not r.do_sample
               for s in before + window for r in s.rows):
            continue
        seqs = {r.request_id for s in window for r in s.rows}
        if len(seqs) >= stages and seqs == {r.request_id for s in before for r in s.rows}:
            windows.append(window)
    return windows


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("stages", [2, 4])
def test_sets_are_balanced_once_steady(seed: int, depth: int, stages: int) -> None:
    """(b) on random requests: in P steps of steady decoding every sequence runs once, and
    the steps' row counts are within one of each other."""
    arrivals, token_fn = random_arrivals(seed, num=60)
    driver = run_pipeline(pipeline_limits(stages, depth), arrivals, token_fn)
    windows = steady_windows(driver.history, stages)
    assert len(windows) > 10  # (the check below is not vacuous)
    for window in windows:
        keys = [r.request_id for s in window for r in s.rows]
        assert len(keys) == len(set(keys))
        sizes = [len(s.rows) for s in window]
        assert max(sizes) - min(sizes) <= 1, [s.step_id for s in window]


@pytest.mark.parametrize("num_seqs", [5, 7, 8, 9, 12])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("stages", [2, 4])
def test_equal_requests_split_into_even_sets(num_seqs: int, depth: int, stages: int) -> None:
    """(b) from the start: requests that arrive together split into P sets of N // P or
    N // P + 1 sequences (a set: the rows that sample), taken in turn with no row ever
    waiting on the pipeline, and their first P steps admit them all."""
    arrivals = {0: [make_request(f"r{n}", 6, max_tokens=30) for n in range(num_seqs)]}
    driver = run_pipeline(pipeline_limits(stages, depth), arrivals)
    history = driver.history
    small, large = num_seqs // stages, -(-num_seqs // stages)
    firsts = [sampling_ids(s) for s in history[:stages]]
    assert sorted(r for ids in firsts for r in ids) == sorted(f"r{n}" for n in range(num_seqs))
    assert sorted(len(ids) for ids in firsts) == sorted(
        [large] * (num_seqs % stages) + [small] * (stages - num_seqs % stages))
    # Until the first set ends, each step is the set of the step P before it.
    last_step = {r.request_id: s.step_id for s in history for r in s.rows}
    steady = [s for s in history if s.step_id < min(last_step.values())]
    assert len(steady) > 4 * stages
    for s in steady[stages:]:
        assert sampling_ids(s) == sampling_ids(history[s.step_id - stages])
    assert all(waits == 0 for waits, _ in bubble_rows(driver, stages).values())
    assert driver.most_inflight == stages * depth


def test_a_decoding_set_carries_the_other_sets_prompt_chunks() -> None:
    """Where a set's rows all decode while prompts are still to compute, the step's budget
    left over goes to those prompts' chunks short of their last token, which sample nothing:
    every step before the last prompt's last chunk carries the whole budget (before, such a
    step carried a row per sequence, and the first stage waited for the long step's samples
    after it), the sets stay as they were, and the tokens are one stage's."""
    arrivals = {0: [make_request(f"r{n}", 40, max_tokens=12) for n in range(8)]}
    overrides = dict(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64)
    driver = run_pipeline(pipeline_limits(2, 2, **overrides), arrivals)
    first_sample: dict[str, int] = {}
    for s in driver.history:
        for rid in sampling_ids(s):
            first_sample.setdefault(rid, s.step_id)
    prompts_done = max(first_sample.values())
    assert prompts_done >= 8
    assert all(sum(len(r.token_ids) for r in s.rows) == 32
               for s in driver.history[:prompts_done])
    # (a set of 4 decodes with prompt chunks beside it: 4 tokens a step, before)
    assert any(len(sampling_ids(s)) == 4 and len(s.rows) > 4
               for s in driver.history[:prompts_done])
    assert_no_bubble_but_fallback(driver, 2)
    assert results(driver) == results(run_pipeline(pipeline_limits(1, 2, **overrides),
                                                   arrivals))


def noting_free_blocks(driver: PipelineDriver) -> dict[int, int]:
    """Each step the driver's core plans from now on: its cache's free blocks as it began."""
    free_at: dict[int, int] = {}
    core = driver.core
    schedule = core.schedule

    def noting() -> PlannedStep | None:
        free = core.kv.allocator.num_free
        step = schedule()
        if step is not None:
            free_at[step.step_id] = free
        return step

    core.schedule = noting  # type: ignore[method-assign]
    return free_at


def test_a_prompt_admitted_short_of_its_end_fits_as_a_whole_chunk() -> None:
    """A prompt admitted beside a capped set stops short of its last token, but only where
    its whole chunk would fit the free blocks (else the last token, planned next, would
    preempt for the block the shorter chunk saved): under random arrivals in a small cache,
    each admission's free blocks, noted as its step was planned, cover the whole chunk."""
    short = 0
    for seed in range(40):
        rng = random.Random(seed)
        arrivals: dict[int, list[TokenizedRequest]] = {}
        for n in range(12):  # (bursts: more arrive together than a set's rows)
            arrivals.setdefault(rng.choice([0, 0, 0, 4, 9]), []).append(
                make_request(f"r{n}", rng.randint(2, 12), max_tokens=rng.randint(1, 12)))
        limits = pipeline_limits(2, 2, num_blocks=rng.randint(6, 14),
                                 max_num_batched_tokens=32)
        driver = PipelineDriver(limits)
        free_at = noting_free_blocks(driver)
        driver.run(arrivals)
        driver.check_idle()
        prompts = {r.request_id: len(r.prompt_token_ids) for reqs in arrivals.values()
                   for r in reqs}
        seen: set[str] = set()
        for step in driver.history:
            for row in step.rows:
                rid = row.request_id
                if rid in seen:
                    continue
                seen.add(rid)
                whole = min(prompts[rid], 32)
                if not row.do_sample and len(row.token_ids) == prompts[rid] - 1 < 32:
                    short += 1
                    assert free_at[step.step_id] >= -(-whole // 4), (seed, rid)
    assert short  # (some were admitted so)


def test_sets_even_out_after_one_empties() -> None:
    """When one set's sequences all finish and others join, the sets even out again: the
    newcomers and any leftovers take the empty turn."""
    stages = 2
    first = [make_request(f"a{n}", 4, max_tokens=4 if n % 2 == 0 else 40) for n in range(8)]
    later = [make_request(f"b{n}", 4, max_tokens=30) for n in range(4)]
    driver = run_pipeline(pipeline_limits(stages, 2), {0: first, 12: later})
    assert_no_bubble_but_fallback(driver, stages)
    windows = steady_windows(driver.history, stages)
    assert windows
    for window in windows:
        sizes = [len(s.rows) for s in window]
        assert max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------- fewer sequences than stages


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("stages", [2, 4])
def test_one_request_still_runs_ahead(depth: int, stages: int) -> None:
    """(d): a lone sequence waits on itself in every step (nothing else could fill the
    pipeline), but it is still planned P x depth steps ahead, and gets the same tokens."""
    arrivals = {0: [make_request("a", 5, max_tokens=40)]}
    driver = run_pipeline(pipeline_limits(stages, depth), arrivals)
    assert driver.most_inflight == stages * depth
    decodes = driver.history[1:]
    assert [len(s.rows) for s in decodes] == [1] * 39
    assert all(s.rows[0].token_ids == (-1,) for s in decodes[1:])
    single = run_pipeline(pipeline_limits(1, depth), arrivals)
    assert results(driver) == results(single)


def test_fewer_sequences_than_stages_take_turns() -> None:
    """Two sequences over four stages: the fallback plans the one whose sample is the oldest,
    so both keep running, one per step, in turn."""
    arrivals = {0: [make_request("a", 3, max_tokens=20), make_request("b", 3, max_tokens=20)]}
    driver = run_pipeline(pipeline_limits(4, 2), arrivals)
    names = [sampling_ids(s) for s in driver.history]
    assert names[:6] == [["a"], ["b"], ["a"], ["b"], ["a"], ["b"]]
    assert_no_bubble_but_fallback(driver, 4)
    assert results(driver) == results(run_pipeline(pipeline_limits(1, 2), arrivals))


def test_a_lone_stream_runs_ahead_beside_a_request_short_of_blocks() -> None:
    """A waiting request that has a slot but not the blocks it needs counts among the sets,
    yet cannot run: the held-back stream is planned anyway, P x depth steps ahead, rather than
    one step per round trip."""
    arrivals = {0: [make_request("a", 40, max_tokens=6)], 1: [make_request("b", 30,
                                                                           max_tokens=4)]}
    limits = pipeline_limits(2, 2, num_blocks=12)
    driver = run_pipeline(limits, arrivals)
    alone = [s.step_id for s in driver.history
             if [r.request_id for r in s.rows] == ["a"] and s.rows[0].token_ids == (-1,)]
    assert len(alone) >= 4
    assert max(len(driver.inflight_at[k]) for k in alone) == 4
    assert results(driver) == results(run_pipeline(pipeline_limits(1, 2, num_blocks=12),
                                                   arrivals))
