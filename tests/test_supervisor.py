"""The stage supervisor with fake processes: starting under a name, waiting for ready reports,
seeing a death, restarting with backoff and giving up, an engine's start-up order and its KV
capacity check, stopping (SIGTERM, then SIGKILL). No process is started: a fake's sentinel is
the read end of a pipe that its "death" closes, as a real process's sentinel is."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import pytest

from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.model_info import ModelInfo
from pipeline.runtime.restarts import MAX_RESTARTS
from pipeline.runtime.supervisor import (
    STAGE_TARGETS,
    Report,
    StartupError,
    Supervisor,
    check_cache_holds_a_sequence,
    control_reports,
)
from stages.entry import run_stage


class FakeProcess:
    """A process that runs until die() (or terminate(), unless it ignores SIGTERM)."""

    def __init__(self, name: str, target: Callable[..., object], args: tuple[Any, ...],
                 ignores_sigterm: bool = False) -> None:
        self.name, self.target, self.args = name, target, args
        self.pid: int | None = 1000 + len(name)
        self.exitcode: int | None = None
        self.ignores_sigterm = ignores_sigterm
        self.signals: list[str] = []
        self._read, self._write = os.pipe()

    @property
    def sentinel(self) -> int:
        return self._read

    def die(self, code: int = 1) -> None:
        if self.exitcode is None:
            self.exitcode = code
            os.close(self._write)  # the sentinel becomes readable, as at a real exit

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.signals.append("TERM")
        if not self.ignores_sigterm:
            self.die(-15)

    def kill(self) -> None:
        self.signals.append("KILL")
        self.die(-9)


class Factory:
    """Makes FakeProcesses, remembering each in start order."""

    def __init__(self, ignores_sigterm: tuple[str, ...] = ()) -> None:
        self.started: list[FakeProcess] = []
        self.ignores_sigterm = ignores_sigterm

    def __call__(self, name: str, target: Callable[..., object],
                 args: tuple[Any, ...]) -> FakeProcess:
        proc = FakeProcess(name, target, args, name in self.ignores_sigterm)
        self.started.append(proc)
        return proc

    def names(self) -> list[str]:
        return [p.name for p in self.started]


def config(tp: int = 1, max_model_len: int = 256) -> PipelineConfig:
    model = ModelInfo(path="/nonexistent", vocab_size=100, max_model_len=max_model_len,
                      eos_token_ids=(2,))
    cfg = PipelineConfig(model=model, scheduler=SchedulerConfig(block_size=16),
                         executor=ExecutorConfig())
    return dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor,
                                                                tensor_parallel_size=tp))


def scripted(reports: list[Report]) -> Callable[[int], Report | None]:
    """Reports handed out one per call, then none."""
    queue = list(reports)
    return lambda wait_ms: queue.pop(0) if queue else None


def test_a_stage_runs_its_entry_point_with_the_config_rank_and_parent() -> None:
    factory, cfg = Factory(), config()
    sup = Supervisor(cfg, start=factory)
    sup.spawn_stage("tokenizer", 1, 4242)
    (proc,) = factory.started
    assert proc.name == "tokenizer:1" and proc.target is run_stage
    assert proc.args == (STAGE_TARGETS["tokenizer"], cfg, 1, os.getpid(), 4242)
    assert set(STAGE_TARGETS) == {"executor", "scheduler", "tokenizer", "detokenizer"}


def test_wait_ready_records_what_each_reported() -> None:
    sup = Supervisor(config(), start=Factory())
    sup.spawn_stage("tokenizer", 0)
    sup.spawn_stage("detokenizer", 0)
    reports = scripted([Report("detokenizer:0", {"stage_port": 7}), Report("other:3"),
                        Report("tokenizer:0", {"tcp_port": 9})])
    assert sup.wait_ready(["tokenizer:0", "detokenizer:0"], reports) == [
        {"tcp_port": 9}, {"stage_port": 7}]
    assert sup.ready["other:3"] == {}  # (a report of a stage it did not start is kept too)


def test_a_failure_report_or_an_early_exit_or_silence_is_a_startup_error() -> None:
    factory = Factory()
    sup = Supervisor(config(), start=factory)
    sup.spawn_stage("executor", 0)
    with pytest.raises(StartupError, match="stage executor:0 failed to start: no weights"):
        sup.wait_ready(["executor:0"], scripted([Report("executor:0", failure="no weights")]))
    factory.started[0].die(3)
    with pytest.raises(StartupError,
                       match="executor:0 exited with code 3 before it was ready: out of memory"):
        sup.wait_ready(["executor:0"], scripted([Report("executor:0", failure="out of memory")]))
    sup.spawn_stage("tokenizer", 0)
    with pytest.raises(StartupError, match=r"tokenizer:0 did not report ready within 0 s"):
        sup.wait_ready(["tokenizer:0"], scripted([]), timeout_s=0.05)


def test_an_engine_starts_its_executors_then_its_scheduler_with_the_cache_size() -> None:
    factory = Factory()
    sup = Supervisor(config(tp=2), start=factory)
    sup.spawn_executors(1)
    assert factory.names() == ["executor:2", "executor:3"]  # the ranks of engine 1
    reports = scripted([Report("executor:3", {}), Report("executor:2", {"num_kv_blocks": 64})])
    sup.start_scheduler(1, reports, "members")
    assert factory.names()[-1] == "scheduler:1"
    assert factory.started[-1].args[-2:] == (64, "members")  # num_blocks, then the extras


def test_a_cache_smaller_than_one_sequence_starts_no_scheduler() -> None:
    factory = Factory()
    sup = Supervisor(config(max_model_len=256), start=factory)
    sup.spawn_executors(0)
    with pytest.raises(StartupError, match=r"holds 240 tokens \(15 blocks\), fewer than one "
                       "sequence of the context length 256: raise --kv-cache-memory"):
        sup.start_scheduler(0, scripted([Report("executor:0", {"num_kv_blocks": 15})]))
    assert factory.names() == ["executor:0"]
    check_cache_holds_a_sequence(config(max_model_len=256), 16)  # exactly one: enough


def test_a_model_with_windowed_layers_needs_what_its_kv_groups_hold() -> None:
    """Windowed layers beside global ones (KV groups (None, 8)): a sequence of 256 tokens
    holds its 16 pages in the global layers' group and the 2 its window spans in the other:
    18 blocks, though 16 would hold its tokens once."""
    model = ModelInfo(path="/nonexistent", vocab_size=100, max_model_len=256,
                      eos_token_ids=(2,), kv_windows=(None, 8))
    cfg = dataclasses.replace(config(), model=model)
    with pytest.raises(StartupError, match=r"it needs 18 blocks over the model's 2 KV groups"):
        check_cache_holds_a_sequence(cfg, 17)
    check_cache_holds_a_sequence(cfg, 18)
    # every layer windowed: one token's window, and a sequence longer than the cache runs
    windowed = dataclasses.replace(model, kv_windows=(64,))
    check_cache_holds_a_sequence(dataclasses.replace(config(), model=windowed), 5)


def test_watch_reports_each_death_once() -> None:
    factory = Factory()
    sup = Supervisor(config(), start=factory)
    for rank in range(3):
        sup.spawn_stage("tokenizer", rank)
    assert sup.watch(0.01) == []
    factory.started[1].die(7)
    assert sup.watch(1.0) == ["tokenizer:1"]
    assert sup.watch(0.01) == []  # not again
    assert sup.alive() == {"tokenizer:0": True, "tokenizer:1": False, "tokenizer:2": True}


def test_a_restart_waits_its_delay_and_gets_fresh_arguments() -> None:
    clock = [100.0]
    factory = Factory()
    sup = Supervisor(config(), start=factory, clock=lambda: clock[0])
    sup.spawn_stage("detokenizer", 0, "old roster", 0)
    for expected_delay in (0.0, 0.5):
        factory.started[-1].die()
        assert sup.watch(0.01) == ["detokenizer:0"]
        assert sup.restart_later("detokenizer:0", lambda: ("new roster", 5)) == expected_delay
        assert sup.restarting("detokenizer:0")
        clock[0] += expected_delay / 2
        if expected_delay:
            sup.watch(0.01)
            assert len(factory.started) == 2  # not yet
        clock[0] += expected_delay
        sup.watch(0.01)
        assert not sup.restarting("detokenizer:0")
    assert len(factory.started) == 3
    assert factory.started[-1].args[-2:] == ("new roster", 5)
    assert sup.procs["detokenizer:0"] is factory.started[-1]
    factory.started[-1].die(9)
    assert sup.watch(1.0) == ["detokenizer:0"]  # the new process is watched


def test_one_that_keeps_dying_is_given_up() -> None:
    clock = [100.0]
    factory = Factory()
    sup = Supervisor(start=factory, clock=lambda: clock[0])  # (serve's: no pipeline config)
    sup.start("api:0", print, "an argument")
    delays = []
    for _ in range(MAX_RESTARTS + 1):
        factory.started[-1].die()
        assert sup.watch(0.01) == ["api:0"]
        delays.append(delay := sup.restart_later("api:0"))
        clock[0] += delay or 0.0
        sup.watch(0.01)
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, None]  # within RESTART_WINDOW_S
    assert len(factory.started) == MAX_RESTARTS + 1 and not sup.restarting("api:0")
    assert all(p.args == ("an argument",) for p in factory.started)  # as first started
    assert sup.restarts.counts == {"api:0": MAX_RESTARTS}
    with pytest.raises(RuntimeError, match="no pipeline config"):
        sup.spawn_stage("tokenizer", 0)


def test_an_unwatched_death_is_not_reported_and_stop_ends_everything() -> None:
    factory = Factory(ignores_sigterm=("scheduler:0",))
    sup = Supervisor(config(), start=factory)
    sup.spawn_executors(0)
    sup.spawn_stage("scheduler", 0, 64)
    sup.spawn_stage("tokenizer", 0)
    sup.terminate("executor:0")  # an engine taken down: its death is expected
    assert sup.watch(0.05) == []
    sup.procs["tokenizer:0"].die()  # type: ignore[attr-defined]
    sup.restart_later("tokenizer:0")
    sup.stop(timeout=0.01)
    assert not any(p.is_alive() for p in factory.started)
    by_name = {p.name: p for p in factory.started}
    assert by_name["scheduler:0"].signals == ["TERM", "KILL"]  # past the timeout
    assert by_name["executor:0"].signals == ["TERM"]
    assert sup.watch(0.01) == [] and not sup.restarting("tokenizer:0")
    assert len(factory.started) == 3  # a stopped supervisor starts nothing again


def test_control_reports_reads_the_stages_messages() -> None:
    from ipc.messages import StageAlive, StageFailed, StageReady

    messages: list[Any] = [StageReady("scheduler", 1, 99, {"tcp_port": 5}),
                           StageAlive("scheduler", 1),
                           StageFailed("tokenizer", 0, 123, "no tokenizer.json"), None]
    reports = control_reports(lambda wait_ms: messages.pop(0))
    assert reports(0) == Report("scheduler:1", {"tcp_port": 5})
    assert reports(0) is None  # a heartbeat is not a start-up report
    assert reports(0) == Report("tokenizer:0", failure="no tokenizer.json")
    assert reports(0) is None
