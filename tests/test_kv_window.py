"""A sliding window on every layer (Mistral's, Phi-3's): the scheduler gives back a running
sequence's KV blocks once they fall out of the window (stages/scheduler/kv_manager.py trim).
The KV manager alone with small block counts, then the scheduler core under the fake executor
(tests/scheduler_driver.py), which reads back what each row's queries see, from its first
query's window on, and checks after every move that no page a later query may read went
back."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import pytest
from scheduler_driver import (
    Driver,
    expected_tokens,
    make_limits,
    make_request,
    results,
    run_all,
    sample_key,
)

from ipc.arch import ArchSpec, AttentionKind
from ipc.config import EngineLimits, PipelineConfig, SchedulerConfig
from ipc.messages import SamplingParams, TokenizedRequest
from ipc.model_info import ModelInfo
from ipc.speculative import SpeculativeConfig
from stages.scheduler.core import Scheduler
from stages.scheduler.kv_manager import KVManager
from stages.scheduler.planned import PlannedStep
from stages.scheduler.sequence import NO_BLOCK, SeqStatus, Sequence

BS = 4  # tokens a block
WINDOW = 8  # a query at p reads keys p - 7 .. p: at most 3 pages of 4


def make_kv(num_blocks: int = 16, window: int | None = WINDOW) -> KVManager:
    return KVManager(num_blocks, BS, 4, 64, window)


def never(seq: Sequence) -> None:
    raise AssertionError(f"{seq.request_id} preempted")


def admitted(kv: KVManager, rid: str, prompt: list[int], hits: list[int] | None = None
             ) -> Sequence:
    """A sample of `prompt` admitted (reusing `hits`) with its prompt computed."""
    seq = Sequence(rid, prompt, SamplingParams(), 0.0)
    seq.move_to(SeqStatus.RUNNING)
    step = PlannedStep(0)
    kv.admit(step, seq, hits or [])
    assert kv.grow(step, seq, len(prompt), never)
    seq.num_computed = len(prompt)
    return seq


def decode_to(kv: KVManager, seq: Sequence, end: int) -> None:
    """seq computes one token a step up to `end` tokens (each known at once), growing as the
    step builder does: only where a token starts a new page."""
    for pos in range(seq.num_computed, end):
        if pos >= len(seq.blocks) * BS:
            assert kv.grow(PlannedStep(pos), seq, pos + 1, never)
        seq.num_computed = pos + 1
        seq.output_ids.append(7)
        kv.register_blocks(seq)


# ---------------------------------------------------------------- the KV manager


def test_a_page_goes_back_once_no_later_query_reads_it() -> None:
    kv = make_kv()
    # A query at 10 reads keys 3..10 (page 0's last key); one at 11 reads 4..11.
    assert kv.first_read_page(10) == 0 and kv.first_read_page(11) == 1
    seq = admitted(kv, "a", list(range(10, 20)))  # 10 tokens: pages 0-2
    decode_to(kv, seq, 12)  # token 10 is page 2's; page 0 is still read by it
    assert seq.num_trimmed == 0 and seq.num_held_blocks == 3
    decode_to(kv, seq, 13)  # token 12 starts page 3: next query at 12 reads 5..12
    assert seq.num_trimmed == 1 and seq.blocks[0] == NO_BLOCK
    assert seq.num_held_blocks == 3 and len(seq.blocks) == 4  # page j is still entry j
    assert kv.allocator.num_free == 16 - 3


def test_a_sequence_far_past_its_window_holds_the_window_s_pages() -> None:
    kv = make_kv()
    seq = admitted(kv, "a", [5, 6, 7])
    decode_to(kv, seq, 200)
    # (window - 2) // BS + 2: the pages one token's window spans, and its own.
    assert kv.max_seq_blocks == kv.blocks_to_run(10**6) == 3
    assert seq.num_held_blocks <= 3 and len(seq.blocks) == 50
    assert seq.blocks[:seq.num_trimmed] == [NO_BLOCK] * seq.num_trimmed
    assert kv.allocator.num_free == 16 - seq.num_held_blocks
    kv.release(seq)
    assert kv.allocator.num_free == 16 and not seq.blocks and seq.num_trimmed == 0
    # Without a window every page is kept.
    keep = make_kv(num_blocks=64, window=None)
    decode_to(keep, admitted(keep, "a", [5, 6, 7]), 200)
    assert keep.max_seq_blocks == 50


def test_a_block_given_back_is_no_prefix_cache_hit() -> None:
    prompt = list(range(100, 116))  # 4 full pages
    for window, hits in ((None, 4), (WINDOW, 0)):
        kv = make_kv(window=window)
        first = admitted(kv, "first", prompt)
        kv.register_blocks(first)
        decode_to(kv, first, 24)
        again = Sequence("again", prompt + [9], SamplingParams(), 0.0)
        assert len(kv.cached_prefix(again)) == hits
    # (with the window: pages 0-2 went back unkeyed, handed out before cached blocks)
    assert first.num_trimmed == 3 and kv.allocator.num_cached_free == 0


def test_shared_blocks_go_back_when_no_sibling_needs_them() -> None:
    kv = make_kv()
    prompt = list(range(100, 108))  # 2 full pages
    a = admitted(kv, "r", prompt)
    kv.register_blocks(a)
    hits = kv.cached_prefix(Sequence("r", prompt, SamplingParams(), 0.0, index=1))
    assert hits == a.blocks[:1]  # (the last token is always computed)
    b = admitted(kv, "r", prompt, hits)
    shared = hits[0]
    assert kv.allocator.ref_count(shared) == 2
    decode_to(kv, a, 20)
    assert a.num_trimmed > 0 and kv.allocator.ref_count(shared) == 1  # b still reads it
    decode_to(kv, b, 20)
    assert b.num_trimmed > 0 and kv.allocator.num_free_among([shared]) == 1


def test_a_hit_before_the_window_is_not_taken() -> None:
    """A prompt whose cached prefix reaches past the window takes only the pages its window
    reads: the others stay free, and its entries are NO_BLOCK."""
    kv = make_kv(window=None)
    prompt = list(range(100, 124))  # 6 full pages
    first = admitted(kv, "first", prompt)
    kv.register_blocks(first)
    kv.release(first)  # its blocks free, keyed: cached
    windowed = make_kv(window=WINDOW)
    windowed.allocator = kv.allocator
    seq = Sequence("again", prompt + [9], SamplingParams(), 0.0)
    hits = windowed.cached_prefix(seq)
    assert len(hits) == 6
    step = PlannedStep(0)
    assert windowed.admits(step, hits, 25)
    seq.move_to(SeqStatus.RUNNING)
    windowed.admit(step, seq, hits)
    # The query at 24 reads 17..24: pages 4 and 5, and page 6 (new).
    assert seq.num_trimmed == 4 and seq.blocks[:4] == [NO_BLOCK] * 4
    assert [i for _, i, _ in step.block_updates] == [4, 5]
    assert [kv.allocator.ref_count(b) for b in hits] == [0, 0, 0, 0, 1, 1]


# ---------------------------------------------------------------- the scheduler core

WINDOWED = make_limits(window=WINDOW, block_size=BS, num_blocks=64, max_model_len=256,
                       max_num_batched_tokens=16)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_windowed_sequence_decoding_far_past_its_window_holds_few_blocks(depth: int) -> None:
    limits = dataclasses.replace(WINDOWED, depth=depth)
    driver = run_all(limits, {0: [make_request("a", 5, max_tokens=150)]})
    assert results(driver)["a"] == (expected_tokens("a", 150), "length")
    peak = driver.core.kv.max_seq_blocks
    assert peak <= WINDOW // BS + depth + 1 and peak == 3
    assert driver.core.stats().max_seq_blocks == peak
    keep = run_all(dataclasses.replace(limits, window=None),
                   {0: [make_request("a", 5, max_tokens=150)]})
    assert keep.core.kv.max_seq_blocks == -(-155 // BS)


def test_blocks_given_back_serve_another_request() -> None:
    """Two sequences of 16 and 17 pages (their computed tokens: the last sample is not fed
    back) in a cache of 8 blocks run side by side, each on the blocks the other gave back,
    without a preemption."""
    limits = dataclasses.replace(WINDOWED, num_blocks=8)
    arrivals = {0: [make_request("a", 5, max_tokens=60)],
                3: [make_request("b", 7, max_tokens=60)]}
    driver = run_all(limits, arrivals)
    assert results(driver) == {"a": (expected_tokens("a", 60), "length"),
                               "b": (expected_tokens("b", 60), "length")}
    assert driver.core.num_preemptions == 0
    assert sum(len(step.block_updates) for step in driver.history) == 16 + 17


def test_a_prompt_longer_than_the_cache_runs_on_a_windowed_model() -> None:
    limits = dataclasses.replace(WINDOWED, num_blocks=6)
    driver = run_all(limits, {0: [make_request("long", 60, max_tokens=10)]})
    assert results(driver)["long"] == (expected_tokens("long", 10), "length")
    # Its chunks are cut where their pages from the window's first would outgrow the cache.
    for step in driver.history:
        (row,) = step.rows
        start = row.context_len - len(row.token_ids)
        first = max(0, start - WINDOW + 1) // BS
        assert -(-row.context_len // BS) - first <= 6
    assert driver.core.kv.max_seq_blocks <= 6
    refused = Driver(dataclasses.replace(limits, window=None))
    refused.add(make_request("long", 60, max_tokens=10))
    refused.collect()
    assert refused.finished["long"].finish_reason == "error"


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_and_resume_on_a_windowed_model(depth: int) -> None:
    """Four short prompts start on a page each in a cache of 6 blocks and each grows to the
    3 pages of its window: some are preempted and recompute, and every output is the same
    as in a roomy cache."""
    arrivals = {0: [make_request(f"r{i}", 2 + i, max_tokens=40) for i in range(4)]}
    tiny = run_all(dataclasses.replace(WINDOWED, num_blocks=6, depth=depth,
                                       max_num_batched_tokens=8), arrivals)
    roomy = run_all(dataclasses.replace(WINDOWED, depth=depth), arrivals)
    assert tiny.core.num_preemptions > 0 and roomy.core.num_preemptions == 0
    assert results(tiny) == results(roomy)
    assert {rid: len(out) for rid, (out, _) in results(tiny).items()} == dict.fromkeys(
        ("r0", "r1", "r2", "r3"), 40)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_long_victim_recomputes_in_chunks_that_give_pages_back(depth: int) -> None:
    """A long sequence gives its one slot to a shorter request of its sender (fair
    queueing), then recomputes its prompt and 30-odd outputs in chunks of 8, giving back
    the pages behind its window as it goes."""
    limits = dataclasses.replace(WINDOWED, num_blocks=6, depth=depth, max_num_seqs=1,
                                 max_num_batched_tokens=8)
    arrivals = {0: [make_request("long", 2, max_tokens=60)],
                30: [make_request("short", 3, max_tokens=5)]}
    driver = run_all(limits, arrivals)
    assert results(driver) == {"long": (expected_tokens("long", 60), "length"),
                               "short": (expected_tokens("short", 5), "length")}
    assert driver.core.num_preemptions == 1
    chunks = [r.context_len for s in driver.history for r in s.rows
              if r.request_id == "long" and len(r.token_ids) > 1]
    assert chunks == [2, 8, 16, 24, 32]  # its prompt, then the recomputation
    # (a chunk of 8 beside a window of 8: at most 4 pages)
    assert driver.core.kv.max_seq_blocks == 4


def test_n_samples_share_their_prompt_s_blocks_on_a_windowed_model() -> None:
    """Samples 1..n-1 reuse sample 0's prompt pages (Driver.check holds each block's
    reference count to its holders after every move); each gives them back as its window
    passes, the last one freeing them."""
    limits = dataclasses.replace(WINDOWED, window=12, max_num_seqs=4)
    driver = run_all(limits, {0: [make_request("r", 9, max_tokens=30, n=3)]})
    assert driver.core.prefix_cache_hits == 2 * 2 * BS  # samples 1 and 2: 2 pages each
    for i in range(3):
        key = sample_key("r", i)
        assert driver.outputs[key] == expected_tokens(key, 30)


def looping_token(rid: str, index: int) -> int:
    """Outputs that repeat a period of 3-6 tokens with a change every 11: n-gram drafts are
    accepted, and sometimes rejected."""
    seed = zlib.crc32(rid.encode())
    if index % 11 == 10:
        return 500 + (seed + index) % 97
    return 1000 + (seed + 7 * (index % (3 + seed % 4))) % 300


@pytest.mark.parametrize("depth", [1, 2])
def test_speculative_rollback_never_reads_a_block_given_back(depth: int) -> None:
    """Rejected drafts lower num_computed; a page goes back only once no query from the
    lowest position the sequence may compute next reads it (Driver.check), and every row
    reads back its window's tokens (the fake executor)."""
    spec = dataclasses.replace(WINDOWED, window=6, depth=depth, max_num_batched_tokens=64,
                               speculative=SpeculativeConfig("ngram", 4, 4, 2))
    arrivals = {t: [make_request(f"r{t}", 3 + t, max_tokens=80)] for t in range(4)}
    drafted = run_all(spec, arrivals, looping_token)
    plain = run_all(dataclasses.replace(spec, speculative=None), arrivals, looping_token)
    assert results(drafted) == results(plain)
    core = drafted.core
    assert 0 < core.spec_num_accepted_tokens < core.spec_num_draft_tokens
    assert core.kv.max_seq_blocks <= 6 // BS + depth + 1 + -(-4 // BS)


def test_steady_decode_of_8192_tokens_in_a_window_of_1024() -> None:
    """The figure docs/ARCHITECTURE.md gives ("Windows that give their blocks back"): blocks
    of 16, depth 2, a context of 8192 with a window of 1024 hold 65 blocks a sequence at
    every decode step (1024 / 16 + 1) against 512 without."""
    for window, held in ((1024, 65), (None, 512)):
        limits = EngineLimits(4, 2048, 16, 8192, 1000, (), 2, uniform_window=window)
        core = Scheduler(limits, 1024)
        core.add_request(TokenizedRequest("a", "", [10] * 1000, SamplingParams(
            max_tokens=8192 - 1000, ignore_eos=True), 0.0))
        seq = core.seq("a")
        steady = set()
        while core.requests:
            while (step := core.schedule()) is not None:
                pass
            step = core.inflight[0]
            if seq.num_computed > 2048:
                steady.add(seq.num_held_blocks)
            core.on_sampled(step.step_id, [11] * step.num_sampled)
        assert core.kv.max_seq_blocks == held
        assert max(steady) == held and (window is None or steady == {held})


# ---------------------------------------------------------------- which models


def spec_of(*windows: int | None) -> ArchSpec:
    return ArchSpec(family="test", hidden=64, intermediate=128, num_layers=len(windows),
                    num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100, eps=1e-6,
                    tie_word_embeddings=False,
                    layers=tuple(AttentionKind(window=w) for w in windows))


def test_only_a_window_on_every_layer_gives_blocks_back() -> None:
    """Mistral and Phi-3 (one window everywhere) do; Gemma 2/3 (local and global layers)
    and models without windows keep every block; so does a run with a draft model, whose
    own layers may read every key of the blocks it shares."""
    assert spec_of(4096, 4096).uniform_window == 4096
    assert spec_of(4096, None).uniform_window is None
    assert spec_of(512, 1024).uniform_window is None
    assert spec_of(None, None).uniform_window is None
    model = ModelInfo("/nonexistent", 8192, 100, (2,), uniform_window=4096)
    assert PipelineConfig(model=model).limits.uniform_window == 4096
    draft = SchedulerConfig(speculative=SpeculativeConfig("draft", 3, model="/draft"))
    assert PipelineConfig(model=model, scheduler=draft).limits.uniform_window is None
    ngram = SchedulerConfig(speculative=SpeculativeConfig("ngram", 3))
    assert PipelineConfig(model=model, scheduler=ngram).limits.uniform_window == 4096


# ---------------------------------------------------------------- a model


@pytest.mark.parametrize("backend", [
    "cpu_kernels", "torch", pytest.param("flex", marks=pytest.mark.slow)])
def test_a_windowed_model_in_a_small_cache_matches_transformers(tmp_path: Path,
                                                                 backend: str) -> None:
    """A random Mistral with a window of 6 on every layer, in a cache of 12 blocks of 4
    tokens (11 beside flex's scratch block): its sequences (the longest 27 pages) run on
    blocks given back and mapped again to others at once, each backend reading the stale
    table entries of given-back pages only under its window (cpu_kernels from the
    window's first page; torch and flex masking what they gather). Greedy tokens equal
    transformers'. (The order of run-ahead steps: the fake executor's poisoned blocks.)"""
    from tiny_model import hf_greedy

    from pipeline.tools.random_model import build_random_llama
    from stages.inprocess import InProcessEngine

    folder = build_random_llama(tmp_path / "m", arch="mistral-window", heads=4, kv_heads=2)
    assert ModelInfo.from_dir(folder).uniform_window == 6
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 41, 85)]
    expected = hf_greedy(folder, prompts, max_new_tokens=24)
    per_block = 2 * 2 * BS * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, fp32
    engine = InProcessEngine(str(folder), depth=2, max_num_batched_tokens=16,
                             max_num_seqs=4, kv_cache_memory=12 * per_block,
                             eos_token_ids=ModelInfo.from_dir(folder).eos_token_ids,
                             compile=backend == "flex",
                             cpu_kernels=backend == "cpu_kernels")
    assert engine.runner.backend.name == backend
    num_blocks = engine.runner.num_blocks
    assert num_blocks <= 12 < -(-(85 + 24) // BS)
    got = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert got == expected
    kv = engine.scheduler.kv
    assert kv.max_seq_blocks <= num_blocks and kv.allocator.num_free == num_blocks
