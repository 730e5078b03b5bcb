"""A stage on another host that joins a running pipeline over TCP:
`run_pipeline stage tokenizer|detokenizer|engine --connect tcp://HOST:PORT`.

It joins through the launcher's bootstrap socket with the stage key (roster.py says how),
then starts its processes here (an engine: its executor rank(s) and its scheduler; a worker:
itself) with the run's config and roster. They report to this process, which relays to the
launcher over tcp://, says every HEARTBEAT_S that they run, and stops them all, leaving
nothing behind, when the pipeline stops or fails, when the launcher goes silent, when one
of them dies, or on SIGTERM/Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from ipc.channels import PullChannel, PushChannel, SubChannel, make_run_dir
from ipc.codec import Codec
from ipc.config import PipelineConfig
from ipc.keys import derive_run_secret
from ipc.messages import (
    Members,
    Message,
    PipelineStatus,
    SchedulerStats,
    StageAlive,
    StageFailed,
    StageReady,
)
from ipc.model_info import model_fingerprint
from pipeline.runtime.client import reachable_from
from pipeline.runtime.roster import (
    HEARTBEAT_S,
    JOIN_KINDS,
    REMOTE_SILENCE_S,
    JoinError,
    proof,
    stage_of,
)
from stages.entry import run_stage

logger = logging.getLogger(__name__)

STAGE_KEY_ENV = "LLM_PIPELINE_STAGE_KEY"
LAUNCHER_SILENCE_S = 2 * REMOTE_SILENCE_S  # no status from the launcher this long: it is gone
TARGETS = {"executor": "stages.executor.process:run_executor",
           "scheduler": "stages.scheduler.process:run_scheduler",
           "tokenizer": "stages.tokenizer:run_tokenizer",
           "detokenizer": "stages.detokenizer:run_detokenizer"}


@dataclasses.dataclass(frozen=True)
class Joined:
    """What the launcher answered a join with."""

    index: int  # the engine, or the worker's rank
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
        sock.connect(address)

        def ask(*frames: bytes) -> bytes:
            sock.send_multipart(list(frames))
            if not sock.poll(int(timeout * 1000)):
                raise JoinError(f"no pipeline answered at {address} within {timeout:.0f} s")
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
    cfg = PipelineConfig.from_wire(
        answer["config"], model_path, run_secret=derive_run_secret(stage_key, answer["run_id"]),
        stage_key=stage_key, listen_host=host, launcher_status=answer["status"])
    # One engine here: its threads and GPUs are this host's (stages/executor/process.py).
    cfg = dataclasses.replace(cfg, data_parallel_size=1, run_dir=str(make_run_dir()))
    members = Members(*answer["members"])
    return Joined(int(answer["index"]), cfg, members, answer["control"])


class RemoteStage:
    """The processes of one joined stage, and their link to the launcher."""

    def __init__(self, joined: Joined, kind: str) -> None:
        self.joined, self.kind, self.cfg = joined, kind, joined.cfg
        self.procs: dict[str, BaseProcess] = {}
        self.ready: dict[str, StageReady] = {}
        self.stop_reason = ""
        self._stop = threading.Event()
        self._mp = mp.get_context("spawn")
        self._zmq = zmq.Context()
        try:
            self._control = PullChannel(self._zmq, self.cfg.control_address,
                                        Codec([StageReady, StageFailed, SchedulerStats]),
                                        bind=True, secret=self.cfg.run_secret)
            self._launcher = PushChannel(self._zmq, joined.control, bind=False,
                                         secret=self.cfg.run_secret)
            self._status = SubChannel(self._zmq, self.cfg.status_address,
                                      Codec([PipelineStatus]))
        except BaseException:
            self._zmq.destroy(linger=0)
            shutil.rmtree(self.cfg.run_dir, ignore_errors=True)
            raise
        self._status_at = time.monotonic()
        self._next_beat = 0.0

    @property
    def name(self) -> str:
        return f"{'scheduler' if self.kind == 'engine' else self.kind}:{self.joined.index}"

    def run(self) -> int:
        """Start, relay until told to stop; 0 when the pipeline stopped, 1 otherwise."""
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        try:
            self._start()
            self._relay()
        except KeyboardInterrupt:
            self.stop_reason = "interrupted"
        except JoinError as exc:
            self.stop_reason = str(exc)
        finally:
            self._stop_all()
        return 0 if self.stop_reason in ("the pipeline stopped", "interrupted") else 1

    def _start(self) -> None:
        index, members = self.joined.index, self.joined.members
        if self.kind == "engine":
            tp = self.cfg.executor.tensor_parallel_size
            for rank in range(index * tp, (index + 1) * tp):
                self._spawn("executor", rank)
            head = self._wait_ready([f"executor:{index * tp}"])[0]
            num_blocks = head.info["num_kv_blocks"]
            capacity = num_blocks * self.cfg.scheduler.block_size
            if capacity < self.cfg.model.max_model_len:
                raise JoinError(f"the KV cache here holds {capacity} tokens ({num_blocks} "
                                "blocks), fewer than one sequence of the context length "
                                f"{self.cfg.model.max_model_len}: give this host more memory "
                                "or the pipeline a larger --kv-cache-memory")
            self._spawn("scheduler", index, num_blocks, members)
            ready = self._wait_ready(list(self.procs))
            self._unlink_rings()  # both users have them mapped: nothing is left in /dev/shm
        elif self.kind == "tokenizer":
            self._spawn("tokenizer", index, 0, members)
            ready = self._wait_ready([self.name])
        else:
            self._spawn("detokenizer", index, members)
            ready = self._wait_ready([self.name])
        # The launcher learns the ports of the stage that stands for this one.
        self._launcher.send(next(m for m in ready if f"{m.stage}:{m.rank}" == self.name))

    def _spawn(self, stage: str, rank: int, *args: Any) -> None:
        from pipeline.runtime.launcher import _main_hidden

        proc = self._mp.Process(target=run_stage,
                                args=(TARGETS[stage], self.cfg, rank, os.getpid(), *args),
                                name=f"llm-pipeline:{stage}:{rank}", daemon=False)
        with _main_hidden():
            proc.start()
        self.procs[f"{stage}:{rank}"] = proc

    def _wait_ready(self, names: list[str]) -> list[StageReady]:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while missing := [n for n in names if n not in self.ready]:
            for name in missing:
                if not self.procs[name].is_alive():
                    raise JoinError(f"{name} exited with code {self.procs[name].exitcode} "
                                    "before it was ready")
            if time.monotonic() > deadline:
                raise JoinError(f"{', '.join(missing)} did not report ready within "
                                f"{self.cfg.ready_timeout_s:.0f} s")
            if self._stop.is_set() or self._launcher_says_stop():
                raise JoinError(f"stopped while starting: {self.stop_reason or 'interrupted'}")
            self._beat()  # a long start (a model loading) is not silence
            msg = self._control.recv_foreign_safe(100)
            if isinstance(msg, StageFailed):
                self._launcher.send(msg)
                raise JoinError(f"{msg.stage}:{msg.rank} failed to start: {msg.message}")
            if isinstance(msg, StageReady):
                self.ready[f"{msg.stage}:{msg.rank}"] = msg
        return [self.ready[name] for name in names]

    def _launcher_says_stop(self) -> bool:
        """Whether the launcher's status says to stop (it stops or failed, or counts this
        stage as gone) or it has gone silent; stop_reason says which."""
        while (status := self._status.recv_valid(0)) is not None:
            assert isinstance(status, PipelineStatus)
            self._status_at = time.monotonic()
            if status.stopping or status.failure:
                self.stop_reason = ("the pipeline stopped" if status.stopping
                                    else f"the pipeline failed: {status.failure}")
            elif self.name in status.left:
                self.stop_reason = "the launcher counts this stage as gone"
        if not self.stop_reason and time.monotonic() - self._status_at > LAUNCHER_SILENCE_S:
            self.stop_reason = f"no word from the launcher for {LAUNCHER_SILENCE_S:.0f} s"
        return bool(self.stop_reason)

    def _relay(self) -> None:
        sentinels: dict[Any, str] = {p.sentinel: name for name, p in self.procs.items()}
        while not self._stop.is_set():
            dead = wait(list(sentinels), timeout=0.1)
            while (msg := self._control.recv_foreign_safe(0)) is not None:
                self._forward(msg)
            if dead:
                self.stop_reason = f"{sentinels[dead[0]]} died"
                return
            if self._launcher_says_stop():
                return
            self._beat()
        self.stop_reason = self.stop_reason or "interrupted"

    def _beat(self) -> None:
        if time.monotonic() >= self._next_beat:
            self._launcher.send(StageAlive(stage_of(self.kind), self.joined.index))
            self._next_beat = time.monotonic() + HEARTBEAT_S

    def _forward(self, msg: Message) -> None:
        if isinstance(msg, (SchedulerStats, StageFailed)):
            self._launcher.send(msg)

    def _stop_all(self, timeout: float = 10.0) -> None:
        if self.stop_reason:
            logger.warning("%s stops: %s", self.name, self.stop_reason)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._unlink_rings()
        for chan in (self._control, self._launcher, self._status):
            chan.close()
        self._zmq.destroy(linger=1000)
        shutil.rmtree(self.cfg.run_dir, ignore_errors=True)


    def _unlink_rings(self) -> None:
        if self.kind == "engine":
            from ipc.step import StepRings

            StepRings.unlink_names(self.cfg.for_engine(self.joined.index))


def run_joined(address: str, kind: str, stage_key: str, model_path: str,
               host: str | None = None) -> int:
    """Join the pipeline at `address` and serve until it stops; the exit code."""
    host = host or reachable_from(address)
    joined = join(address, kind, stage_key, model_path, host)
    stage = RemoteStage(joined, kind)
    print(f"joined the pipeline at {address} as {stage.name} (listening on {host})",
          flush=True)
    return stage.run()
