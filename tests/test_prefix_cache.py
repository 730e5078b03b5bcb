"""Prefix caching: the block allocator's reference counts, keys and LRU eviction; the scheduler
reusing a shared prefix (checked token by token by the fake executor's paged KV store); and the
real model giving transformers' greedy outputs with hits and after eviction."""

from __future__ import annotations

from pathlib import Path

import pytest
from scheduler_driver import Driver, expected_tokens, make_limits, prompt_of
from tiny_model import hf_greedy

from ipc.messages import SamplingParams, TokenizedRequest
from stages.inprocess import InProcessEngine
from stages.scheduler.block_allocator import BlockAllocator
from stages.scheduler.sequence import block_key


def key(*tokens: int, parent: bytes = b"") -> bytes:
    return block_key(parent, list(tokens))


# ---------------------------------------------------------------- allocator


def test_a_registered_block_is_found_and_shared() -> None:
    alloc = BlockAllocator(4, 2)
    (b,) = alloc.allocate(1) or []
    alloc.register(b, key(1, 2))
    assert alloc.lookup([key(1, 2), key(3, 4)]) == [b]
    alloc.take(b)
    assert alloc.ref_count(b) == 2 and alloc.num_free == 3
    alloc.free([b])
    alloc.free([b])
    assert alloc.num_free == 4 and alloc.num_cached_free == 1
    assert alloc.lookup([key(1, 2)]) == [b]  # freed, but still reusable
    alloc.take(b)
    assert alloc.num_free == 3 and alloc.num_cached_free == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free([b, b])


def test_uncached_blocks_go_first_then_least_recently_freed() -> None:
    alloc = BlockAllocator(4, 2)
    blocks = alloc.allocate(4) or []
    for i, b in enumerate(blocks[:3]):
        alloc.register(b, key(i, i))
    alloc.free([blocks[1]])
    alloc.free([blocks[0]])
    alloc.free([blocks[3]])  # no key
    alloc.free([blocks[2]])
    assert alloc.allocate(1) == [blocks[3]]
    assert alloc.num_evictions == 0
    assert alloc.allocate(1) == [blocks[1]]  # least recently freed cached block
    assert alloc.lookup([key(1, 1)]) == [] and alloc.lookup([key(0, 0)]) == [blocks[0]]
    assert alloc.num_evictions == 1


def test_a_key_already_cached_keeps_its_first_block() -> None:
    alloc = BlockAllocator(4, 2)
    a, b = alloc.allocate(2) or []
    alloc.register(a, key(5, 6))
    alloc.register(b, key(5, 6))
    assert alloc.lookup([key(5, 6)]) == [a]
    alloc.free([b])
    assert alloc.num_cached_free == 0  # b holds no key: it is plainly free


def test_a_prefix_is_found_only_in_order() -> None:
    alloc = BlockAllocator(4, 2)
    a, b = alloc.allocate(2) or []
    alloc.register(b, key(3, 4, parent=key(1, 2)))
    assert alloc.lookup([key(1, 2), key(3, 4, parent=key(1, 2))]) == []
    alloc.register(a, key(1, 2))
    assert alloc.lookup([key(1, 2), key(3, 4, parent=key(1, 2))]) == [a, b]


def test_keys_depend_on_the_whole_prefix() -> None:
    assert key(3, 4, parent=key(1, 2)) != key(3, 4, parent=key(2, 1)) != key(3, 4)
    assert key(3, 4, parent=key(1, 2)) == key(3, 4, parent=key(1, 2))
    assert len(key(1)) == 16


# ---------------------------------------------------------------- scheduler


def shared_prompt(tail: str, system_len: int = 16, tail_len: int = 5) -> list[int]:
    return prompt_of("system", system_len) + prompt_of(tail, tail_len)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_shared_system_prompt_is_computed_once(depth: int) -> None:
    limits = make_limits(num_blocks=32, block_size=4, max_num_batched_tokens=64, depth=depth)
    driver = Driver(limits)
    driver.add(TokenizedRequest("a", "c", shared_prompt("a"), SamplingParams(max_tokens=6), 0.0))
    driver.tick()
    driver.add(TokenizedRequest("b", "c", shared_prompt("b"), SamplingParams(max_tokens=6), 0.0))
    driver.run()
    driver.check_idle()
    b_rows = [r for s in driver.history for r in s.rows if r.request_id == "b"]
    assert b_rows[0].context_len - len(b_rows[0].token_ids) == 16  # four blocks reused
    assert driver.finished["b"].num_cached_tokens == 16
    assert driver.finished["a"].num_cached_tokens == 0
    assert driver.outputs["b"] == expected_tokens("b", 6)
    stats = driver.core.stats()
    assert stats.prefix_cache_hits == 16
    assert stats.prefix_cache_queries == 2 * 21
    assert stats.num_cached_blocks > 0


def test_hits_hold_a_reference_while_both_run() -> None:
    limits = make_limits(num_blocks=32, block_size=4, max_num_batched_tokens=64, depth=1)
    driver = Driver(limits)
    driver.add(TokenizedRequest("a", "c", shared_prompt("a"), SamplingParams(max_tokens=20),
                                0.0))
    driver.tick()
    driver.add(TokenizedRequest("b", "c", shared_prompt("b"), SamplingParams(max_tokens=20),
                                0.0))
    driver.tick()
    a, b = driver.core.seq("a"), driver.core.seq("b")
    assert a.blocks[:4] == b.blocks[:4]
    assert all(driver.core.allocator.ref_count(x) == 2 for x in a.blocks[:4])
    driver.run()
    driver.check_idle()


def test_the_last_prompt_token_is_always_computed() -> None:
    """A prompt that is all cached still computes its last token, in a block of its own."""
    limits = make_limits(num_blocks=32, block_size=4, depth=1)
    driver = Driver(limits)
    prompt = prompt_of("whole", 8)
    for rid in ("x", "y"):
        driver.add(TokenizedRequest(rid, "c", prompt, SamplingParams(max_tokens=3), 0.0))
        driver.run()
    y_rows = [r for s in driver.history for r in s.rows if r.request_id == "y"]
    assert y_rows[0].context_len == 8 and len(y_rows[0].token_ids) == 4  # block 2 recomputed
    assert driver.finished["y"].num_cached_tokens == 4
    driver.check_idle()


def test_penalised_requests_do_not_use_the_cache() -> None:
    limits = make_limits(num_blocks=32, block_size=4, depth=1)
    driver = Driver(limits)
    prompt = prompt_of("p", 12)
    driver.add(TokenizedRequest("x", "c", prompt, SamplingParams(max_tokens=2), 0.0))
    driver.run()
    driver.add(TokenizedRequest("y", "c", prompt, SamplingParams(max_tokens=2,
                                                                 presence_penalty=0.5), 0.0))
    driver.run()
    assert driver.finished["y"].num_cached_tokens == 0


# ---------------------------------------------------------------- the real model


def test_greedy_outputs_with_hits_and_after_eviction(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    system = tok("You are a careful assistant. Answer briefly and exactly. " * 2)["input_ids"]
    prompts = [system + tok(q)["input_ids"] for q in ("Why?", "How many?", "Where is it", "Who")]
    others = [tok(f"Unrelated text number {i} fills the cache.")["input_ids"] for i in range(6)]
    expected = hf_greedy(tiny_model_dir, prompts + others, max_new_tokens=8)
    # 40 blocks of 4 tokens: the first wave leaves its blocks cached, the second evicts them.
    engine = InProcessEngine(str(tiny_model_dir), block_size=4, kv_cache_memory=40 * 2048,
                             max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = engine.run([(f"p{i}", p, params) for i, p in enumerate(prompts)])
    assert [first[f"p{i}", 0].token_ids for i in range(4)] == expected[:4]
    assert max(first[f"p{i}", 0].num_cached_tokens for i in range(4)) >= len(system) // 4 * 4 - 4
    hits_before = engine.scheduler.prefix_cache_hits
    assert hits_before > 0
    again = engine.run([("again", prompts[0], params)])
    assert again["again", 0].token_ids == expected[0]
    assert again["again", 0].num_cached_tokens >= len(system) // 4 * 4 - 4
    rest = engine.run([(f"o{i}", p, params) for i, p in enumerate(others)])
    assert [rest[f"o{i}", 0].token_ids for i in range(6)] == expected[4:]
    assert engine.scheduler.allocator.num_evictions > 0
    after = engine.run([(f"q{i}", p, params) for i, p in enumerate(prompts)])
    assert [after[f"q{i}", 0].token_ids for i in range(4)] == expected[:4]
    assert engine.scheduler.allocator.num_free == engine.scheduler.num_blocks
