"""The launcher: starts every stage process, waits for each to report ready, supervises them,
and stops them all, leaving no process, socket file or shared-memory segment behind. Runs in
the process that owns the pipeline (the CLI, a server, a user's program).

`Pipeline` is the public face and the supervision loop; what a death means and the rest are
its parts: spawning.py (the run and its processes, through supervisor.py, which a joining
host and `serve` use too), engine_restarts.py (an engine taken down and started again),
bootstrap.py (remote clients and joining stages, CURVE), status.py (the status published)."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from ipc import curve
from ipc.channels import PullChannel
from ipc.codec import Codec, ProtocolError
from ipc.config import PipelineConfig
from ipc.messages import (
    JoinedRankDied,
    Message,
    PipelineStatus,
    SchedulerStats,
    StageAlive,
    StageFailed,
    StageLeaving,
    StageReady,
    StageRestarted,
)
from pipeline.runtime.bootstrap import Bootstrap
from pipeline.runtime.client import PipelineClient
from pipeline.runtime.engine_restarts import NO_MESSAGE, EngineRestarts, LastFailure
from pipeline.runtime.engines import Engines
from pipeline.runtime.restarts import RESTARTABLE
from pipeline.runtime.roster import REMOTE_SILENCE_S, Member, Roster, kind_of
from pipeline.runtime.spawning import check_device, create_run, remove_run, spawn_stages
from pipeline.runtime.status import StatusPublisher, pipeline_status
from pipeline.runtime.supervisor import Supervisor, control_reports
from stages.executor.preflight import check_executor
from stages.peers import Peers

logger = logging.getLogger(__name__)

__all__ = ["Pipeline"]


class Pipeline:
    """Owns one run: its directory, rings and stage processes. Use as a context manager."""

    def __init__(self, cfg: PipelineConfig, trace_path: str | None = None) -> None:
        """trace_path: write a Chrome-trace timeline of every stage there when the run stops.
        Nothing is created before start()."""
        self.cfg = cfg
        self.trace_path = trace_path
        self.supervisor = Supervisor()  # the stage processes (its config set by start())
        self.failure: str | None = None
        self.endpoints_path: Path | None = None  # <run dir>/pipeline.json, once started
        self.engines = Engines(cfg.data_parallel_size, cfg.executor.tensor_parallel_size,
                               cfg.executor.pipeline_parallel_size,
                               cfg.executor.joined_pipeline_stages)
        self.roster: Roster | None = None  # every stage and its address, once started
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._started = False
        self._zmq = zmq.Context()
        self._supervisor: threading.Thread | None = None
        self._control: PullChannel | None = None
        self._bootstrap: Bootstrap | None = None  # the tcp:// face, once the run exists
        self._restarts: EngineRestarts | None = None  # once the roster exists
        self._clients: list[PipelineClient] = []
        self._last_failure = LastFailure()  # the latest StageFailed's message
        self._to_engines: queue.SimpleQueue[Message] = queue.SimpleQueue()  # tell_engines
        # Ranks a pipeline host said died, each with the engine's rendezvous it ran at
        self._joined_dead: list[JoinedRankDied] = []

    @property
    def address(self) -> str | None:
        """With cfg.remote.listen_host: the tcp:// bootstrap address for remote clients."""
        return self._bootstrap.address if self._bootstrap is not None else None

    @property
    def num_refused_bootstraps(self) -> int:
        """Requests for the endpoints without the client key."""
        return self._bootstrap.num_refused if self._bootstrap is not None else 0

    @property
    def procs(self) -> dict[str, Any]:
        """Every local stage process, by name ("executor:0")."""
        return self.supervisor.procs

    @property
    def _ctl(self) -> PullChannel:
        if self._control is None:
            raise RuntimeError("the pipeline was not started")
        return self._control

    # ------------------------------------------------------------ start

    def start(self) -> Pipeline:
        if self._started:
            raise RuntimeError("a Pipeline starts once; make a new one")
        self._started = True
        check_device(self.cfg.executor.device)  # before anything starts
        # What the executors cannot do (--compile, the ranks' shapes and devices) is a
        # ConfigError now, not an executor failure.
        check_executor(self.cfg)
        try:
            publisher = self._start_run()
        except BaseException:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, args=(publisher,),
                                            name="supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _start_run(self) -> StatusPublisher:
        """The run, its control socket, every stage ready, the roster; the status publisher
        (the supervisor thread's from here on)."""
        self.cfg = self.supervisor.cfg = create_run(self.cfg, self.trace_path is not None)
        boot = self._bootstrap = Bootstrap(self._zmq, self.cfg)  # (before any socket: CURVE)
        self._control = PullChannel(self._zmq, self.cfg.control_address,
                                    Codec([StageReady, StageFailed, SchedulerStats, StageAlive,
                                           StageLeaving, JoinedRankDied]),
                                    bind=True, secret=self.cfg.keys.run_secret)
        boot.accept_stages(self._control.socket)
        spawn_stages(self.supervisor, self.cfg, control_reports(self._ctl.recv_foreign_safe))
        roster = self.roster = Roster(self.cfg, boot.public_host)
        for name, info in self.supervisor.ready.items():
            stage, index = name.split(":")
            if stage != "executor":
                roster.local_ready(kind_of(stage), int(index), info.get("stage_port", 0))
        self._restarts = EngineRestarts(self.supervisor, self.engines, roster,
                                        self._last_failure, self._tell_members,
                                        boot.public_host)
        joined = range(self.cfg.data_parallel_size if self.engines.layout.joined_stages else 0)
        for engine in joined:  # (the hosts of their joined stages have yet to join)
            self.engines.await_host(engine, "waiting for the host of its pipeline stages "
                                    "to join (run_pipeline stage pipeline)", time.monotonic(), 0)
            roster.leave(roster.members[("engine", engine)])
        self._unlink_rings()  # both users have them mapped: nothing is left in /dev/shm
        self.endpoints_path = self.cfg.endpoints.save(self.cfg.run_dir)
        publisher = StatusPublisher(self._zmq, self.cfg)
        boot.open(publisher.socket, roster, self.supervisor.ready)
        return publisher

    def _unlink_rings(self) -> None:
        """(The executors may not have made them yet: unlinking none is not an error.)"""
        self.supervisor.unlink_rings(range(self.cfg.data_parallel_size))

    # ------------------------------------------------------------ supervise

    def _supervise(self, publisher: StatusPublisher) -> None:
        """Watch every stage process and the control channel (stats, failure reports),
        restart a dead tokenizer or detokenizer (see _survive), take down an engine
        whose scheduler or executor died while others serve, publish the status a few times
        a second, answer remote clients' requests for the endpoints. The sockets are this
        thread's from here on."""
        assert self.roster is not None and self._restarts is not None
        assert self._bootstrap is not None
        links = Peers(self._zmq, self.cfg.keys.run_secret, self.roster.view(False))
        if self.engines.layout.joined_stages:  # (the workers learn the engines wait)
            self._tell_members(links)
        try:
            while not self._stopping.is_set():
                dead = self.supervisor.watch(0.1)  # (and starts those due to restart)
                self._bootstrap.serve(self.roster, self.engines)
                self._drain_control(links)
                self._restarts.advance()
                while not self._to_engines.empty():
                    links.to_engines(self._to_engines.get())
                lost = [(m.name, m.leaving) for m in self.roster.silent(time.monotonic())
                        if not self._left(m, links)]
                dead += self._joined_deaths()
                fatal = [name for name in dead if not self._survive(name, links)]
                if (fatal or lost) and not self._stopping.is_set():
                    self._fail(fatal, lost, publisher)
                    return
                publisher.publish(self.status, force=bool(dead))
        finally:
            publisher.last(self.status())
            links.close()
            self._bootstrap.close()

    def _fail(self, fatal: list[str], lost: list[tuple[str, str]],
              publisher: StatusPublisher) -> None:
        """Stages died that the pipeline does not survive: it fails (the status says why)
        and stops."""
        names = ", ".join([f"{name} (exit code {self.procs[name].exitcode})" if name in self.procs
                           else f"{name} (on the host of its pipeline stages)" for name in fatal]
                          + [f"{name} (joined from another host, {why or 'gone silent'})"
                             for name, why in lost])
        self.failure = f"stage {names} died: {self._last_failure.message}"
        logger.error("%s; stopping the pipeline", self.failure)
        publisher.publish(self.status, force=True)
        threading.Thread(target=self.stop, name="stop").start()

    def _drain_control(self, links: Peers) -> None:
        assert self.roster is not None
        now = time.monotonic()
        while not self._stopping.is_set() and (msg := self._next_control()):
            if isinstance(msg, SchedulerStats):
                self.engines.record(msg)
                self.roster.seen("engine", msg.engine, now)
            elif isinstance(msg, StageAlive):
                self.roster.seen(kind_of(msg.stage), msg.rank, now)
            elif isinstance(msg, StageLeaving):
                self.roster.said_leaving(kind_of(msg.stage), msg.rank, msg.reason)
            elif isinstance(msg, StageReady):
                try:
                    self._ready(msg, links)
                except Exception:  # (a joined stage's bad report must not stop supervision)
                    logger.exception("could not take %s:%d's ready report", msg.stage,
                                     msg.rank)
            elif isinstance(msg, StageFailed):
                self._last_failure.message = msg.message
            elif isinstance(msg, JoinedRankDied):
                self._joined_dead.append(msg)

    def _joined_deaths(self) -> list[str]:
        """The ranks a pipeline host said died that ran in their engine's current start (a
        rank of a past start is no news: its engine started again already). The rank's own
        failure report, if it sent one, stays the cause."""
        dead = []
        layout = self.engines.layout
        for msg in self._joined_dead:
            if msg.engine in self.engines.hosts and layout.engine_of(msg.rank) == msg.engine \
                    and layout.joined(msg.rank) \
                    and self.engines.rendezvous.get(msg.engine) == msg.rendezvous:
                if self._last_failure.message == NO_MESSAGE:
                    self._last_failure.message = msg.message
                dead.append(f"executor:{msg.rank}")
        self._joined_dead.clear()
        return dead

    def _next_control(self) -> Message | None:
        """The next message from a stage; a frame that is not one is counted and skipped, so
        nothing sent to the control socket can stop the supervisor."""
        while True:
            try:
                return self._ctl.recv_nowait()
            except ProtocolError as exc:
                logger.warning("refused a frame on the control socket: %s", exc)

    def _ready(self, msg: StageReady, links: Peers) -> None:
        """A stage that joined from another host is ready (or a restarted one is)."""
        assert self.roster is not None and self._restarts is not None
        kind = kind_of(msg.stage)
        name = f"{msg.stage}:{msg.rank}"
        engine = self.engines.engine_of(name)
        if engine in self.engines.restarting and name in self.procs:
            self._restarts.stage_ready(engine, name, msg.info, links)
        elif self.roster.joined_ready(kind, msg.rank, msg.info, time.monotonic()):
            logger.warning("%s:%d joined from another host", msg.stage, msg.rank)
            if kind == "engine":
                self.engines.ready[msg.rank] = True
            self._tell_members(links)
        elif name in self.procs:
            logger.warning("stage %s:%d is running again", msg.stage, msg.rank)
        elif kind == "engine" and msg.rank < self.engines.num_engines \
                and not self.engines.ready[msg.rank]:  # refused (see joined_ready)
            self.engines.take_down(msg.rank)

    def _left(self, member: Member, links: Peers) -> bool:
        """A stage that had joined from another host said it stops, or went silent (its host
        or the network failed): an engine is taken down; the roster no longer names it.
        False: it was the last engine serving (the pipeline fails, as when a local one is)."""
        assert self._restarts is not None
        if member.leaving:
            logger.error("%s (joined from another host) stopped: %s", member.name,
                         member.leaving)
        else:
            logger.error("%s (joined from another host) has not been heard from for %.0f s: "
                         "it is gone", member.name, REMOTE_SILENCE_S)
        if member.kind == "pipeline":
            for engine in [e for e, name in self.engines.hosts.items() if name == member.name]:
                self._restarts.host_left(engine, member.name, member.leaving or "gone silent",
                                         links)
                self._tell_members(links)
            return True
        if member.kind != "engine" or not self.engines.alive[member.index]:
            self._tell_members(links)
            return True
        if not self.engines.ready[member.index]:  # it never served
            self.engines.take_down(member.index)
            self._tell_members(links)
            return True
        if self.engines.can_lose(f"scheduler:{member.index}") is None:
            return False
        self._restarts.take_down(member.index, member.name, links)
        return True

    def _tell_members(self, links: Peers) -> None:
        """Every stage learns the roster (each as it can reach the others); remote clients
        the endpoints."""
        assert self.roster is not None and self._bootstrap is not None
        links.update(self.roster.view(False))
        send = {"engine": links.to_engine, "tokenizer": links.to_tokenizer,
                "detokenizer": links.to_detokenizer}
        why = dict(self.engines.down_why)
        for member, members in self.roster.recipients():
            send[member.kind](member.index, dataclasses.replace(members, engines_down_why=why))
        if self._bootstrap.address is not None:
            self._bootstrap.update_endpoints(self.roster, self.supervisor.ready)

    def _survive(self, name: str, links: Peers) -> bool:
        """Deal with a dead stage process the pipeline survives: start a tokenizer or a
        detokenizer again, or take its engine down and start it again. False: the pipeline
        fails."""
        assert self._restarts is not None
        engine = self.engines.engine_of(name)
        if engine is not None and not self._stopping.is_set():
            return self._restarts.died(engine, name, links)
        # Tokenizers and detokenizers hold nothing that cannot be rebuilt: one that dies is
        # started again (RestartPolicy), unless it keeps dying; then the pipeline fails, as
        # it does when the scheduler or the executor of its last engine dies.
        if self._stopping.is_set() or name.split(":")[0] not in RESTARTABLE:
            return False
        delay = self.supervisor.restart_later(name, lambda: self._restart_args(name))
        if delay is None:
            return False
        logger.error("stage %s died (exit code %s: %s); starting it again in %.1f s", name,
                     self.procs[name].exitcode, self._last_failure.take(), delay)
        if name.startswith("detokenizer:"):  # the schedulers fail its requests now
            links.to_engines(StageRestarted("detokenizer", int(name.split(":")[1])))
        return True

    def _restart_args(self, name: str) -> tuple[Any, ...]:
        """What a dead tokenizer or detokenizer is started again with: the ports remote
        clients and stages know, and the roster as it stands."""
        assert self.roster is not None
        info = self.supervisor.ready[name]
        args: tuple[Any, ...] = (self.roster.view(False), info.get("stage_port", 0))
        if name.startswith("tokenizer:"):
            args = (info.get("tcp_port", 0), *args)
        return args

    # ------------------------------------------------------------ the owner's view

    def tell_engines(self, msg: Message) -> None:
        """Send every engine serving (joined ones included) a message from the launcher's
        process (serve's ForgetClient); the supervisor sends it within 0.1 s."""
        self._to_engines.put(msg)

    def idle_stats(self, timeout: float = 10.0) -> SchedulerStats:
        """The scheduler's stats once it has no request and no step in flight (they arrive a
        few times a second; one more report is awaited, so the last results are in)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.scheduler_stats
            if stats is not None and stats.num_requests == 0 and stats.num_inflight_steps == 0:
                time.sleep(0.3)
                if self.scheduler_stats is not None:
                    return self.scheduler_stats
            time.sleep(0.05)
        raise TimeoutError(f"the scheduler did not become idle: {self.scheduler_stats}")

    @property
    def scheduler_stats(self) -> SchedulerStats | None:
        """The serving engines' latest accounting, added up."""
        return self.engines.combined()

    def status(self) -> PipelineStatus:
        """A dead tokenizer or detokenizer counts as alive while the pipeline has not failed:
        it is being started again, and the pipeline still serves."""
        boot = self._bootstrap
        public = boot.public_host if boot is not None and boot.address is not None else ""
        return pipeline_status(self.supervisor, self.engines, self.roster, self.failure, public)

    @property
    def is_alive(self) -> bool:
        return self.failure is None and not self._stopping.is_set()

    @property
    def stage_pids(self) -> dict[str, int]:
        return self.supervisor.pids

    def client(self) -> PipelineClient:
        # It knows at once when the pipeline fails, not by status.
        client = PipelineClient(self.cfg.endpoints, lambda: self.is_alive)
        self._clients.append(client)
        return client

    # ------------------------------------------------------------ stop

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every stage (SIGTERM, then SIGKILL past `timeout`) and remove the run's files."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            self._stopping.set()
            self._stop_all(timeout)

    def _stop_all(self, timeout: float) -> None:
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=2)  # it owns the control socket until it sees stop
        for client in self._clients:
            client.close()
        self.supervisor.stop(timeout)
        self._unlink_rings()
        if self._control is not None:
            self._control.close()
        curve.destroy(self._zmq, linger=0)
        remove_run(self.cfg, list(self.procs), self.trace_path)

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
