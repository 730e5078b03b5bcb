"""Where an engine's executor ranks sit among the run's global ranks: the one place that knows
executor r belongs to engine r // (ranks per engine). Pure; imported by the launcher's process
(spawning, supervision) and by each executor process (its engine, its rank, its GPU)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    """num_engines engines (data parallelism), each of ranks_per_engine consecutive global
    executor ranks (tensor parallelism today; pipeline stages times tensor ranks later: then
    ranks_per_engine is the one thing that changes)."""

    num_engines: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.num_engines < 1 or self.tensor_parallel_size < 1:
            raise ValueError(f"a rank layout of {self.num_engines} engine(s) of "
                             f"{self.tensor_parallel_size} rank(s): each must be at least 1")

    @property
    def ranks_per_engine(self) -> int:
        return self.tensor_parallel_size

    @property
    def num_ranks(self) -> int:
        """Executor processes of the whole layout (one a device, where there are devices)."""
        return self.num_engines * self.ranks_per_engine

    def engine_ranks(self, engine: int) -> range:
        """The global executor ranks of engine `engine`, its head first. (An engine that joins
        from another host has an index past num_engines: its ranks follow the same rule.)"""
        return range(self.head(engine), self.head(engine) + self.ranks_per_engine)

    def head(self, engine: int) -> int:
        """The rank that receives the engine's plans and whose ready report carries its cache
        size (the scheduler starts on it)."""
        return engine * self.ranks_per_engine

    def engine_of(self, rank: int) -> int:
        return rank // self.ranks_per_engine

    def local_rank(self, rank: int) -> int:
        """The rank's place within its engine (its tensor-parallel rank; 0: the head)."""
        return rank % self.ranks_per_engine
