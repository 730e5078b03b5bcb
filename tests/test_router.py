"""Tests for stages.router.EngineRouter: load spreading, prefix affinity and its imbalance
override, dead engines, the bounded LRU table and block keys that agree across processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from stages.router import BALANCE_ABS_TOKENS, EngineRouter, NoEngine, block_keys

BS = 4
UP = [True, True]
SHARED = list(range(1, 9))  # two full blocks of BS tokens


def test_burst_spreads_evenly_before_any_publication() -> None:
    for policy in ("prefix", "load"):
        router = EngineRouter(2, BS, policy=policy)
        chosen = [router.route([100 + i] * 12, cost=50) for i in range(8)]
        assert Counter(chosen) == {0: 4, 1: 4}, policy
        assert router.loads == (200, 200)


def test_shared_prefix_follows_its_engine_despite_a_small_load_gap() -> None:
    router = EngineRouter(2, BS)
    first = router.route(SHARED + [77], cost=9)
    other = 1 - first
    loads = [0, 0]
    loads[first] = 300  # a bit busier, well under the imbalance thresholds
    router.set_loads(loads, UP)
    assert router.route(SHARED + [55, 56, 57], cost=11) == first
    assert router.route([99] + SHARED, cost=11) == other  # same tokens, other blocks


def test_partial_block_is_not_a_match() -> None:
    router = EngineRouter(2, BS)
    assert router.route(SHARED + [9, 10], cost=10) == 0
    router.set_loads([10, 0], UP)
    assert router.match([1, 2, 3]).num_blocks == 0
    assert router.route([1, 2, 3], cost=1) == 1  # shorter than a block: least loaded
    assert router.route([1, 2, 3, 50] + SHARED, cost=1) == 1  # 3 tokens in common: no match
    assert router.match(SHARED + [9, 10, 11, 12]) == (2, 0b01)  # [9, 10] was never a block


def test_load_policy_ignores_the_prefix() -> None:
    router = EngineRouter(2, BS, policy="load")
    assert router.route(SHARED, cost=5) == 0
    router.set_loads([10, 0], UP)
    assert router.route(SHARED, cost=5) == 1
    assert router.num_blocks == 0


@pytest.mark.parametrize(("holder_load", "least_load", "expected"), [
    (10_000, 1_000, 1),  # far busier in both senses: balance wins
    (20_000, 15_000, 0),  # 5000 tokens apart, but only 1.33x: affinity stays
    (3_000, 100, 0),  # 30x, but only 2900 tokens apart: affinity stays
    (BALANCE_ABS_TOKENS + 1, 0, 1),
])
def test_imbalance_overrides_prefix(holder_load: int, least_load: int, expected: int) -> None:
    router = EngineRouter(2, BS)
    assert router.route(SHARED, cost=1) == 0
    router.set_loads([holder_load, least_load], UP)
    assert router.route(SHARED, cost=1) == expected


def test_prefix_held_by_two_engines_goes_to_the_less_loaded_holder() -> None:
    router = EngineRouter(3, BS)
    assert router.route(SHARED, cost=1) == 0
    router.set_loads([10_000, 0, 50], [True] * 3)
    assert router.route(SHARED, cost=1) == 1  # imbalance: now held by 0 and 1
    assert router.match(SHARED) == (2, 0b011)
    router.set_loads([500, 300, 0], [True] * 3)
    assert router.route(SHARED, cost=1) == 1  # engine 2 is idle but holds nothing
    router.set_loads([300, 500, 0], [True] * 3)
    assert router.route(SHARED, cost=1) == 0


def test_dead_engines_are_never_chosen() -> None:
    router = EngineRouter(2, BS)
    assert router.route(SHARED, cost=1) == 0
    router.set_loads([0, 10_000], [False, True])
    assert [router.route(SHARED, cost=1) for _ in range(4)] == [1] * 4
    router.set_loads([0, 0], [False, False])
    with pytest.raises(NoEngine, match="down"):
        router.route(SHARED, cost=1)


def test_revived_engine_holds_no_old_prefixes() -> None:
    router = EngineRouter(2, BS)
    assert router.route(SHARED, cost=1) == 0
    router.set_loads([0, 0], [False, True])
    router.set_loads([50, 0], UP)  # back, restarted with an empty cache
    assert router.match(SHARED).num_blocks == 0
    assert router.route(SHARED, cost=1) == 1


def test_set_loads_replaces_local_additions() -> None:
    router = EngineRouter(2, BS, policy="load")
    for _ in range(3):
        router.route([1], cost=100)
    assert router.loads == (200, 100)
    router.set_loads([5, 7], UP)
    assert router.loads == (5, 7)
    assert router.route([1], cost=4) == 0
    assert router.loads == (9, 7)


def test_table_is_a_bounded_lru() -> None:
    router = EngineRouter(2, 2, max_blocks=2)
    a, b, c = [1, 2], [3, 4], [5, 6]
    router.route(a, cost=1)
    router.route(b, cost=1)
    router.route(a, cost=1)  # touched: now b is the oldest
    router.route(c, cost=1)
    assert router.num_blocks == 2
    assert [router.match(p).num_blocks for p in (a, b, c)] == [1, 0, 1]


def test_eviction_drops_deep_blocks_before_their_roots() -> None:
    router = EngineRouter(2, 2, max_blocks=4)
    long_a, long_b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
    router.route(long_a, cost=1)
    router.route(long_b, cost=1)
    assert router.num_blocks == 4
    assert router.match(long_a).num_blocks == 1
    assert router.match(long_b).num_blocks == 3


def test_one_engine_routes_to_zero_without_hashing() -> None:
    router = EngineRouter(1, BS)
    assert router.route(SHARED, cost=3) == 0
    assert router.num_blocks == 0
    assert router.loads == (3,)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="prefix.*load"):
        EngineRouter(2, BS, policy="random")
    with pytest.raises(ValueError):
        EngineRouter(2, BS).set_loads([0], [True])


def test_block_keys_agree_across_processes() -> None:
    prompt = [151_643, 0, 7, 2**31 - 1] * 9 + [5]
    code = ("from stages.router import block_keys; "
            f"print(block_keys({prompt!r}, {BS}))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # str hashing differs; ours must not
    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    keys = block_keys(prompt, BS)
    assert len(keys) == 9 and len(set(keys)) == 9  # chained: equal blocks, distinct keys
    assert out.strip() == repr(keys)
