"""The launcher: starts every stage process, waits for each to report ready, supervises them,
and stops them all, leaving no process, socket file or shared-memory segment behind (the
processes through supervisor.py, which a joining host and `serve` use too; what a death means
is decided here). Runs in the process that owns the pipeline (the CLI, a server, a user's
program)."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from ipc import curve
from ipc.channels import PullChannel, make_run_dir
from ipc.codec import Codec, ProtocolError
from ipc.config import PipelineConfig
from ipc.errors import ConfigError
from ipc.keys import derive_run_secret
from ipc.messages import (
    EngineDown,
    Message,
    PipelineStatus,
    SchedulerStats,
    StageAlive,
    StageFailed,
    StageLeaving,
    StageReady,
    StageRestarted,
)
from ipc.model_info import model_fingerprint
from pipeline.runtime.client import ENDPOINTS_REQUEST, PipelineClient, endpoints_answer
from pipeline.runtime.engines import EngineRestart, Engines
from pipeline.runtime.restarts import RESTARTABLE
from pipeline.runtime.roster import REMOTE_SILENCE_S, Member, Roster, kind_of
from pipeline.runtime.supervisor import Supervisor, control_reports
from stages.executor.preflight import check_executor
from stages.peers import Peers
from stages.trace import merge_traces

logger = logging.getLogger(__name__)

__all__ = ["Pipeline", "check_device"]

# An engine's old processes get this long to stop after SIGTERM before they are killed (the
# new ones bind the same addresses and rings).
ENGINE_STOP_TIMEOUT_S = 5.0


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
        self.address: str | None = None  # with --listen: tcp:// for remote clients
        self._remote_endpoints = b""
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._zmq = zmq.Context()
        self.engines = Engines(cfg.data_parallel_size, cfg.executor.tensor_parallel_size)
        self._supervisor: threading.Thread | None = None
        self._control: PullChannel | None = None
        self._clients: list[PipelineClient] = []
        self._started = False
        self._failure_message = "no message"  # the latest StageFailed's
        self.num_refused_bootstraps = 0  # requests for the endpoints without the client key
        self.roster: Roster | None = None  # every stage and its address, once started
        self._public: dict[str, str] = {}  # with --listen: the tcp:// control and status
        self._fingerprint = ""  # the model's, which a joining stage's must equal
        self._to_engines: queue.SimpleQueue[Message] = queue.SimpleQueue()  # tell_engines
        self._down_why: dict[str, str] = {}  # engine -> the death that took it down

    def _create_run(self) -> None:
        """The run directory (sockets, trace files) and the control socket. (The rings are
        the executor's to create: a launcher killed before it spawned one leaves none.)"""
        run_dir = make_run_dir()
        trace_dir = ""
        if self.trace_path is not None:
            trace_dir = str(run_dir / "trace")
            os.mkdir(trace_dir)
        run_id = uuid.uuid4().hex[:12]
        secret = (derive_run_secret(self.cfg.keys.stage_key, run_id) if self.cfg.keys.stage_key
                  else secrets.token_bytes(16))
        # The CURVE server key of the run's tcp:// endpoints (ipc/curve.py): derived where
        # stages may join (they derive it too), else new.
        curve_secret = b""
        if self.cfg.remote.listen_host:
            curve_secret = (curve.derived_server_secret(self.cfg.keys.stage_key, run_id)
                            if self.cfg.keys.stage_key else zmq.curve_keypair()[1])
        run_keys = dataclasses.replace(
            self.cfg.keys, run_secret=secret, curve_secret=curve_secret,
            client_key=self.cfg.keys.client_key or secrets.token_urlsafe(24))
        self.cfg = dataclasses.replace(self.cfg, run_dir=str(run_dir), run_id=run_id,
                                       trace_dir=trace_dir, keys=run_keys)
        self.supervisor.cfg = self.cfg
        keys = self.cfg.curve_keys()
        if keys is not None:
            curve.install(self._zmq, keys)
        self._control = PullChannel(self._zmq, self.cfg.control_address,
                                    Codec([StageReady, StageFailed, SchedulerStats, StageAlive,
                                           StageLeaving]),
                                    bind=True, secret=self.cfg.keys.run_secret)
        if self.cfg.accepts_stages:  # stages on other hosts report here
            port = curve.bind(self._control.socket, f"tcp://{self.cfg.remote.listen_host}:0",
                              curve.STAGES)
            self._public["control"] = self._tcp(port)
            self._fingerprint = model_fingerprint(self.cfg.model.path)

    def _unlink_rings(self) -> None:
        """(The executors may not have made them yet: unlinking none is not an error.)"""
        self.supervisor.unlink_rings(range(self.cfg.data_parallel_size))

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
        sup = self.supervisor
        try:
            self._create_run()
            reports = control_reports(self._ctl.recv_foreign_safe)
            # Every process loads at once; each scheduler starts once its cache's size is known.
            for engine in range(self.cfg.data_parallel_size):
                sup.spawn_executors(engine)
            for rank in range(self.cfg.num_tokenizers):
                sup.spawn_stage("tokenizer", rank)
            for rank in range(self.cfg.num_detokenizers):
                sup.spawn_stage("detokenizer", rank)
            for engine in range(self.cfg.data_parallel_size):
                sup.start_scheduler(engine, reports)
            sup.wait_ready(list(self.procs), reports)
            self.roster = Roster(self.cfg, self._public_host)
            for name, info in sup.ready.items():
                stage, index = name.split(":")
                if stage != "executor":
                    self.roster.local_ready(kind_of(stage), int(index), info.get("stage_port", 0))
            self._unlink_rings()  # both users have them mapped: nothing is left in /dev/shm
            self.endpoints_path = self.cfg.endpoints.save(self.cfg.run_dir)
            status, bootstrap = self._open_status_sockets()
        except BaseException:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, args=(status, bootstrap),
                                            name="supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _open_status_sockets(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        """The status publisher (ipc://, and tcp:// with --listen) and, with --listen, the
        bootstrap socket that hands remote clients the tcp:// endpoints (self.address)."""
        status = self._zmq.socket(zmq.PUB)
        status.setsockopt(zmq.LINGER, 1000)  # the last status (a failure) gets out
        status.bind(self.cfg.status_address)
        host = self.cfg.remote.listen_host
        if not host:
            return status, None
        self._public["status"] = self._tcp(curve.bind(status, f"tcp://{host}:0", curve.ALL))
        bootstrap = self._zmq.socket(zmq.REP)
        bootstrap.setsockopt(zmq.LINGER, 0)
        self.address = self._tcp(curve.bind(bootstrap, f"tcp://{host}:0", curve.BOOTSTRAP))
        self._update_remote_endpoints()
        return status, bootstrap

    @property
    def _public_host(self) -> str:
        """The name remote clients and stages reach this host by (with --listen)."""
        host = self.cfg.remote.listen_host
        return socket.getfqdn() if host in ("0.0.0.0", "*") else host

    def _tcp(self, port: int) -> str:
        return f"tcp://{self._public_host}:{port}"

    def _update_remote_endpoints(self) -> None:
        """What the bootstrap socket hands remote clients: the tcp:// inboxes of every
        tokenizer and engine, those that joined from other hosts included."""
        joined = dict(sorted(self.roster.joined_addresses().items() if self.roster else (),
                             key=lambda item: int(item[0].split(":")[1])))
        remote = dataclasses.replace(
            self.cfg.endpoints,
            tokenizers=tuple(self._tcp(self.supervisor.ready[f"tokenizer:{r}"]["tcp_port"])
                             for r in range(self.cfg.num_tokenizers))
            + tuple(a for name, a in joined.items() if name.startswith("tokenizer:")),
            schedulers=tuple(self._tcp(self.supervisor.ready[f"scheduler:{e}"]["tcp_port"])
                             for e in range(self.cfg.data_parallel_size))
            + tuple(a for name, a in joined.items() if name.startswith("scheduler:")),
            status=self._public["status"], reply="tcp://", key="",  # (the client has it)
            tokenizer_ranks=tuple(range(self.cfg.num_tokenizers))
            + tuple(int(name.split(":")[1]) for name in joined if name.startswith("tokenizer:")))
        self._remote_endpoints = remote.to_json()

    # ------------------------------------------------------------ supervise

    def _supervise(self, status: zmq.Socket, bootstrap: zmq.Socket | None) -> None:
        """Watch every stage process and the control channel (stats, failure reports),
        restart a dead tokenizer or detokenizer (see _survive), take down an engine
        whose scheduler or executor died while others serve, publish the status a few times
        a second, answer remote clients' requests for the endpoints. The sockets are this
        thread's from here on."""
        next_status = 0.0
        assert self.roster is not None
        links = Peers(self._zmq, self.cfg.keys.run_secret, self.roster.view(False))
        try:
            while not self._stopping.is_set():
                dead = self.supervisor.watch(0.1)  # (and starts those due to restart)
                while bootstrap is not None and bootstrap.poll(0):
                    self._answer_bootstrap(bootstrap)
                self._drain_control(links)
                self._advance_restarts()
                while not self._to_engines.empty():
                    links.to_engines(self._to_engines.get())
                lost = [(m.name, m.leaving) for m in self.roster.silent(time.monotonic())
                        if not self._left(m, links)]
                fatal = [name for name in dead if not self._survive(name, links)]
                if (fatal or lost) and not self._stopping.is_set():
                    names = ", ".join([f"{name} (exit code {self.procs[name].exitcode})"
                                       for name in fatal]
                                      + [f"{name} (joined from another host, "
                                         f"{why or 'gone silent'})" for name, why in lost])
                    self.failure = f"stage {names} died: {self._failure_message}"
                    logger.error("%s; stopping the pipeline", self.failure)
                    status.send(Codec.encode(self.status()))
                    threading.Thread(target=self.stop, name="stop").start()
                    return
                if dead or time.monotonic() >= next_status:
                    status.send(Codec.encode(self.status()))
                    next_status = time.monotonic() + 0.25
        finally:
            # The last word: stages that joined from other hosts stop on it.
            status.send(Codec.encode(dataclasses.replace(self.status(), stopping=True)))
            status.close()
            links.close()
            if bootstrap is not None:
                bootstrap.close()

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
                self._failure_message = msg.message

    def _ready(self, msg: StageReady, links: Peers) -> None:
        """A stage that joined from another host is ready (or a restarted one is)."""
        assert self.roster is not None
        kind = kind_of(msg.stage)
        name = f"{msg.stage}:{msg.rank}"
        engine = self.engines.engine_of(name)
        if engine in self.engines.restarting and name in self.procs:
            self._engine_stage_ready(engine, name, msg.info, links)
        elif self.roster.joined_ready(kind, msg.rank, msg.info, time.monotonic()):
            logger.warning("%s:%d joined from another host", msg.stage, msg.rank)
            if kind == "engine":
                self.engines.ready[msg.rank] = True
            self._tell_members(links)
        elif f"{msg.stage}:{msg.rank}" in self.procs:
            logger.warning("stage %s:%d is running again", msg.stage, msg.rank)
        elif kind == "engine" and msg.rank < self.engines.num_engines \
                and not self.engines.ready[msg.rank]:  # refused (see joined_ready)
            self.engines.take_down(msg.rank)

    def _left(self, member: Member, links: Peers) -> bool:
        """A stage that had joined from another host said it stops, or went silent (its host
        or the network failed): an engine is taken down; the roster no longer names it.
        False: it was the last engine serving (the pipeline fails, as when a local one is)."""
        if member.leaving:
            logger.error("%s (joined from another host) stopped: %s", member.name,
                         member.leaving)
        else:
            logger.error("%s (joined from another host) has not been heard from for %.0f s: "
                         "it is gone", member.name, REMOTE_SILENCE_S)
        if member.kind != "engine" or not self.engines.alive[member.index]:
            self._tell_members(links)
            return True
        if not self.engines.ready[member.index]:  # it never served
            self.engines.take_down(member.index)
            self._tell_members(links)
            return True
        if self.engines.can_lose(f"scheduler:{member.index}") is None:
            return False
        self._take_down(member.index, member.name, links)
        return True

    def _tell_members(self, links: Peers) -> None:
        """Every stage learns the roster (each as it can reach the others)."""
        assert self.roster is not None
        links.update(self.roster.view(False))
        send = {"engine": links.to_engine, "tokenizer": links.to_tokenizer,
                "detokenizer": links.to_detokenizer}
        why = dict(self._down_why)
        for member, members in self.roster.recipients():
            send[member.kind](member.index, dataclasses.replace(members, engines_down_why=why))
        if self.address is not None:
            self._update_remote_endpoints()

    def _survive(self, name: str, links: Peers) -> bool:
        """Deal with a dead stage process the pipeline survives: start a tokenizer or a
        detokenizer again, or take its engine down and start it again. False: the pipeline
        fails."""
        engine = self.engines.engine_of(name)
        if engine is not None and not self._stopping.is_set():
            return self._engine_died(engine, name, links)
        # Tokenizers and detokenizers hold nothing that cannot be rebuilt: one that dies is
        # started again (RestartPolicy), unless it keeps dying; then the pipeline fails, as
        # it does when the scheduler or the executor of its last engine dies.
        if self._stopping.is_set() or name.split(":")[0] not in RESTARTABLE:
            return False
        delay = self.supervisor.restart_later(name, lambda: self._restart_args(name))
        if delay is None:
            return False
        logger.error("stage %s died (exit code %s: %s); starting it again in %.1f s", name,
                     self.procs[name].exitcode, self._failure_message, delay)
        self._failure_message = "no message"
        if name.startswith("detokenizer:"):  # the schedulers fail its requests now
            links.to_engines(StageRestarted("detokenizer", int(name.split(":")[1])))
        return True

    def _take_down(self, engine: int, name: str, links: Peers) -> str:
        """Engine `engine` lost `name`: stop its other processes, and have the detokenizers
        fail its requests (the tokenizers fail those sent to it lately: see the status).
        What died, in words."""
        how = (f"exit code {self.procs[name].exitcode}" if name in self.procs
               else "it joined from another host and went silent")
        cause = f"{name} died, {how}: {self._failure_message}"
        self._down_why[str(engine)] = cause
        message = f"engine {engine} stopped ({cause}) while it held this request; send it again"
        logger.error("stage %s died: engine %d is down; %d engine(s) still serve", name,
                     engine, self.engines.serving_besides(engine))
        self._failure_message = "no message"
        self.engines.take_down(engine)
        assert self.roster is not None
        self.roster.leave(self.roster.members[("engine", engine)])
        self._stop_engine(engine)
        links.to_detokenizers(EngineDown(engine, message, self.engines.incarnation[engine]))
        self._tell_members(links)
        return cause

    def _stop_engine(self, engine: int) -> None:
        for other in self.engines.processes(engine):
            if other in self.procs:  # (not: an engine on another host)
                self.supervisor.terminate(other)

    # ------------------------------------------------------------ engine restarts

    def _engine_died(self, engine: int, name: str, links: Peers) -> bool:
        """A process of engine `engine` died: take the engine down (if it served) and start
        it again after the restart policy's delay; one that keeps dying stays down while
        another engine serves. False: it was the last, the pipeline fails."""
        action, delay = self.engines.after_death(
            engine, lambda: self.supervisor.restarts.delay(f"engine:{engine}"))
        if action in ("ignore", "fail"):
            return action == "ignore"
        if self.engines.alive[engine]:
            cause = self._take_down(engine, name, links)
        else:  # a new process died while the engine was starting again
            cause = (f"{name} died while starting again, exit code "
                     f"{self.procs[name].exitcode}: {self._failure_message}")
            self._failure_message = "no message"
            self._down_why[str(engine)] = cause
            self._stop_engine(engine)
        if action == "down":
            logger.error("engine %d keeps dying (%s): it stays down", engine, cause)
            return True
        now = time.monotonic()
        self.engines.restarting[engine] = EngineRestart(
            cause, now, now + delay, self.engines.incarnation[engine] + 1)
        logger.error("engine %d is starting again in %.1f s (%s)", engine, delay, cause)
        return True

    def _advance_restarts(self) -> None:
        """Engines whose old processes have stopped and whose delay is over load again: the
        rings and the tensor-parallel store of the dead ones are removed first (the new ones
        are made under the same names)."""
        now = time.monotonic()
        for engine, restart in self.engines.restarting.items():
            if restart.phase != "stopping":
                continue
            names = [n for n in self.engines.processes(engine) if n in self.procs]
            running = [n for n in names if self.procs[n].is_alive()]
            if running:
                if now - restart.began > ENGINE_STOP_TIMEOUT_S:
                    for n in running:
                        logger.warning("%s did not stop in %.0f s: killing it", n,
                                       ENGINE_STOP_TIMEOUT_S)
                        self.procs[n].kill()
                continue
            if now < restart.due:
                continue
            self.supervisor.unlink_rings([engine])
            Path(self.cfg.run_dir, f"tp-store-{engine}").unlink(missing_ok=True)
            for n in names:
                self.supervisor.ready.pop(n, None)
            self.supervisor.spawn_executors(engine)
            restart.phase = "loading"

    def _engine_stage_ready(self, engine: int, name: str, info: dict[str, Any],
                            links: Peers) -> None:
        """A new process of a restarting engine is ready: once its first executor rank is
        (its cache allocated), the scheduler starts; once that is, the engine serves."""
        assert self.roster is not None
        restart = self.engines.restarting[engine]
        self.supervisor.ready[name] = info
        head = f"executor:{engine * self.engines.tp_size}"
        if name == head and restart.phase == "loading":
            self.supervisor.spawn_stage("scheduler", engine, info["num_kv_blocks"],
                                        self.roster.view(False), restart.incarnation)
            restart.phase = "starting"
        elif name.startswith("scheduler:") and restart.phase == "starting":
            self.supervisor.unlink_rings([engine])  # both users have them mapped
            self.engines.back(engine)
            self._down_why.pop(str(engine), None)
            self.roster.local_ready("engine", engine, info.get("stage_port", 0))
            self.roster.back("engine", engine)
            self._tell_members(links)
            logger.warning("engine %d serves again, %.1f s after %s", engine,
                           time.monotonic() - restart.began, restart.cause)

    def _answer_bootstrap(self, bootstrap: zmq.Socket) -> None:
        """A remote client that proves it holds the client key gets the tcp:// endpoints (an
        answer proven with the key in turn: endpoints_answer); a stage on another host that
        proves it has the stage key joins (roster.py); any other request gets an empty
        answer (a REP socket must answer) and is counted."""
        try:
            frames = bootstrap.recv_multipart()
        except zmq.ZMQError as exc:
            logger.warning("bootstrap request failed: %s", exc)
            return
        reply = b""
        try:
            if frames[0] == ENDPOINTS_REQUEST:
                reply = endpoints_answer(frames, self.cfg.keys.client_key, self._remote_endpoints)
                if not reply:
                    self.num_refused_bootstraps += 1
            elif frames[0] in (b"hello", b"join") and self.roster is not None:
                reply = self._answer_join(frames)
            else:
                self.num_refused_bootstraps += 1
        except Exception:  # whatever a request holds, the supervisor goes on
            logger.exception("a bootstrap request could not be answered")
        try:
            bootstrap.send(reply)  # (a REP socket answers every request)
        except zmq.ZMQError as exc:
            logger.warning("bootstrap answer failed: %s", exc)

    def tell_engines(self, msg: Message) -> None:
        """Send every engine serving (joined ones included) a message from the launcher's
        process (serve's ForgetClient); the supervisor sends it within 0.1 s."""
        self._to_engines.put(msg)

    def _answer_join(self, frames: list[bytes]) -> bytes:
        assert self.roster is not None
        if not self.cfg.accepts_stages:
            return (b'{"error": "this pipeline takes no stages from other hosts: start it '
                    b'with --listen HOST and --stage-key KEY"}')
        reply, member = self.roster.answer(frames, self.cfg.keys.stage_key, self._fingerprint,
                                           time.monotonic(), self._public)
        if member is not None:
            logger.warning("%s is joining from %s", member.name, member.tcp)
            if member.kind == "engine":
                self.engines.grow()
        return reply

    def _restart_args(self, name: str) -> tuple[Any, ...]:
        """What a dead tokenizer or detokenizer is started again with: the ports remote
        clients and stages know, and the roster as it stands."""
        assert self.roster is not None
        info = self.supervisor.ready[name]
        args: tuple[Any, ...] = (self.roster.view(False), info.get("stage_port", 0))
        if name.startswith("tokenizer:"):
            args = (info.get("tcp_port", 0), *args)
        return args

    def _next_control(self) -> Message | None:
        """The next message from a stage; a frame that is not one is counted and skipped, so
        nothing sent to the control socket can stop the supervisor."""
        while True:
            try:
                return self._ctl.recv_nowait()
            except ProtocolError as exc:
                logger.warning("refused a frame on the control socket: %s", exc)

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
        alive = {name: up or (name.split(":")[0] in RESTARTABLE and self.failure is None)
                 for name, up in self.supervisor.alive().items()}
        joined: dict[str, str] = {}
        left: list[str] = []
        if self.roster is not None:  # (one that left is not a stage of the pipeline now)
            alive |= {m.name: True for m in self.roster.members.values()
                      if m.joined and not m.gone}
            joined, left = self.roster.joined_addresses(), self.roster.left()
        restarting = sorted(self.engines.restarting)
        for engine in restarting:  # (it serves again soon: not a dead stage of the pipeline)
            alive |= {name: True for name in self.engines.processes(engine) if name in alive}
        return PipelineStatus(time.time(), alive, self.failure, self.scheduler_stats,
                              dict(self.supervisor.restarts.counts), self.engines.loads(),
                              list(self.engines.alive), joined, left=left,
                              engines_restarting=restarting,
                              engines_down_why=dict(self._down_why))

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
        if not self.cfg.run_dir:
            return  # the run was never created
        if self.trace_path is not None:
            files = [os.path.join(self.cfg.trace_dir, f"{name.replace(':', '-')}.json")
                     for name in self.procs]
            merge_traces(files, self.trace_path)
        shutil.rmtree(self.cfg.run_dir, ignore_errors=True)

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


CUDA_INSTALL = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 "
                "(into this environment; pick the index of your CUDA driver's version)")


def check_device(device: str) -> None:
    """A CUDA device the executor will find, or ConfigError saying why not and what to do."""
    if not device.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise ConfigError(f"--device {device}: this torch ({torch.__version__}) is a CPU build, "
                          f"without CUDA. For a GPU: {CUDA_INSTALL}")
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if count == 0:
        raise ConfigError(f"--device {device}: torch {torch.__version__} has CUDA, but sees no "
                          "GPU (check the driver with nvidia-smi, and CUDA_VISIBLE_DEVICES)")
    if index >= count:
        raise ConfigError(f"--device {device}: there are {count} GPU(s), cuda:0 to "
                          f"cuda:{count - 1}")
