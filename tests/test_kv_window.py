"""A sliding window on every layer (Mistral's, Phi-3's): the scheduler gives back a running
sequence's KV blocks once they fall out of the window (stages/scheduler/kv_manager.py trim).
The KV manager alone with small block counts, then the scheduler core under the fake executor
(tests/scheduler_driver.py), which reads back what each row's queries see, from its first
query's window on, and checks after every move that no page a later query may read went
back."""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from pathlib import Path

import pytest
from kernel_marks import needs_kernels
from scheduler_driver import (
    Driver,
    DriverLimits,
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
from stages.scheduler.kv_manager import NO_HIT, KVManager, PrefixHit
from stages.scheduler.planned import PlannedStep
from stages.scheduler.sequence import NO_BLOCK, SeqStatus, Sequence

BS = 4  # tokens a block
WINDOW = 8  # a query at p reads keys p - 7 .. p: at most 3 pages of 4


def make_kv(num_blocks: int = 16, window: int | None = WINDOW) -> KVManager:
    return KVManager(num_blocks, BS, 4, 64, (window,))


def never(seq: Sequence) -> None:
    raise AssertionError(f"{seq.request_id} preempted")


def admitted(kv: KVManager, rid: str, prompt: list[int], hit: PrefixHit = NO_HIT
             ) -> Sequence:
    """A sample of `prompt` admitted (reusing `hit`) with its prompt computed."""
    seq = Sequence(rid, prompt, SamplingParams(), 0.0)
    seq.move_to(SeqStatus.RUNNING)
    step = PlannedStep(0)
    kv.admit(step, seq, hit)
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
    # A query at 10 reads keys 3..10 (page 0's last key); one at 11 reads 4..11, but page 0
    # goes back only from 12 on: flex's masks take a page's queries from its start (8).
    group = kv.groups[0]
    assert group.first_read_page(10) == 0 and group.first_read_page(11) == 0
    assert group.first_read_page(12) == 1
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
    assert kv.max_seq_blocks == kv.groups[0].pages_to_run(10**6) == 3
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
        assert kv.cached_prefix(again).num_blocks == hits
    # (with the window: pages 0-2 went back unkeyed, handed out before cached blocks)
    assert first.num_trimmed == 3 and kv.allocator.num_cached_free == 0


def test_shared_blocks_go_back_when_no_sibling_needs_them() -> None:
    kv = make_kv()
    prompt = list(range(100, 108))  # 2 full pages
    a = admitted(kv, "r", prompt)
    kv.register_blocks(a)
    hit = kv.cached_prefix(Sequence("r", prompt, SamplingParams(), 0.0, index=1))
    assert hit.taken(0) == a.blocks[:1]  # (the last token is always computed)
    b = admitted(kv, "r", prompt, hit)
    shared = a.blocks[0]
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
    hits = list(first.blocks)
    kv.release(first)  # its blocks free, keyed: cached
    windowed = make_kv(window=WINDOW)
    windowed.allocator = kv.allocator
    seq = Sequence("again", prompt + [9], SamplingParams(), 0.0)
    hit = windowed.cached_prefix(seq)
    assert hit.num_blocks == 6 and hit.taken(0) == hits[4:]
    step = PlannedStep(0)
    assert windowed.admits(step, hit, 25)
    seq.move_to(SeqStatus.RUNNING)
    windowed.admit(step, seq, hit)
    # The query at 24 reads 17..24: pages 4 and 5, and page 6 (new).
    assert seq.num_trimmed == 4 and seq.blocks[:4] == [NO_BLOCK] * 4
    assert [i for _, i, _ in step.block_updates] == [4, 5]
    assert [kv.allocator.ref_count(b) for b in hits] == [0, 0, 0, 0, 1, 1]


# ---------------------------------------------------------------- the scheduler core

WINDOWED = make_limits(window=WINDOW, block_size=BS, num_blocks=64, max_model_len=256,
                       max_num_batched_tokens=16)
# Windowed layers beside layers that read every key: a group of these, two of windowed ones
MIXED = make_limits(mixed_window=WINDOW, mixed_groups=(1, 2), block_size=BS, num_blocks=64,
                    max_model_len=256, max_num_batched_tokens=16)
KINDS = {"windowed": WINDOWED, "mixed": MIXED}


def with_window(limits: DriverLimits, window: int) -> DriverLimits:
    """`limits` with another window (on every layer, or on the windowed ones)."""
    if limits.mixed_window is None:
        return dataclasses.replace(limits, window=window)
    return dataclasses.replace(limits, mixed_window=window)


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


def side_by_side(limits: DriverLimits) -> Driver:
    """Two sequences of 16 and 17 pages (their computed tokens: the last sample is not fed
    back), run without a preemption."""
    arrivals = {0: [make_request("a", 5, max_tokens=60)],
                3: [make_request("b", 7, max_tokens=60)]}
    driver = run_all(limits, arrivals)
    assert results(driver) == {"a": (expected_tokens("a", 60), "length"),
                               "b": (expected_tokens("b", 60), "length")}
    assert driver.core.num_preemptions == 0
    return driver


def test_blocks_given_back_serve_another_request() -> None:
    """In a cache of 8 blocks, each sequence on the blocks the other gave back."""
    driver = side_by_side(dataclasses.replace(WINDOWED, num_blocks=8))
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


@pytest.mark.parametrize(("kind", "num_blocks"), [("windowed", 6), ("mixed", 24)])
@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_and_resume_on_a_windowed_model(depth: int, kind: str,
                                                   num_blocks: int) -> None:
    """Four short prompts start on a page each in a small cache and each grows to the 3
    pages of its window (beside every page in the layers that read every key, mixed): some
    are preempted and recompute (or resume from what the cache kept), and every output is
    the same as in a roomy cache."""
    arrivals = {0: [make_request(f"r{i}", 2 + i, max_tokens=40) for i in range(4)]}
    tiny = run_all(dataclasses.replace(KINDS[kind], num_blocks=num_blocks, depth=depth,
                                       max_num_batched_tokens=8), arrivals)
    roomy = run_all(dataclasses.replace(KINDS[kind], depth=depth, num_blocks=256), arrivals)
    assert tiny.core.num_preemptions > 0 and roomy.core.num_preemptions == 0
    assert results(tiny) == results(roomy)
    assert {rid: len(out) for rid, (out, _) in results(tiny).items()} == dict.fromkeys(
        ("r0", "r1", "r2", "r3"), 40)


def long_victim(depth: int, **params: object) -> Driver:
    """A long sequence that gives its one slot to a shorter request of its sender (fair
    queueing) and is computed again."""
    limits = dataclasses.replace(WINDOWED, num_blocks=6, depth=depth, max_num_seqs=1,
                                 max_num_batched_tokens=8)
    arrivals = {0: [make_request("long", 2, max_tokens=60, **params)],
                30: [make_request("short", 3, max_tokens=5)]}
    driver = run_all(limits, arrivals)
    assert results(driver) == {"long": (expected_tokens("long", 60), "length"),
                               "short": (expected_tokens("short", 5), "length")}
    assert driver.core.num_preemptions == 1
    return driver


@pytest.mark.parametrize("depth", [1, 2])
def test_a_long_victim_recomputes_in_chunks_that_give_pages_back(depth: int) -> None:
    """The victim recomputes its prompt and 30-odd outputs in chunks of 8, giving back the
    pages behind its window as it goes. (Its penalty keeps it off the prefix cache, where
    the pages its window reads wait for it: the next test.)"""
    driver = long_victim(depth, repetition_penalty=1.1)
    chunks = [r.context_len for s in driver.history for r in s.rows
              if r.request_id == "long" and len(r.token_ids) > 1]
    assert chunks == [2, 8, 16, 24, 32]  # its prompt, then the recomputation
    # (a chunk of 8 beside a window of 8: at most 4 pages)
    assert driver.core.kv.max_seq_blocks == 4


@pytest.mark.parametrize("depth", [1, 2])
def test_a_long_victim_resumes_from_the_pages_its_window_reads(depth: int) -> None:
    """Without a penalty, its pages went back keyed but those before its window, so the
    prefix cache finds the pages a query at its end reads (not the prefix from token 0,
    long given back) and it resumes there, computing at most its last chunk again."""
    driver = long_victim(depth)
    chunks = [r.context_len - len(r.token_ids) for s in driver.history for r in s.rows
              if r.request_id == "long" and len(r.token_ids) > 1]
    assert chunks[0] == 0 and len(chunks) <= 2  # its prompt, and one chunk at most
    assert driver.core.kv.prefix_cache_hits >= 24 + 2 * BS * (depth == 2)


@pytest.mark.parametrize("prompt_len", [9, 16, 20])
@pytest.mark.parametrize("kind", ["windowed", "mixed"])
def test_n_samples_share_their_prompt_s_blocks_on_a_windowed_model(kind: str,
                                                                   prompt_len: int) -> None:
    """Samples 1..n-1 reuse sample 0's prompt pages in every group (Driver.check holds each
    block's reference count to its holders after every move), each giving them back as its
    window passes, the last one freeing them. Sample 0's first decode, planned before they
    are admitted, passes its window beyond the pages they need where the prompt is whole
    pages longer than the window: it keeps those until they hold them too
    (Sequence.trim_floor)."""
    limits = dataclasses.replace(KINDS[kind], max_num_seqs=4)
    driver = run_all(limits, {0: [make_request("r", prompt_len, max_tokens=30, n=3)]})
    pages = (prompt_len - 1) // BS  # (the last token is always computed)
    assert driver.core.prefix_cache_hits == 2 * pages * BS
    assert not driver.core._sharing
    for i in range(3):
        key = sample_key("r", i)
        assert driver.outputs[key] == expected_tokens(key, 30)


def test_a_sibling_that_waits_long_is_not_kept_past_a_window() -> None:
    """With one slot, sample 1 waits until sample 0 is done: sample 0 keeps the pages
    sample 1 would take for one window's worth of pages more, then lets them go (sample 1
    computes its prompt again), so its windowed groups never hold its whole length."""
    limits = dataclasses.replace(MIXED, max_num_seqs=1)
    driver = run_all(limits, {0: [make_request("r", 16, max_tokens=60, n=2)]})
    for i in range(2):
        key = sample_key("r", i)
        assert driver.outputs[key] == expected_tokens(key, 60)
    window_pages = (WINDOW - 2) // BS + 2
    assert driver.core.kv.max_seq_blocks <= 2 * window_pages + limits.depth + 1
    assert driver.core.num_preemptions == 0


def looping_token(rid: str, index: int) -> int:
    """Outputs that repeat a period of 3-6 tokens with a change every 11: n-gram drafts are
    accepted, and sometimes rejected."""
    seed = zlib.crc32(rid.encode())
    if index % 11 == 10:
        return 500 + (seed + index) % 97
    return 1000 + (seed + 7 * (index % (3 + seed % 4))) % 300


@pytest.mark.parametrize("kind", ["windowed", "mixed"])
@pytest.mark.parametrize("depth", [1, 2])
def test_speculative_rollback_never_reads_a_block_given_back(depth: int, kind: str) -> None:
    """Rejected drafts lower num_computed; a page goes back only once no query from the
    lowest position the sequence may compute next reads it (Driver.check), and every row
    reads back its window's tokens (the fake executor)."""
    spec = dataclasses.replace(with_window(KINDS[kind], 6), depth=depth, num_blocks=256,
                               max_num_batched_tokens=64,
                               speculative=SpeculativeConfig("ngram", 4, 4, 2))
    arrivals = {t: [make_request(f"r{t}", 3 + t, max_tokens=80)] for t in range(4)}
    drafted = run_all(spec, arrivals, looping_token)
    plain = run_all(dataclasses.replace(spec, speculative=None), arrivals, looping_token)
    assert results(drafted) == results(plain)
    core = drafted.core
    assert 0 < core.spec_num_accepted_tokens < core.spec_num_draft_tokens
    assert core.kv.max_seq_blocks <= 6 // BS + depth + 1 + -(-4 // BS)


@pytest.mark.parametrize("windows", [(1024,), (None,), (None, 1024, 1024)])
def test_steady_decode_of_8192_tokens_in_a_window_of_1024(
        windows: tuple[int | None, ...]) -> None:
    """The figure docs/ARCHITECTURE.md gives ("Windows that give their blocks back"): blocks
    of 16, depth 2, a context of 8192 with a window of 1024 hold 65 blocks a sequence in a
    windowed group at every decode step (1024 / 16 + 1) against 512 without; beside layers
    that read every key (a group of them, two of windowed layers), those hold all 512."""
    limits = EngineLimits(4, 2048, 16, 8192, 1000, (), 2, kv_windows=windows)
    core = Scheduler(limits, 1024 + 512)
    core.add_request(TokenizedRequest("a", "", [10] * 1000, SamplingParams(
        max_tokens=8192 - 1000, ignore_eos=True), 0.0))
    seq = core.seq("a")
    steady: set[tuple[int, ...]] = set()
    while core.requests:
        while (step := core.schedule()) is not None:
            pass
        step = core.inflight[0]
        if seq.num_computed > 2048:
            steady.add(tuple(p.num_held for p in seq.pages))
        core.on_sampled(step.step_id, [11] * step.num_sampled)
    held = {(1024,): (65,), (None,): (512,), (None, 1024, 1024): (512, 65, 65)}[windows]
    assert core.kv.max_seq_blocks == held[-1]
    if windows == (None,):
        assert max(steady) == held
    else:
        assert max(steady) == held and {h[-1] for h in steady} == {65}


# ---------------------------------------------------------------- windowed layers beside others

def groups_of(driver: Driver, row: int) -> int:
    return row // (driver.limits.max_num_seqs + 1)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_mixed_model_gives_back_only_its_windowed_groups_blocks(depth: int) -> None:
    """A group of layers that read every key and two of windowed layers: the fake executor
    reads each row's context back through each group's table (a block id the same memory in
    every group: two groups holding one block at once would show), the first from token 0,
    the windowed ones from the window's first."""
    limits = dataclasses.replace(MIXED, depth=depth)
    driver = run_all(limits, {0: [make_request("a", 5, max_tokens=150)]})
    assert results(driver)["a"] == (expected_tokens("a", 150), "length")
    assert driver.core.kv.max_seq_blocks <= WINDOW // BS + depth + 1  # (the last group's)
    updates = Counter(groups_of(driver, row) for s in driver.history
                      for row, _, _ in s.block_updates)
    assert updates == dict.fromkeys((0, 1, 2), -(-155 // BS))  # (every page, in each)
    assert driver.core.num_preemptions == 0


def test_blocks_a_window_gives_back_serve_the_layers_that_read_every_key() -> None:
    """One pool: the first group's pages grow on blocks the windowed group gave back, in a
    cache of 48 blocks that could not hold every page of both sequences in both groups."""
    driver = side_by_side(dataclasses.replace(MIXED, num_blocks=48, mixed_groups=(1, 1)))
    mapped: dict[int, set[int]] = {}
    for step in driver.history:
        for row, _, block in step.block_updates:
            mapped.setdefault(block, set()).add(groups_of(driver, row))
    assert any(groups == {0, 1} for groups in mapped.values())
    assert 2 * (16 + 17) > 48


def in_vocabulary(rid: str, index: int) -> int:
    """Outputs a later prompt may hold (ids below the limits' vocabulary of 1000)."""
    return 100 + (zlib.crc32(rid.encode()) + 31 * index) % 800


def test_a_chat_s_next_turn_finds_the_pages_each_group_reads() -> None:
    """A next turn (the prompt and its answer, and more) reuses every page of the first
    group and the windowed groups' last pages, which the first turn left in the cache; a
    prompt that shares only the start, whose windowed pages went back as the window passed
    them, finds nothing."""
    first = make_request("t1", 9, max_tokens=30)
    history = list(first.prompt_token_ids) + expected_tokens("t1", 30, in_vocabulary)
    turn = TokenizedRequest("t2", "client", history + [77, 78, 79], SamplingParams(
        max_tokens=5), 0.0)
    early = TokenizedRequest("t3", "client", history[:12] + [5, 6, 7, 8, 9, 10],
                             SamplingParams(max_tokens=5), 0.0)
    driver = run_all(MIXED, {0: [first], 60: [turn], 80: [early]}, in_vocabulary)
    for rid in ("t1", "t2", "t3"):
        assert driver.finished[rid].finish_reason == "length"
    # t1 computed 38 tokens (its last sample was not fed back): t2 finds its 9 full pages
    assert driver.core.kv.prefix_cache_hits == 9 * BS


# ---------------------------------------------------------------- which models


def spec_of(*windows: int | None) -> ArchSpec:
    return ArchSpec(family="test", hidden=64, intermediate=128, num_layers=len(windows),
                    num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=100, eps=1e-6,
                    tie_word_embeddings=False,
                    layers=tuple(AttentionKind(window=w) for w in windows))


def test_each_kind_of_layer_keeps_its_own_blocks() -> None:
    """Mistral and Phi-3 (a window on every layer): one group that gives blocks back; Gemma
    2/3 (local layers beside global ones): groups of the same size of each kind, the
    windowed layers' (their longest window) apart from those that read every key, each layer
    at a place of its group; models without windows: one group that keeps every block; so
    does a run with a draft model, whose own layers may read every key of the blocks it
    shares."""
    assert spec_of(4096, 4096).kv_windows == (4096,)
    assert spec_of(512, 1024).kv_windows == (1024,)
    assert spec_of(None, None).kv_windows == (None,)
    mixed = spec_of(4096, None, 4096, None)
    assert mixed.kv_windows == (None, 4096)
    assert mixed.kv_places(True) == [(1, 0), (0, 0), (1, 1), (0, 1)]
    assert mixed.kv_places(False) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    gemma3 = spec_of(*[512] * 5, None, *[512] * 5, None, 512)  # 2 global, 11 local
    assert gemma3.kv_windows == (None,) + (512,) * 6
    assert [p for p, k in zip(gemma3.kv_places(True), gemma3.layers, strict=True)
            if k.window is None] == [(0, 0), (0, 1)]
    assert gemma3.kv_places(True)[:3] == [(1, 0), (1, 1), (2, 0)]
    assert gemma3.kv_places(True)[-1] == (6, 0)  # (the last group: one layer of two places)
    many_full = spec_of(None, None, None, 64)
    assert many_full.kv_windows == (None, None, None, 64)
    for windows in ((4096,), (None, 4096)):
        model = ModelInfo("/nonexistent", 8192, 100, (2,), kv_windows=windows)
        assert PipelineConfig(model=model).limits.kv_windows == windows
        draft = SchedulerConfig(speculative=SpeculativeConfig("draft", 3, model="/draft"))
        assert PipelineConfig(model=model, scheduler=draft).limits.kv_windows == (None,)
        ngram = SchedulerConfig(speculative=SpeculativeConfig("ngram", 3))
        assert PipelineConfig(model=model, scheduler=ngram).limits.kv_windows == windows


# ---------------------------------------------------------------- a model


@pytest.mark.parametrize("backend", [
    pytest.param("cpu_kernels", marks=needs_kernels), "torch",
    pytest.param("flex", marks=pytest.mark.slow)])
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
    assert ModelInfo.from_dir(folder).kv_windows == (6,)
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


@pytest.mark.parametrize("backend", [
    pytest.param("cpu_kernels", marks=needs_kernels), "torch",
    pytest.param("flex", marks=pytest.mark.slow)])
def test_local_and_global_layers_in_a_small_cache_match_transformers(tmp_path: Path,
                                                                       backend: str) -> None:
    """A random Gemma 3 of six layers, five local (window 6) and one global: six KV groups of
    one layer each sharing one cache, each layer's tensor shared with the layers at its place
    in the other groups, so a block is one layer's where it was six: a cache of 48 such
    blocks holds the global layer's every page and the local layers' windows (every page of
    a sequence in every layer: 6 x 28 pages for the longest). Greedy tokens equal
    transformers', on each backend."""
    from tiny_model import hf_greedy

    from pipeline.tools.random_model import build_random_model
    from stages.inprocess import InProcessEngine

    folder = build_random_model(tmp_path / "m", "gemma3_text", weight_std=0.05,
                                hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                sliding_window=6, max_position_embeddings=512)
    info = ModelInfo.from_dir(folder)
    assert info.kv_windows == (None, 6, 6, 6, 6, 6)
    prompts = [list(range(5, 5 + n)) for n in (3, 20, 41, 85)]
    expected = hf_greedy(folder, prompts, max_new_tokens=24)
    per_block = 2 * BS * 2 * 16 * 4  # K and V, one layer, 2 KV heads of 16, fp32
    engine = InProcessEngine(str(folder), depth=2, max_num_batched_tokens=16,
                             max_num_seqs=4, kv_cache_memory=48 * per_block,
                             eos_token_ids=info.eos_token_ids, compile=backend == "flex",
                             cpu_kernels=backend == "cpu_kernels")
    assert engine.runner.backend.name == backend
    caches = engine.runner.kv_caches
    assert len({c.data_ptr() for c in caches}) == 1  # (one place: every layer's tensor)
    num_blocks = engine.runner.num_blocks
    assert 47 <= num_blocks <= 48 < 6 * -(-(85 + 24) // BS)
    got = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert got == expected
    kv = engine.scheduler.kv
    # (a windowed group's most: a prefill chunk of 16 beside the window's 6 - 1 keys)
    assert kv.max_seq_blocks <= -(-(6 - 1 + 16) // BS) + 1
    assert kv.allocator.num_free == num_blocks
