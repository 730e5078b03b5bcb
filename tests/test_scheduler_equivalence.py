"""The scheduler core's shortened per-step paths (issue 52) against the straightforward ones
(scheduler_reference.py): random workloads (EOS, stop token ids, min_tokens, max_tokens,
n > 1, logprobs, prompt logprobs, structured outputs, grammar failures, preemption, aborts,
stop strings, n-gram drafts) go through both, and every planned step, what it writes into a
ring slot, and every batch of outputs sent to the detokenizers (three workers, some down at
times) must be the same."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest
from scheduler_reference import ReferenceScheduler, reference_flush, reference_write

from ipc.codec import encode
from ipc.config import EngineLimits
from ipc.messages import (
    DetokBatch,
    SamplingParams,
    SchedulerStats,
    StructuredOutputs,
    TokenColumns,
    TokenizedRequest,
)
from ipc.speculative import SpeculativeConfig
from ipc.step import (
    STEP_FIELDS,
    PromptLogprobs,
    StepLogprobs,
    local_buffers,
    step_input_specs,
)
from pipeline.tools.bench_host import bare_shell
from stages.scheduler.core import Scheduler
from stages.scheduler.planned import PlannedStep
from stages.scheduler.process import SchedulerShell

EOS, STOP, VOCAB = 2, 3, 1000


def _params(rng: random.Random) -> SamplingParams:
    kw: dict[str, Any] = {"temperature": rng.choice([0.0, 1.0])}
    if rng.random() < 0.7:
        kw["max_tokens"] = rng.randint(1, 40)
    if rng.random() < 0.3:
        kw["stop_token_ids"] = rng.sample([STOP, 7, 8, 9], rng.randint(1, 3))
    if rng.random() < 0.3:
        kw["ignore_eos"] = True
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(1, 6)
    if rng.random() < 0.2:
        kw["n"] = rng.randint(2, 4)
    if rng.random() < 0.2:
        kw["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        kw["prompt_logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.1:
        kw["repetition_penalty"] = 1.1  # (no prefix-cache hits for it)
    if rng.random() < 0.1 and not kw.get("ignore_eos") and not kw.get("min_tokens"):
        kw["structured_outputs"] = StructuredOutputs(regex="[a-z]+")  # (neither allowed)
    if rng.random() < 0.2:
        kw["user"] = rng.choice(["u1", "u2"])
    if rng.random() < 0.2:
        kw["priority"] = rng.randint(0, 3)
    return SamplingParams(**kw)


def _request(rng: random.Random, rid: str, prompts: list[list[int]]) -> TokenizedRequest:
    if prompts and rng.random() < 0.4:  # a shared prefix: prefix-cache hits
        base = rng.choice(prompts)
        prompt = base[:rng.randint(1, len(base))] + [
            rng.randrange(10, VOCAB) for _ in range(rng.randint(0, 6))]
    else:
        prompt = [rng.randrange(10, VOCAB) for _ in range(rng.randint(1, 30))]
    prompts.append(prompt)
    p = _params(rng)
    return TokenizedRequest(rid, rng.choice(["c1", "c2"]), prompt, p, 0.0,
                            grammar="g" if p.structured_outputs else "")


def _sampled_id(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.04:
        return EOS
    if r < 0.08:
        return rng.choice([STOP, 7, 8, 9])
    if r < 0.085:
        return -1  # the executor's grammar failed
    return rng.randrange(10, 60)  # (few distinct ids: n-gram drafts find matches)


def _step_view(step: PlannedStep) -> tuple[Any, ...]:
    rows = tuple((r.seq.request_id, r.seq.index, r.seq_slot, tuple(r.token_ids),
                  r.context_len, r.do_sample, r.num_draft, r.draft_kv, r.last_drafts,
                  r.adapter_id) for r in step.rows)
    return (step.step_id, step.ring_slot, rows, tuple(step.block_updates),
            repr(step.new_slots), tuple(step.stop_ids), tuple(step.prompt_logprobs),
            repr(step.grammars), step.num_tokens, step.is_starved, step.has_preempted,
            sorted((s.request_id, s.index) for s in step.members))


def _results(step: PlannedStep, rng: random.Random) -> tuple[list[int], StepLogprobs,
                                                              PromptLogprobs | None,
                                                              list[int] | None]:
    """What a device might report for step: ids, logprobs, prompt logprobs, accepted."""
    rows = [r for r in step.rows if r.do_sample]
    n = sum(1 + r.num_draft for r in rows)
    ids = [_sampled_id(rng) for _ in range(n)]
    k = 4  # (requests ask for at most 3 alternatives)
    lps = ([rng.random() for _ in range(n)],
           [[rng.randrange(VOCAB) for _ in range(k)] for _ in range(n)],
           [[rng.random() for _ in range(k)] for _ in range(n)])
    m = len(step.prompt_logprobs)
    plps = ([rng.random() for _ in range(m)], [rng.randint(1, 9) for _ in range(m)],
            [[rng.randrange(VOCAB) for _ in range(k)] for _ in range(m)],
            [[rng.random() for _ in range(k)] for _ in range(m)]) if m else None
    accepted = [rng.randint(1, 1 + r.num_draft) for r in rows if r.num_draft]
    return ids, lps, plps, accepted or None


class _Detokenizers:
    """Three detokenizer workers, some of them down: what each was sent, encoded (bytes:
    NaN logprobs compare equal)."""

    def __init__(self, up: set[int]) -> None:
        self.up, self.sent = up, []

    def to_detokenizer(self, rank: int, msg: DetokBatch) -> bool:
        self.sent.append((rank, encode(as_deltas(msg))))
        return rank in self.up

    def detokenizer_up(self, rank: int) -> bool:
        return rank in self.up

    def detokenizers_for(self, reply_to: str) -> list[int]:
        return sorted(self.up)


def as_deltas(msg: DetokBatch) -> DetokBatch:
    """msg with its steady deltas' columns as TokenDeltas among the rest, all in (request,
    sample) order: a sample has one delta in a batch, and their order carries nothing."""
    deltas = sorted(msg.deltas + msg.plain.deltas(), key=lambda d: (d.request_id, d.index))
    return dataclasses.replace(msg, deltas=deltas, plain=TokenColumns())


def _flush(shells: list[SchedulerShell], up: set[int]) -> None:
    """Both shells send their outputs (the real _flush_outputs, the reference's)."""
    shells[0]._flush_outputs()
    reference_flush(shells[1])
    sent = [shell.peers.sent for shell in shells]
    # (a batch a worker: which worker's goes first carries nothing either)
    assert sorted(sent[0]) == sorted(sent[1]) and shells[0]._pins == shells[1]._pins
    assert [r for _, r in shells[0]._unpin] == [r for _, r in shells[1]._unpin]
    for s in sent:
        s.clear()


def _stats(core: Scheduler) -> tuple[Any, ...]:
    s = core.stats()
    return (s.num_free_blocks, s.num_free_slots, s.num_waiting, s.num_running,
            s.num_requests, s.num_preemptions, s.finished, s.generation_tokens,
            s.prefix_cache_hits, s.spec_num_accepted_tokens, s.spec_num_draft_tokens)


def _drive(seed: int, limits: EngineLimits, num_blocks: int,
           speculative: SpeculativeConfig | None, ticks: int) -> SchedulerStats:
    """Runs one workload through both cores, checking them against each other at every
    tick; returns the real core's final accounting."""
    rng = random.Random(seed)
    cores = [Scheduler(limits, num_blocks, speculative=speculative),
             ReferenceScheduler(limits, num_blocks, speculative=speculative)]
    bufs = [local_buffers(step_input_specs(limits)) for _ in cores]
    up = {0, 1, 2}
    shells = [bare_shell(core, _Detokenizers(up)) for core in cores]
    prompts: list[list[int]] = []
    next_id = 0
    for tick in range(ticks):
        calls: list[tuple[str, tuple[Any, ...]]] = []
        for _ in range(rng.choice([0, 0, 0, 0, 0, 1, 1, 3]) if tick < ticks - 40 else 0):
            calls.append(("add_request", (_request(rng, f"r{next_id}", prompts),)))
            next_id += 1
        live = sorted(cores[0].requests)
        if live and rng.random() < 0.05:
            calls.append(("abort", (rng.choice(live),)))
        if live and rng.random() < 0.03:  # a detokenizer's stop string
            calls.append(("stop_sample", (rng.choice(live), rng.randint(0, 1))))
        for name, args in calls:
            for core in cores:
                getattr(core, name)(*args)
        for _ in range(rng.randint(0, 2)):  # report the oldest steps
            if not cores[0].inflight:
                break
            results = _results(cores[0].inflight[0], rng)
            for core in cores:
                step = core.inflight[0]
                want_lps = any(r.seq.params.logprobs is not None for r in step.rows)
                core.on_sampled(step.step_id, results[0], results[1] if want_lps else None,
                                results[2], results[3])
        steps = [core.schedule() for core in cores]
        assert _step_view(steps[0]) == _step_view(steps[1]) if steps[0] else steps[1] is None
        if steps[0] is not None and steps[1] is not None:
            plans = [steps[0].write(bufs[0]), reference_write(steps[1], bufs[1])]
            assert plans[0] == plans[1]
            for f in STEP_FIELDS:
                n = getattr(plans[0], f.count.plan_field)
                assert np.array_equal(bufs[0][f.name][:n], bufs[1][f.name][:n]), f.name
            assert np.array_equal(bufs[0]["stamp"], bufs[1]["stamp"])
        if rng.random() < 0.05:  # a worker stops or comes back
            up ^= {rng.randrange(3)}
        _flush(shells, up)
        assert _stats(cores[0]) == _stats(cores[1])
    while cores[0].inflight:  # the end: every step reported
        results = _results(cores[0].inflight[0], rng)
        for core in cores:
            core.on_sampled(core.inflight[0].step_id, *results)
    _flush(shells, up)
    assert _stats(cores[0]) == _stats(cores[1])
    return cores[0].stats()


def _limits(**kw: Any) -> EngineLimits:
    base = dict(max_num_seqs=8, max_num_batched_tokens=32, block_size=4, max_model_len=64,
                vocab_size=VOCAB, eos_token_ids=(EOS,), depth=2)
    return EngineLimits(**(base | kw))  # type: ignore[arg-type]


REASONS = {"stop", "length", "abort", "error"}


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_plan_and_answer_as_the_reference(seed: int) -> None:
    # depth 1, 2 and 3; few blocks (preemption) and more (prefix-cache hits kept); a short
    # context (sequences that end at max_model_len)
    limits = _limits(depth=1 + seed % 3, max_model_len=48 if seed % 4 == 0 else 64)
    stats = _drive(seed, limits, num_blocks=40 if seed % 4 else 120, speculative=None,
                   ticks=300)
    assert REASONS <= set(stats.finished) and stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_with_drafts_plan_and_answer_as_the_reference(seed: int) -> None:
    spec = SpeculativeConfig("ngram", 3, 3, 1)
    limits = _limits(depth=2 + seed % 2, num_speculative_tokens=3)
    stats = _drive(100 + seed, limits, num_blocks=60, speculative=spec, ticks=300)
    assert REASONS <= set(stats.finished) and stats.spec_num_accepted_tokens > 0
