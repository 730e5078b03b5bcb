"""The launcher's view of its data-parallel engines (each a scheduler and its executor ranks,
on this host or joined from another): which processes make up each, which still serve, and
their accounting added up into one. Runs in the launcher's process."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ipc.messages import Histogram, SchedulerStats
from ipc.ranks import RankLayout

MEAN_FIELDS = ("device_idle_fraction",)  # a fraction: the engines' mean, not their sum
# (block_size: every engine's is the same)
MAX_FIELDS = ("uptime_s", "run_ahead_depth", "max_seq_blocks", "block_size")
# Counts that only grow (Prometheus counters and histograms): an engine that went down keeps
# its part, or the sums would fall, which a scraper reads as a reset.
CUMULATIVE_FIELDS = ("num_preemptions", "num_steps", "prefix_cache_queries",
                     "prefix_cache_hits", "finished", "prompt_tokens", "generation_tokens",
                     "step_seconds_buckets", "step_seconds_sum", "step_tokens_buckets",
                     "step_tokens_sum", "num_refused_messages", "request_phases",
                     "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
                     "spec_accepted_per_pos", "discarded_tokens")


def combine_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """The engines' accounting as one: counts, gauges and histogram buckets added up (the
    metrics of `serve` read like one engine's), the idle fraction their mean."""
    if len(stats) == 1:
        return stats[0]
    values: dict[str, Any] = {}
    for f in dataclasses.fields(SchedulerStats):
        parts = [getattr(s, f.name) for s in stats]
        if f.name in MEAN_FIELDS:
            values[f.name] = sum(parts) / len(parts)
        elif f.name in MAX_FIELDS:
            values[f.name] = max(parts)
        elif f.name == "engine":
            values[f.name] = 0
        else:
            values[f.name] = _add(parts)
    return SchedulerStats(**values)


def _add(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, list):  # histogram buckets (an engine without steps has none yet)
        width = max(len(p) for p in parts)
        return [sum(p[i] for p in parts if i < len(p)) for i in range(width)]
    if isinstance(first, dict):
        keys = dict.fromkeys(k for p in parts for k in p)
        return {k: _add([p[k] for p in parts if k in p]) for k in keys}
    if isinstance(first, Histogram):
        return Histogram(_add([p.buckets for p in parts]), sum(p.sum for p in parts))
    if isinstance(first, str):  # (a configuration's: every engine runs the same)
        return first
    return sum(parts)


@dataclass
class EngineRestart:
    """An engine being started again after its scheduler or an executor rank died (or started
    late: one whose joined pipeline stages wait for their host): its old processes stop
    ("stopping"), then, once the restart policy's delay is over (and the host of its joined
    stages has joined: "joining"), its executor ranks load the model anew ("loading"), then
    its scheduler starts on the new cache ("starting"); it serves once that scheduler is
    ready."""

    cause: str  # the death that took it down
    began: float  # monotonic
    due: float  # when the new processes may start
    incarnation: int  # the new processes' (one more than the dead ones')
    phase: str = "stopping"


class Engines:
    """Which stage processes belong to which engine, and which engines serve. An engine on
    this host whose scheduler or executor dies is taken down (its other processes stopped,
    its requests failed) and started again (`restarting`); one that keeps dying stays down,
    or fails the pipeline if no other engine serves. One that joined from another host and
    went silent is taken down for good."""

    def __init__(self, num_engines: int, tensor_parallel_size: int,
                 pipeline_parallel_size: int = 1, joined_stages: int = 0) -> None:
        self.num_engines = num_engines
        # Where each engine's executor ranks are (engines that join later follow the rule).
        self.layout = RankLayout(num_engines, tensor_parallel_size, pipeline_parallel_size,
                                 joined_stages)
        # With joined pipeline stages: the engines whose host of those stages has joined
        # (engine -> its roster name, "pipeline:E"), and where each engine's ranks meet now
        # (HOST:PORT of its TCP store, new each time it starts; the status carries it there)
        self.hosts: dict[int, str] = {}
        self.rendezvous: dict[int, str] = {}
        self.alive = [True] * num_engines
        self.ready = [True] * num_engines  # one joining from another host is not, at first
        self.stats: list[SchedulerStats | None] = [None] * num_engines
        self.incarnation = [0] * num_engines  # one more each time an engine is started again
        self.restarting: dict[int, EngineRestart] = {}
        self.down_why: dict[str, str] = {}  # str(engine) -> the death that took it down
        self._retired: list[SchedulerStats] = []  # the last stats of engines' past lives

    def grow(self) -> int:
        """An engine joins from another host: its index (it counts once ready)."""
        self.alive.append(True)
        self.ready.append(False)
        self.stats.append(None)
        self.incarnation.append(0)
        self.num_engines += 1
        return self.num_engines - 1

    def engine_of(self, name: str) -> int | None:
        """The engine of a stage process ("scheduler:E", "executor:R"), or None."""
        stage, _, rank = name.partition(":")
        if stage == "scheduler":
            return int(rank)
        if stage == "executor":
            return self.layout.engine_of(int(rank))
        return None

    def processes(self, engine: int) -> list[str]:
        """The names of an engine's processes."""
        return [f"scheduler:{engine}",
                *(f"executor:{r}" for r in self.layout.engine_ranks(engine))]

    def can_lose(self, name: str) -> int | None:
        """The engine a dead process takes down alone, or None: the process is no engine's,
        or its engine is the last one serving (then the pipeline fails)."""
        engine = self.engine_of(name)
        if engine is None or self.num_engines == 1:
            return None
        if not self.alive[engine]:
            return engine  # a process of an engine already down (stopped by us)
        serving = sum(a and r for a, r in zip(self.alive, self.ready, strict=True))
        return engine if serving > 1 else None

    def take_down(self, engine: int) -> None:
        self.alive[engine] = False  # its last stats stay, for the cumulative counts

    def await_host(self, engine: int, why: str, now: float, incarnation: int) -> None:
        """Engine `engine` waits, down, for the host of its joined pipeline stages (at the
        start, or once that host left): once its processes here have stopped it waits
        "joining", and loads once a host joins (EngineRestarts.advance)."""
        self.alive[engine] = False
        self.hosts.pop(engine, None)
        self.rendezvous.pop(engine, None)
        self.down_why[str(engine)] = why
        self.restarting[engine] = EngineRestart(why, now, now, incarnation)

    def needs_host(self) -> int | None:
        """The first engine whose joined pipeline stages have no host, if any."""
        if not self.layout.joined_stages:
            return None
        return next((e for e in range(self.num_engines) if e not in self.hosts), None)

    def after_death(self, engine: int,
                    delay: Callable[[], float | None]) -> tuple[str, float]:
        """What the death of a process of local engine `engine` means: ("ignore", 0) for a
        process of an engine already down for good or stopping (stopped by us); ("restart",
        seconds) to take it down if it serves and start it again after `delay()` (the restart
        policy's, which records the restart); ("down", 0) when it keeps dying (delay() is None)
        and another engine serves: it stays down; ("fail", 0) when it keeps dying and no other
        engine serves: the pipeline fails. (A restart still stopping or waiting for its
        host, "joining", ignores a death: nothing of it runs.)"""
        restart = self.restarting.get(engine)
        if restart is None and not self.alive[engine]:
            return "ignore", 0.0
        if restart is not None and restart.phase in ("stopping", "joining"):
            return "ignore", 0.0
        wait = delay()
        if wait is not None:
            return "restart", wait
        self.restarting.pop(engine, None)
        return ("down" if self.serving_besides(engine) else "fail"), 0.0

    def serving_besides(self, engine: int) -> int:
        """How many engines other than `engine` serve."""
        return sum(a and r for e, (a, r) in enumerate(zip(self.alive, self.ready, strict=True))
                   if e != engine)

    def back(self, engine: int) -> None:
        """Engine `engine` serves again, started anew: its counts so far stay in the totals
        (combined() adds a down engine's last stats; the new one counts from zero)."""
        restart = self.restarting.pop(engine)
        self.incarnation[engine] = restart.incarnation
        old = self.stats[engine]
        if old is not None:
            self._retired.append(old)
        self.stats[engine] = None
        self.alive[engine] = True

    def record(self, stats: SchedulerStats) -> None:
        if 0 <= stats.engine < self.num_engines and self.alive[stats.engine] \
                and self.ready[stats.engine]:
            self.stats[stats.engine] = stats

    def combined(self) -> SchedulerStats | None:
        """Every serving engine's latest stats as one (None until each has reported)."""
        live = [s for s, alive, ready in zip(self.stats, self.alive, self.ready, strict=True)
                if alive and ready]
        if not live or any(s is None for s in live):
            return None
        total = combine_stats([s for s in live if s is not None])
        gone = [s for s, alive in zip(self.stats, self.alive, strict=True)
                if not alive and s is not None] + self._retired
        if not gone:
            return total
        return dataclasses.replace(total, **{f: _add([getattr(s, f) for s in (total, *gone)])
                                             for f in CUMULATIVE_FIELDS})

    def loads(self) -> list[int]:
        return [s.load_tokens if s is not None and alive else 0
                for s, alive in zip(self.stats, self.alive, strict=True)]
