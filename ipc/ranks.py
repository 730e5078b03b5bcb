"""Where an engine's executor ranks sit among the run's global ranks, and which layers each
pipeline stage holds: the one place that knows executor r belongs to engine r // (ranks per
engine), that within an engine the ranks are stage after stage of tensor-parallel ranks (as
vLLM forms its groups: rank = stage * T + tensor rank), and how a model's layers split over the
stages. Pure; imported by the launcher's process (spawning, supervision, the checks before
anything starts) and by each executor process (its engine, its stage, its rank, its GPU)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    """num_engines engines (data parallelism), each of ranks_per_engine consecutive global
    executor ranks: pipeline_parallel_size stages of tensor_parallel_size ranks each."""

    num_engines: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # The last joined_stages stages of each engine run on another host, which joins the run
    # (`run_pipeline stage pipeline`): the launcher starts only the others
    joined_stages: int = 0

    def __post_init__(self) -> None:
        if min(self.num_engines, self.tensor_parallel_size, self.pipeline_parallel_size) < 1:
            raise ValueError(f"a rank layout of {self.num_engines} engine(s) of "
                             f"{self.pipeline_parallel_size} stage(s) of "
                             f"{self.tensor_parallel_size} rank(s): each must be at least 1")
        if not 0 <= self.joined_stages < self.pipeline_parallel_size:
            raise ValueError(f"{self.joined_stages} joined pipeline stage(s) of "
                             f"{self.pipeline_parallel_size}: the first stage runs on the "
                             "launcher's host")

    @property
    def ranks_per_engine(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

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
        size (the scheduler starts on it): the first stage's first tensor rank."""
        return engine * self.ranks_per_engine

    def local_ranks(self, engine: int) -> range:
        """The ranks of engine `engine` the launcher starts: those of its stages on this host
        (all of them without joined stages)."""
        ranks = self.engine_ranks(engine)
        return ranks[:len(ranks) - self.joined_stages * self.tensor_parallel_size]

    def joined_ranks(self, engine: int) -> range:
        """The ranks of engine `engine` a joining host starts (its last joined_stages)."""
        ranks = self.engine_ranks(engine)
        return ranks[len(ranks) - self.joined_stages * self.tensor_parallel_size:]

    @property
    def num_local_ranks(self) -> int:
        """Executor processes on the launcher's host (those of every engine's stages there)."""
        return self.num_engines * len(self.local_ranks(0))

    def device_index(self, rank: int) -> int:
        """The GPU of a global rank among its host's (cuda:0 up): a launcher-host rank counts
        the local ranks of the engines before its own; a joined stage's rank counts from 0
        on its host."""
        if self.joined(rank):
            return self.local_rank(rank) - len(self.local_ranks(0))
        return self.engine_of(rank) * len(self.local_ranks(0)) + self.local_rank(rank)

    def joined(self, rank: int) -> bool:
        """Whether a global rank's stage runs on another host than the engine's head."""
        return self.stage_of(rank) >= self.pipeline_parallel_size - self.joined_stages

    def engine_of(self, rank: int) -> int:
        return rank // self.ranks_per_engine

    def local_rank(self, rank: int) -> int:
        """The rank's place within its engine (0: the head)."""
        return rank % self.ranks_per_engine

    def stage_of(self, rank: int) -> int:
        """The pipeline stage of a global rank (0 embeds, the last samples)."""
        return self.local_rank(rank) // self.tensor_parallel_size

    def tensor_rank(self, rank: int) -> int:
        """A global rank's tensor-parallel rank within its stage."""
        return self.local_rank(rank) % self.tensor_parallel_size

    def reporter(self, engine: int) -> int:
        """The rank that samples and reports each step's tokens to the scheduler: the last
        stage's first tensor rank (the head itself without pipeline stages)."""
        return self.head(engine) + (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def describe(self, rank: int) -> str:
        """engine.stage.rank, as `ps` and the status name a rank (e0.s1.t0)."""
        return f"e{self.engine_of(rank)}.s{self.stage_of(rank)}.t{self.tensor_rank(rank)}"


def parse_partition(text: str) -> tuple[int, ...]:
    """--pipeline-layer-partition (argparse's type, for run_pipeline and bench): a comma list
    of layer counts, one per stage (9,7)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--pipeline-layer-partition must be a comma list of layer counts, one per stage "
            f"(e.g. 9,7), got {text!r}") from None


def partition_layers(num_layers: int, num_stages: int,
                     given: tuple[int, ...] | None = None) -> list[range]:
    """Each stage's contiguous range of the model's layers. `given`: the count of each stage
    (--pipeline-layer-partition), checked; else even, the remainder going one layer each to
    the stages before the last, from the last backwards (as vLLM's get_pp_indices: the last
    stage also runs the norm, the head and sampling, the first only the embedding's lookup)."""
    if given is not None:
        if len(given) != num_stages:
            raise ValueError(f"--pipeline-layer-partition gives {len(given)} stage(s) "
                             f"({','.join(map(str, given))}) for --pipeline-parallel-size "
                             f"{num_stages}")
        if min(given) < 1 or sum(given) != num_layers:
            raise ValueError(f"--pipeline-layer-partition {','.join(map(str, given))}: each "
                             f"stage needs at least one layer and they must sum to the model's "
                             f"{num_layers} layers")
        counts = list(given)
    else:
        if num_stages > num_layers:
            raise ValueError(f"--pipeline-parallel-size {num_stages}: the model has only "
                             f"{num_layers} layers, at least one a stage")
        counts = [num_layers // num_stages] * num_stages
        for i in range(num_layers % num_stages):
            counts[-2 - i] += 1  # (the remainder is below num_stages)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges
