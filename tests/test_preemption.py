"""Preemption when KV blocks run out: victims are recomputed with their generated tokens kept,
greedy outputs equal the unconstrained run, a just-resumed sequence is not the next victim,
a prompt that can never fit is refused, and a cache of a few blocks never deadlocks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from scheduler_driver import Driver, make_limits, make_request, results, run_all
from tiny_model import hf_greedy

from ipc.messages import SamplingParams
from ipc.model_info import ModelInfo
from stages.inprocess import InProcessEngine


def wave(count: int = 8) -> dict[int, list]:
    return {i // 2: [make_request(f"r{i}", 3 + 5 * (i % 3), max_tokens=14)] for i in range(count)}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [7, 9, 13])  # 7 blocks: the longest just fits
def test_a_tiny_cache_finishes_everything_with_the_same_outputs(depth: int,
                                                                num_blocks: int) -> None:
    roomy = run_all(make_limits(depth=depth), wave())
    tiny = run_all(make_limits(num_blocks=num_blocks, block_size=4, depth=depth), wave())
    assert tiny.core.num_preemptions > 0 and roomy.core.num_preemptions == 0
    assert results(tiny) == results(roomy)


@pytest.mark.parametrize("c_just_resumed", [False, True])
def test_a_just_resumed_sequence_is_not_the_next_victim(c_just_resumed: bool) -> None:
    """a, b, c fill the cache; the next block a needs preempts the latest, c, unless c was
    just re-admitted after a preemption and has not produced a token since: then b goes."""
    limits = make_limits(num_blocks=7, block_size=4, max_num_seqs=3, max_num_batched_tokens=64,
                         depth=1)
    driver = Driver(limits)
    for rid in ("a", "b", "c"):
        driver.add(make_request(rid, 7, max_tokens=16))
    driver.tick()  # all three admitted: 2 blocks each, 1 free
    c = driver.core.seq("c")
    if c_just_resumed:  # as _admit marks a re-admitted victim
        c.resumed_at = len(c.output_ids) + 1  # its token in flight is not new yet
    while driver.core.num_preemptions == 0:
        driver.tick()
        if c_just_resumed:
            c.resumed_at = len(c.output_ids)
    victim = next(s for seqs in driver.core.requests.values() for s in seqs
                  if s.num_preemptions)
    assert victim.request_id == ("b" if c_just_resumed else "c")
    driver.run()
    driver.check_idle()


def test_is_just_resumed_guards_only_until_a_new_token() -> None:
    driver = Driver(make_limits(num_blocks=8, block_size=4, max_num_seqs=3,
                                max_num_batched_tokens=64, depth=1))
    driver.add(make_request("a", 4, max_tokens=16))
    seq = driver.core.requests["a"][0]
    assert not seq.is_just_resumed
    seq.resumed_at = len(seq.output_ids)
    assert seq.is_just_resumed
    seq.output_ids.append(7)
    assert not seq.is_just_resumed


def test_a_prompt_that_can_never_fit_is_refused_not_retried() -> None:
    driver = Driver(make_limits(num_blocks=4, block_size=4))
    driver.add(make_request("big", 16))
    driver.add(make_request("ok", 5, max_tokens=3))
    driver.run()
    driver.check_idle()
    (rejected,) = driver.rejected
    assert rejected.request_id == "big" and rejected.finish_reason == "error"
    assert "needs 5 KV blocks but the cache has only 4" in (rejected.error or "")
    assert driver.finished["ok"].finish_reason == "length"


def test_one_block_cache_never_deadlocks() -> None:
    arrivals = {0: [make_request(f"r{i}", 2, max_tokens=6) for i in range(5)]}
    driver = run_all(make_limits(num_blocks=2, block_size=4, max_num_seqs=4, depth=2), arrivals)
    assert {d.finish_reason for d in driver.finished.values()} == {"length"}
    driver = run_all(dataclasses.replace(make_limits(num_blocks=1, block_size=4), depth=1),
                     {0: [make_request("x", 2, max_tokens=6)]})
    assert driver.finished["x"].finish_reason == "length"
    assert len(driver.outputs["x"]) == 2  # the sequence outgrows the cache: 4 tokens at most


def test_real_model_under_a_tiny_cache_gives_greedy_outputs(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(t)["input_ids"] for t in ("one two three", "The paged cache is small.",
                                             "Preempt me, then bring me back", "x y", "zzz",
                                             "Grüße 🚀")]
    expected = hf_greedy(tiny_model_dir, prompts, max_new_tokens=20)
    eos = ModelInfo.from_dir(tiny_model_dir).eos_token_ids
    for depth in (1, 2):
        engine = InProcessEngine(str(tiny_model_dir), block_size=4, kv_cache_memory=14 * 2048,
                                 depth=depth, max_num_seqs=6, eos_token_ids=eos)
        got = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
        assert got == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.allocator.num_free == engine.scheduler.num_blocks
