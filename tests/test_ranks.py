"""The rank layout (ipc/ranks.py): which global executor ranks each engine owns."""

from __future__ import annotations

import pytest

from ipc.config import ExecutorConfig, PipelineConfig
from ipc.model_info import ModelInfo
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
    """A run's config gives its layout from its data- and tensor-parallel sizes."""
    model = ModelInfo(path="/nonexistent", vocab_size=100, max_model_len=64, eos_token_ids=(2,))
    cfg = PipelineConfig(model=model, data_parallel_size=3,
                         executor=ExecutorConfig(tensor_parallel_size=2))
    assert cfg.ranks == RankLayout(3, 2)


def test_a_layout_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError):
        RankLayout(0, 1)
    with pytest.raises(ValueError):
        RankLayout(1, 0)
