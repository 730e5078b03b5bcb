"""n > 1: the samples of one prompt share its full KV blocks (reference counts), each has its
own randomness and its own output, and every block is freed when they end."""

from __future__ import annotations

from pathlib import Path

from scheduler_driver import Driver, expected_tokens, make_limits, prompt_of, sample_key

from ipc.messages import SamplingParams, TokenizedRequest
from ipc.sampling import sample_seed
from stages.inprocess import InProcessEngine


def test_samples_share_the_prompt_blocks_and_free_them_all() -> None:
    limits = make_limits(num_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                         depth=2)
    driver = Driver(limits)
    driver.add(TokenizedRequest("r", "c", prompt_of("r", 18), SamplingParams(max_tokens=5, n=4),
                                0.0))
    shared_seen = False
    while driver.core.requests or driver.pending:
        driver.tick()
        seqs = driver.core.requests.get("r", [])
        running = [s for s in seqs if s.blocks]
        if len(running) == 4:
            first = running[0].blocks[:4]
            assert all(s.blocks[:4] == first for s in running)  # 16 of 18 prompt tokens
            assert all(driver.core.allocator.ref_count(b) == 4 for b in first)
            assert len({s.blocks[4] for s in running}) == 4  # the partial block is each's own
            shared_seen = True
    driver.collect()
    assert shared_seen
    driver.check_idle()
    for i in range(4):
        key = sample_key("r", i)
        assert driver.outputs[key] == expected_tokens(key, 5)
        assert driver.finished[key].finish_reason == "length"
        assert driver.finished[key].num_cached_tokens == (0 if i == 0 else 16)


def test_abort_ends_every_sample_even_those_not_admitted() -> None:
    limits = make_limits(num_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    driver = Driver(limits)
    driver.add(TokenizedRequest("r", "c", prompt_of("r", 30), SamplingParams(n=3), 0.0))
    driver.tick()  # sample 0 is prefilling, 1 and 2 wait for it
    assert len(driver.core.requests["r"]) == 3
    driver.abort("r")
    driver.run()
    driver.check_idle()
    assert {driver.finished[sample_key("r", i)].finish_reason for i in range(3)} == {"abort"}


def test_one_sample_can_stop_while_the_others_run() -> None:
    limits = make_limits(num_blocks=40, block_size=4, max_num_seqs=8)
    driver = Driver(limits)
    driver.add(TokenizedRequest("r", "c", prompt_of("r", 6), SamplingParams(max_tokens=12, n=2),
                                0.0))
    for _ in range(6):
        driver.tick()
    driver.core.stop_sample("r", 1)  # as a detokenizer that found a stop string
    driver.run()
    driver.check_idle()
    assert driver.finished["r#1"].finish_reason == "stop"
    assert driver.finished["r"].finish_reason == "length" and len(driver.outputs["r"]) == 12
    assert len(driver.outputs["r#1"]) < 12


def test_sample_seeds_differ_and_keep_sample_zero() -> None:
    assert sample_seed(None, 3) is None
    assert sample_seed(5, 0) == 5
    seeds = {sample_seed(5, i) for i in range(64)}
    assert len(seeds) == 64 and all(-(2**63) <= s < 2**63 for s in seeds)  # type: ignore[operator]


def test_real_samples_differ_and_are_reproducible(tiny_model_dir: Path) -> None:
    engine = InProcessEngine(str(tiny_model_dir), max_num_seqs=8)
    prompt = list(range(5, 30))
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, n=4, ignore_eos=True)
    one = engine.run([("a", prompt, params)])
    two = engine.run([("b", prompt, params), ("other", prompt[:7], SamplingParams(
        max_tokens=20, temperature=1.0, ignore_eos=True))])
    samples = [one["a", i].token_ids for i in range(4)]
    assert len({tuple(s) for s in samples}) == 4
    assert samples == [two["b", i].token_ids for i in range(4)]
    assert [one["a", i].num_cached_tokens for i in range(4)] == [0, 24, 24, 24]
    alone = engine.run([("z", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=11,
                                                     ignore_eos=True))])
    assert alone["z", 0].token_ids == samples[0]  # sample 0 uses the request's own seed
    assert engine.scheduler.allocator.num_free == engine.scheduler.num_blocks


def test_ending_sample_zero_before_admission_releases_its_siblings() -> None:
    driver = Driver(make_limits(num_blocks=40, block_size=4, max_num_seqs=8))
    driver.add(TokenizedRequest("r", "c", prompt_of("r", 6), SamplingParams(max_tokens=3, n=3),
                                0.0))
    driver.core.stop_sample("r", 0)  # only sample 0, while all three are still queued
    driver.run()
    driver.check_idle()
    assert driver.finished["r"].finish_reason == "stop"
    assert [len(driver.outputs["r#1"]), len(driver.outputs["r#2"])] == [3, 3]
