"""A stage on another host that joins a running pipeline over TCP:
`run_pipeline stage tokenizer|detokenizer|engine|pipeline --connect tcp://HOST:PORT`.

It joins through the launcher's bootstrap socket with the stage key (roster.py says how),
then starts its processes here (an engine: its executor rank(s) and its scheduler; a worker:
itself; a pipeline host: the executor ranks of an engine's joined pipeline stages, started
anew at each rendezvous the launcher's status names for that engine, as the engine starts
again) with the run's config and roster. They report to this process, which relays to the
launcher over tcp://, says every HEARTBEAT_S that they run, and stops them all, leaving
nothing behind, when the pipeline stops or fails, when the launcher goes silent, when one
of them dies, or on SIGTERM/Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import shutil
import signal
import threading
import time

import zmq

from ipc import curve
from ipc.addresses import RemoteSettings, interface_of
from ipc.channels import PullChannel, PushChannel, SubChannel, make_run_dir
from ipc.codec import Codec
from ipc.config import PipelineConfig, RunKeys
from ipc.keys import derive_run_secret
from ipc.messages import (
    JoinedRankDied,
    Members,
    Message,
    PipelineStatus,
    SchedulerStats,
    StageAlive,
    StageFailed,
    StageLeaving,
    StageReady,
)
from ipc.model_info import model_fingerprint
from pipeline.runtime.client import reachable_from
from pipeline.runtime.engine_restarts import ENGINE_STOP_TIMEOUT_S
from pipeline.runtime.roster import (
    HEARTBEAT_S,
    JOIN_KINDS,
    REMOTE_SILENCE_S,
    JoinError,
    proof,
    stage_of,
)
from pipeline.runtime.supervisor import StartupError, Supervisor, control_reports

logger = logging.getLogger(__name__)

STAGE_KEY_ENV = "LLM_PIPELINE_STAGE_KEY"
LAUNCHER_SILENCE_S = 2 * REMOTE_SILENCE_S  # no status from the launcher this long: it is gone


@dataclasses.dataclass(frozen=True)
class Joined:
    """What the launcher answered a join with."""

    index: int  # the engine, or the worker's rank, or the pipeline host's own
    engine: int  # the engine it serves (a pipeline host: whose stages it runs)
    cfg: PipelineConfig  # the run's, with this host's paths and the derived secret
    members: Members
    control: str  # the launcher's tcp:// control socket


def join(address: str, kind: str, stage_key: str, model_path: str, host: str,
         timeout: float = 10.0) -> Joined:
    """Join the pipeline whose bootstrap socket is `address` as a `kind` stage listening on
    `host`; JoinError says why not."""
    if kind not in JOIN_KINDS:
        raise JoinError(f"cannot join as {kind!r}: one of {', '.join(JOIN_KINDS)}")
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        curve.connect_bootstrap(sock, address)  # (encrypted; the frames prove the key)

        def ask(*frames: bytes) -> bytes:
            if not curve.send_now(sock, list(frames)):
                raise JoinError(f"no pipeline answered at {address}: the peer refused the "
                                "encrypted handshake")
            if not sock.poll(int(timeout * 1000)):
                raise JoinError(f"no pipeline answered at {address} within {timeout:g} s")
            return bytes(sock.recv())

        challenge = ask(b"hello").decode()
        nonce = secrets.token_hex(16)
        request = {"kind": kind, "host": host, "challenge": challenge, "nonce": nonce,
                   "fingerprint": model_fingerprint(model_path),
                   "proof": proof(stage_key, "join", kind, host, challenge)}
        reply = json.loads(ask(b"join", json.dumps(request).encode()) or b"{}")
    finally:
        sock.close()
    if "error" in reply or "answer" not in reply:
        raise JoinError(f"the pipeline at {address} refused to let this stage join: "
                        f"{reply.get('error', 'no answer')}")
    if reply.get("proof") != proof(stage_key, "answer", nonce, reply["answer"]):
        raise JoinError(f"the answer from {address} does not prove it holds the stage key")
    answer = json.loads(reply["answer"])
    keys = RunKeys(stage_key=stage_key, run_secret=derive_run_secret(stage_key, answer["run_id"]),
                   curve_secret=curve.derived_server_secret(stage_key, answer["run_id"]))
    cfg = PipelineConfig.from_wire(
        answer["config"], model_path, keys=keys,
        remote=RemoteSettings(listen_host=host, launcher_status=answer["status"]))
    # One engine here: its threads and GPUs are this host's (stages/executor/process.py).
    cfg = dataclasses.replace(cfg, data_parallel_size=1, run_dir=str(make_run_dir()))
    members = Members(*answer["members"])
    index = int(answer["index"])
    return Joined(index, int(answer.get("engine", index)), cfg, members, answer["control"])


class RemoteStage:
    """The processes of one joined stage, and their link to the launcher."""

    def __init__(self, joined: Joined, kind: str) -> None:
        self.joined, self.kind, self.cfg = joined, kind, joined.cfg
        self.supervisor = Supervisor(self.cfg)
        self.ready: dict[str, StageReady] = {}  # as the stages reported, to relay
        self.stop_reason = ""
        self._launcher_said = False  # the stop came from the launcher (or its silence)
        self._stop = threading.Event()
        self._zmq = zmq.Context()
        keys = self.cfg.curve_keys()
        assert keys is not None  # (a joined stage has a host and the stage key)
        curve.install(self._zmq, keys)
        try:
            self._control = PullChannel(self._zmq, self.cfg.control_address,
                                        Codec([StageReady, StageFailed, SchedulerStats]),
                                        bind=True, secret=self.cfg.keys.run_secret)
            self._launcher = PushChannel(self._zmq, joined.control, bind=False,
                                         secret=self.cfg.keys.run_secret)
            self._status = SubChannel(self._zmq, self.cfg.status_address,
                                      Codec([PipelineStatus]))
        except BaseException:
            curve.destroy(self._zmq, linger=0)
            shutil.rmtree(self.cfg.run_dir, ignore_errors=True)
            raise
        self._status_at = time.monotonic()
        self._next_beat = 0.0
        # A pipeline host: the rendezvous the launcher names for its engine, the one its
        # ranks were started at, and those it stopped itself (their exits are not deaths)
        self._rendezvous = self._running = ""
        self._stopped_ranks: set[str] = set()
        self._stopping_since = 0.0

    @property
    def name(self) -> str:
        return f"{stage_of(self.kind)}:{self.joined.index}"

    def run(self) -> int:
        """Start, relay until told to stop; 0 when the pipeline stopped, 1 otherwise."""
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        try:
            self._start()
            self._relay()
        except KeyboardInterrupt:
            self.stop_reason = "interrupted"
        except (JoinError, StartupError) as exc:
            self.stop_reason = str(exc)
        finally:
            self._stop_all()
        return 0 if self.stop_reason in ("the pipeline stopped", "interrupted") else 1

    def _start(self) -> None:
        index, members, sup = self.joined.index, self.joined.members, self.supervisor
        reports = control_reports(self._recv_starting)
        if self.kind == "engine":
            sup.spawn_executors(index)
            sup.start_scheduler(index, reports, members)
            sup.wait_ready(list(sup.procs), reports)
            sup.unlink_rings([index])  # both users have them mapped: nothing is left in /dev/shm
        elif self.kind == "tokenizer":
            sup.spawn_stage("tokenizer", index, 0, members)
            sup.wait_ready([self.name], reports)
        elif self.kind == "detokenizer":
            sup.spawn_stage("detokenizer", index, members)
            sup.wait_ready([self.name], reports)
        else:  # a pipeline host: its ranks start at the launcher's rendezvous (_relay)
            return
        # The launcher learns the ports of the stage that stands for this one.
        self._launcher.send(self.ready[self.name])

    def _recv_starting(self, wait_ms: int) -> Message | None:
        """The next report of a stage starting here; a failure is relayed to the launcher.
        JoinError when told to stop meanwhile; a long start (a model loading) is not silence."""
        if self._stop.is_set() or self._launcher_says_stop():
            raise JoinError(f"stopped while starting: {self.stop_reason or 'interrupted'}")
        self._beat()
        msg = self._control.recv_foreign_safe(wait_ms)
        if isinstance(msg, StageFailed):
            self._launcher.send(msg)
        elif isinstance(msg, StageReady):
            self.ready[f"{msg.stage}:{msg.rank}"] = msg
        return msg

    def _launcher_says_stop(self) -> bool:
        """Whether the launcher's status says to stop (it stops or failed, or counts this
        stage as gone) or it has gone silent; stop_reason says which."""
        while (status := self._status.recv_valid(0)) is not None:
            assert isinstance(status, PipelineStatus)
            self._status_at = time.monotonic()
            self._rendezvous = status.rendezvous.get(self.name, "")
            if status.stopping or status.failure:
                self.stop_reason = ("the pipeline stopped" if status.stopping
                                    else f"the pipeline failed: {status.failure}")
            elif self.name in status.left:
                self.stop_reason = "the launcher counts this stage as gone"
        if not self.stop_reason and time.monotonic() - self._status_at > LAUNCHER_SILENCE_S:
            self.stop_reason = f"no word from the launcher for {LAUNCHER_SILENCE_S:.0f} s"
        self._launcher_said = bool(self.stop_reason)  # (it stops this stage, or is gone)
        return self._launcher_said

    def _relay(self) -> None:
        while not self._stop.is_set():
            dead = self.supervisor.watch(0.1)
            while (msg := self._control.recv_foreign_safe(0)) is not None:
                self._forward(msg)
            if self.kind == "pipeline":  # (its ranks' deaths do not stop it)
                self._ranks_follow(dead)
            elif dead:
                self.stop_reason = f"{dead[0]} died"
                return
            if self._launcher_says_stop():
                return
            self._beat()
        self.stop_reason = self.stop_reason or "interrupted"

    def _ranks_follow(self, dead: list[str]) -> None:
        """A pipeline host's ranks: a rank that died takes the others down with it, and the
        launcher learns it (JoinedRankDied: it starts the engine again at a new rendezvous);
        at a new rendezvous the old ranks stop (SIGTERM; killed past ENGINE_STOP_TIMEOUT_S)
        and, once all have, the new ones start. Never blocks: the heartbeat goes on. (The
        exits of ranks it stopped itself are no news.)"""
        sup = self.supervisor
        for name in dead:
            if name not in self._stopped_ranks:
                why = (f"{name} died on {self.cfg.remote.listen_host}, the host of the "
                       f"pipeline stages, exit code {sup.procs[name].exitcode}")
                logger.error("%s: the engine starts again", why)
                self._launcher.send(JoinedRankDied(self.joined.engine, int(name.split(":")[1]),
                                                   self._running, why))
                self._stop_ranks()
        if self._rendezvous == self._running:
            return
        self._stop_ranks()
        running = [n for n in self._stopped_ranks if sup.procs[n].is_alive()]
        if running and time.monotonic() - self._stopping_since < ENGINE_STOP_TIMEOUT_S:
            return  # (the new ranks take their names: on a later turn)
        for name in running:
            logger.warning("%s did not stop in %.0f s: killing it", name, ENGINE_STOP_TIMEOUT_S)
            sup.procs[name].kill()
            sup.procs[name].join()
        self._stopped_ranks.clear()
        self._running = self._rendezvous
        if self._running:
            logger.warning("starting the ranks of engine %d's pipeline stages at %s",
                           self.joined.engine, self._running)
            sup.spawn_executors(self.joined.engine, self._running, joined=True)

    def _stop_ranks(self) -> None:
        for name in list(self.supervisor.procs):
            if name not in self._stopped_ranks:
                if not self._stopped_ranks:
                    self._stopping_since = time.monotonic()
                self._stopped_ranks.add(name)
                self.supervisor.terminate(name)

    def _beat(self) -> None:
        if time.monotonic() >= self._next_beat:
            self._launcher.send(StageAlive(stage_of(self.kind), self.joined.index))
            self._next_beat = time.monotonic() + HEARTBEAT_S

    def _forward(self, msg: Message) -> None:
        if isinstance(msg, (SchedulerStats, StageFailed)):
            self._launcher.send(msg)
        elif isinstance(msg, StageReady) and self.kind == "pipeline":
            logger.info("%s:%d is ready", msg.stage, msg.rank)

    def _stop_all(self, timeout: float = 10.0) -> None:
        if self.stop_reason:
            logger.warning("%s stops: %s", self.name, self.stop_reason)
        if not self._launcher_said:  # it stops of its own accord: the pipeline learns it now
            self._launcher.send(StageLeaving(stage_of(self.kind), self.joined.index,
                                             self.stop_reason or "interrupted"))
        self.supervisor.stop(timeout)
        if self.kind == "engine":
            self.supervisor.unlink_rings([self.joined.index])
        for chan in (self._control, self._launcher, self._status):
            chan.close()
        curve.destroy(self._zmq, linger=1000)
        shutil.rmtree(self.cfg.run_dir, ignore_errors=True)


def run_joined(address: str, kind: str, stage_key: str, model_path: str,
               host: str | None = None) -> int:
    """Join the pipeline at `address` and serve until it stops; the exit code."""
    host = host or reachable_from(address)
    if kind == "pipeline":  # (its ranks listen there: check before joining)
        try:
            interface_of(host)
        except ValueError as exc:
            raise JoinError(str(exc)) from None
    joined = join(address, kind, stage_key, model_path, host)
    stage = RemoteStage(joined, kind)
    print(f"joined the pipeline at {address} as {stage.name} (listening on {host})",
          flush=True)
    return stage.run()
