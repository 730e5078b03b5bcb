"""The rank layout (ipc/ranks.py): which global executor ranks each engine owns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ipc.ranks import RankLayout


def test_engines_own_consecutive_ranks_head_first() -> None:
    layout = RankLayout(3, tensor_parallel_size=2)
    assert (layout.ranks_per_engine, layout.num_ranks) == (2, 6)
    assert [list(layout.engine_ranks(e)) for e in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [layout.head(e) for e in range(3)] == [0, 2, 4]
    assert [layout.engine_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [layout.local_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]


def test_every_rank_is_its_engines_once() -> None:
    for engines, tp in ((1, 1), (1, 4), (4, 1), (2, 3)):
        layout = RankLayout(engines, tp)
        owned = [r for e in range(engines) for r in layout.engine_ranks(e)]
        assert owned == list(range(layout.num_ranks))
        assert all(layout.engine_of(layout.head(e)) == e for e in range(engines))
        assert all(layout.local_rank(layout.head(e)) == 0 for e in range(engines))


def test_an_engine_past_the_count_follows_the_rule() -> None:
    """An engine that joins from another host gets the next index; its ranks (numbered on its
    host) follow the same rule."""
    layout = RankLayout(1, tensor_parallel_size=2)
    assert list(layout.engine_ranks(2)) == [4, 5] and layout.engine_of(5) == 2


def test_the_layout_of_a_config() -> None:
    """From a config's data- and tensor-parallel sizes (PipelineConfig's names; any object
    with them will do)."""
    cfg = SimpleNamespace(data_parallel_size=3,
                          executor=SimpleNamespace(tensor_parallel_size=2))
    assert RankLayout.of(cfg) == RankLayout(3, 2)


def test_a_layout_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError):
        RankLayout(0, 1)
    with pytest.raises(ValueError):
        RankLayout(1, 0)
