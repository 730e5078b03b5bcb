"""The one supervisor of child processes: start each under a name, wait for it to report ready,
watch for its death, start a dead one again with backoff (RestartPolicy), stop them all
(SIGTERM, then SIGKILL) and unlink the engines' rings. The launcher supervises every stage of a
pipeline with it, a stage joining from another host (remote.py) its engine's processes or its
one worker, and `serve` its HTTP workers. What to do about a death (restart, take an engine
down, fail the pipeline) stays with each of them; how processes are started, watched and
stopped is here once.

Processes come from a factory (`spawn_process`: multiprocessing's spawn context), so the
supervision can be tested with fake processes (tests/test_supervisor.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import wait
from typing import Any, Protocol

from ipc.config import PipelineConfig
from ipc.messages import Message, StageFailed, StageReady
from ipc.step import StepRings
from pipeline.runtime.restarts import RestartPolicy
from stages.entry import run_stage
from stages.scheduler.kv_manager import blocks_to_run

logger = logging.getLogger(__name__)

# The entry point of each stage kind: run_stage imports it in the child, so the launcher's
# process never imports the stages' heavy modules (torch, the tokenizer).
STAGE_TARGETS = {"executor": "stages.executor.process:run_executor",
                 "scheduler": "stages.scheduler.process:run_scheduler",
                 "tokenizer": "stages.tokenizer:run_tokenizer",
                 "detokenizer": "stages.detokenizer:run_detokenizer"}


class StartupError(RuntimeError):
    """A process did not come up; the message names it and says why."""


class Process(Protocol):
    """What the supervisor needs of a process (multiprocessing's, or a test's fake)."""

    pid: int | None
    exitcode: int | None

    @property
    def sentinel(self) -> int: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


# name, target, args -> the started process
ProcessFactory = Callable[[str, Callable[..., object], tuple[Any, ...]], Process]


@dataclasses.dataclass(frozen=True)
class Report:
    """What a process said while starting: ready (with what it reports, e.g. its ports), or
    failed (with why)."""

    name: str
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    failure: str | None = None


# The next report within this many milliseconds, or None.
Reports = Callable[[int], Report | None]


def control_reports(recv: Callable[[int], Message | None]) -> Reports:
    """The stages' StageReady/StageFailed on a control channel as Reports (recv: the
    channel's recv_foreign_safe); other messages are skipped."""
    def reports(wait_ms: int) -> Report | None:
        msg = recv(wait_ms)
        if isinstance(msg, StageReady):
            return Report(f"{msg.stage}:{msg.rank}", dict(msg.info))
        if isinstance(msg, StageFailed):
            return Report(f"{msg.stage}:{msg.rank}", failure=msg.message)
        return None
    return reports


def spawn_process(name: str, target: Callable[..., object], args: tuple[Any, ...]) -> Process:
    """A new process of multiprocessing's spawn context (a clean interpreter: no inherited
    threads, CUDA or ZeroMQ state), named `llm-pipeline:<name>` in ps and the logs."""
    proc = mp.get_context("spawn").Process(target=target, args=args,
                                           name=f"llm-pipeline:{name}", daemon=False)
    with main_hidden():
        proc.start()
    return proc


class Supervisor:
    """The processes of one owner, by name ("executor:0", "tokenizer:1", "api:0").

    cfg: the run's config, for the stages (spawn_stage, the engine start-up, the rings);
    `serve`'s supervisor of HTTP workers has none."""

    def __init__(self, cfg: PipelineConfig | None = None, *,
                 start: ProcessFactory = spawn_process,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """start: makes the processes; clock: the time restarts are due by (both for tests)."""
        self.cfg = cfg
        self.procs: dict[str, Process] = {}
        self.ready: dict[str, dict[str, Any]] = {}  # name -> what it reported when first ready
        self.restarts = RestartPolicy(clock)
        self._start, self._clock = start, clock
        # name -> its target, the arguments it always gets, those a restart may replace
        self._how: dict[str, tuple[Callable[..., object], tuple[Any, ...], tuple[Any, ...]]] = {}
        self._watched: dict[int, str] = {}  # sentinel -> name, of the processes watched
        self._due: dict[str, tuple[float, Callable[[], tuple[Any, ...]] | None]] = {}

    # ------------------------------------------------------------ start

    def start(self, name: str, target: Callable[..., object], *args: Any) -> Process:
        """Start `name` (a new process running target(*args)) and watch it."""
        return self._launch(name, target, args, ())

    def spawn_stage(self, stage: str, rank: int, *args: Any) -> Process:
        """Start stage `stage` rank `rank` of the run (its entry point gets the config, the
        rank, this process's pid, then `args`, which a restart may replace)."""
        fixed = (STAGE_TARGETS[stage], self._cfg, rank, os.getpid())
        return self._launch(f"{stage}:{rank}", run_stage, fixed, args)

    def _launch(self, name: str, target: Callable[..., object], fixed: tuple[Any, ...],
                extra: tuple[Any, ...]) -> Process:
        proc = self._start(name, target, (*fixed, *extra))
        self.procs[name] = proc
        self._how[name] = (target, fixed, extra)
        self._watched[proc.sentinel] = name
        return proc

    def wait_ready(self, names: Iterable[str], reports: Reports,
                   timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Wait until each of `names` has reported ready; what each reported, in order.
        StartupError when one reports a failure, exits first, or the time runs out."""
        names = list(names)
        if timeout_s is None:
            timeout_s = self._cfg.ready_timeout_s
        deadline = time.monotonic() + timeout_s
        while missing := [n for n in names if n not in self.ready]:
            for name in missing:
                proc = self.procs[name]
                if not proc.is_alive():
                    last = reports(500)  # its failure report, if it sent one
                    why = f": {last.failure}" if last is not None and last.failure else ""
                    raise StartupError(f"stage {name} exited with code {proc.exitcode} "
                                       f"before it was ready{why}")
            if time.monotonic() > deadline:
                raise StartupError(f"stage(s) {', '.join(missing)} did not report ready within "
                                   f"{timeout_s:.0f} s")
            report = reports(100)
            if report is None:
                continue
            if report.failure is not None:
                raise StartupError(f"stage {report.name} failed to start: {report.failure}")
            self.ready[report.name] = report.info
        return [self.ready[name] for name in names]

    # ------------------------------------------------------------ engines

    def spawn_executors(self, engine: int, rendezvous: str = "", joined: bool = False) -> None:
        """Start the executor ranks of engine `engine` on this host (ipc/ranks.py says which:
        `joined`, those of the stages a joined host runs). rendezvous: HOST:PORT of the
        engine's TCP store, where its stages span hosts."""
        layout = self._cfg.ranks
        ranks = layout.joined_ranks(engine) if joined else layout.local_ranks(engine)
        for rank in ranks:
            self.spawn_stage("executor", rank, rendezvous)

    def start_scheduler(self, engine: int, reports: Reports, *args: Any) -> None:
        """Once engine `engine`'s first executor rank is ready (its KV cache allocated),
        start its scheduler with the cache's size; StartupError if the cache cannot hold one
        sequence of the context length."""
        head = f"executor:{self._cfg.ranks.head(engine)}"
        num_blocks = self.wait_ready([head], reports)[0]["num_kv_blocks"]
        check_cache_holds_a_sequence(self._cfg, num_blocks)
        self.spawn_stage("scheduler", engine, num_blocks, *args)

    def unlink_rings(self, engines: Iterable[int]) -> None:
        """Unlink the shared-memory rings of these engines (once both users have them
        mapped, or once the run is over): nothing is left in /dev/shm."""
        if self.cfg is not None and self.cfg.run_id:  # the run exists
            for engine in engines:
                StepRings.unlink_engine_names(self.cfg.for_engine(engine))

    # ------------------------------------------------------------ watch

    def watch(self, timeout: float) -> list[str]:
        """Start the processes whose restart is due, then wait up to `timeout` s for a
        watched process to exit: the names of those that did (reaped, so their exit codes
        are known, and no longer watched). Sleeps the timeout when nothing is watched."""
        now = self._clock()
        for name, (when, extra) in list(self._due.items()):
            if now >= when:
                del self._due[name]
                target, fixed, first = self._how[name]
                self._launch(name, target, fixed, first if extra is None else extra())
        if not self._watched:
            time.sleep(timeout)
            return []
        dead = []
        for sentinel in wait(list(self._watched), timeout=timeout):
            name = self._watched.pop(sentinel)  # type: ignore[call-overload]
            self.procs[name].join(1.0)
            dead.append(name)
        return dead

    def restart_later(self, name: str,
                      extra: Callable[[], tuple[Any, ...]] | None = None) -> float | None:
        """Start dead `name` again after the restart policy's delay (watch() starts it) with
        the same target and arguments, those that spawn_stage's caller gave replaced by
        extra() (called then) if given. The delay, or None: it died too often, and is not
        started again."""
        delay = self.restarts.delay(name)
        if delay is not None:
            self._due[name] = (self._clock() + delay, extra)
        return delay

    def restarting(self, name: str) -> bool:
        return name in self._due

    def unwatch(self, name: str) -> None:
        """Stop watching `name` (its death is expected: an engine taken down)."""
        proc = self.procs.get(name)
        if proc is not None:
            self._watched.pop(proc.sentinel, None)

    def alive(self) -> dict[str, bool]:
        return {name: p.is_alive() for name, p in self.procs.items()}

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items() if p.pid is not None}

    # ------------------------------------------------------------ stop

    def terminate(self, name: str) -> None:
        """SIGTERM `name`, unwatched (stop() waits for it)."""
        self.unwatch(name)
        proc = self.procs[name]
        if proc.is_alive():
            proc.terminate()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process, SIGKILL those still running after `timeout` s; none is
        started again."""
        self._due.clear()
        self._watched.clear()
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("%s did not stop in %.0f s: killing it", name, timeout)
                proc.kill()
                proc.join(5)

    @property
    def _cfg(self) -> PipelineConfig:
        if self.cfg is None:
            raise RuntimeError("this supervisor has no pipeline config: it starts no stage")
        return self.cfg


def check_cache_holds_a_sequence(cfg: PipelineConfig, num_blocks: int) -> None:
    """StartupError unless an engine's KV cache of `num_blocks` blocks holds one sequence of
    the context length (otherwise a long request could never be scheduled): every page of
    it, but in a windowed KV group those one token's window spans (blocks_to_run)."""
    limits = cfg.limits
    needed = blocks_to_run(limits.kv_windows, limits.block_size, limits.max_model_len)
    if needed > num_blocks:
        groups = len(limits.kv_windows)
        how = (f" (it needs {needed} blocks over the model's {groups} KV groups)"
               if groups > 1 or limits.kv_windows[0] is not None else "")
        raise StartupError(
            f"the KV cache holds {num_blocks * limits.block_size} tokens ({num_blocks} "
            f"blocks), fewer than one sequence of the context length "
            f"{limits.max_model_len}{how}: raise --kv-cache-memory or lower --max-model-len")


@contextlib.contextmanager
def main_hidden() -> Iterator[None]:
    """While a process is spawned, the user's script is not named as `__main__`: a spawned
    child would run it again to rebuild that module (without an `if __name__ == "__main__"`
    guard, it would start a pipeline of its own). A stage needs nothing of it: its target is
    a module path, its arguments are our types."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__")
             if hasattr(main, name)}
    main.__spec__ = None  # type: ignore[assignment]
    if hasattr(main, "__file__"):
        del main.__file__
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
