"""The launcher's tcp:// face (with --listen): the run's CURVE keys, the public addresses of
its control and status sockets, and the bootstrap socket that hands remote clients the
endpoints and lets stages on other hosts join (roster.py decides; remote.py is the joining
side). Runs in the launcher's process; the bootstrap socket is its supervisor thread's."""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from typing import Any

import zmq

from ipc import curve
from ipc.config import PipelineConfig
from ipc.model_info import model_fingerprint
from pipeline.runtime.client import ENDPOINTS_REQUEST, endpoints_answer
from pipeline.runtime.engines import Engines
from pipeline.runtime.roster import Roster

logger = logging.getLogger(__name__)

NO_JOINS = (b'{"error": "this pipeline takes no stages from other hosts: start it '
            b'with --listen HOST and --stage-key KEY"}')


class Bootstrap:
    """Where remote clients and stages reach the run, and the answers they get."""

    def __init__(self, zctx: zmq.Context, cfg: PipelineConfig) -> None:
        """cfg: the created run's (its CURVE secret and keys). Installs the run's CURVE keys
        on `zctx`, so the tcp:// sockets made from it after this are encrypted."""
        self._zmq, self.cfg = zctx, cfg
        self.address: str | None = None  # the bootstrap socket's tcp://, once opened
        self.socket: zmq.Socket | None = None
        self.num_refused = 0  # requests for the endpoints without the client key
        self.public: dict[str, str] = {}  # the tcp:// control and status
        self.fingerprint = ""  # the model's, which a joining stage's must equal
        self._endpoints = ""  # what a remote client is handed (update_endpoints)
        keys = cfg.curve_keys()
        if keys is not None:
            curve.install(zctx, keys)

    @property
    def public_host(self) -> str:
        """The name remote clients and stages reach this host by (with --listen)."""
        host = self.cfg.remote.listen_host
        return socket.getfqdn() if host in ("0.0.0.0", "*") else host

    def tcp(self, port: int) -> str:
        return f"tcp://{self.public_host}:{port}"

    def accept_stages(self, control: zmq.Socket) -> None:
        """Where stages may join (--listen and --stage-key), the control socket listens on
        tcp:// too: stages on other hosts report there."""
        if self.cfg.accepts_stages:
            port = curve.bind(control, f"tcp://{self.cfg.remote.listen_host}:0", curve.STAGES)
            self.public["control"] = self.tcp(port)
            self.fingerprint = model_fingerprint(self.cfg.model.path)

    def open(self, status: zmq.Socket, roster: Roster, ready: dict[str, dict[str, Any]]) -> None:
        """With --listen: the status publisher on tcp:// too, and the bootstrap socket
        (self.address). ready: the local stages' ready reports (their tcp:// ports)."""
        host = self.cfg.remote.listen_host
        if not host:
            return
        self.public["status"] = self.tcp(curve.bind(status, f"tcp://{host}:0", curve.ALL))
        self.socket = self._zmq.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address = self.tcp(curve.bind(self.socket, f"tcp://{host}:0", curve.BOOTSTRAP))
        self.update_endpoints(roster, ready)

    def update_endpoints(self, roster: Roster | None, ready: dict[str, dict[str, Any]]) -> None:
        """What the bootstrap socket hands remote clients: the tcp:// inboxes of every
        tokenizer and engine, those that joined from other hosts included."""
        cfg = self.cfg
        joined = dict(sorted(roster.joined_addresses().items() if roster else (),
                             key=lambda item: int(item[0].split(":")[1])))

        def local(stage: str, count: int) -> tuple[str, ...]:
            # ("": an engine not started yet, waiting for the host of its pipeline stages)
            return tuple(self.tcp(ready[f"{stage}:{i}"]["tcp_port"])
                         if f"{stage}:{i}" in ready else "" for i in range(count))

        def of(stage: str) -> tuple[str, ...]:
            return tuple(a for name, a in joined.items() if name.startswith(f"{stage}:"))

        remote = dataclasses.replace(
            cfg.endpoints,
            tokenizers=local("tokenizer", cfg.num_tokenizers) + of("tokenizer"),
            schedulers=local("scheduler", cfg.data_parallel_size) + of("scheduler"),
            status=self.public["status"], reply="tcp://", key="",  # (the client has it)
            tokenizer_ranks=tuple(range(cfg.num_tokenizers))
            + tuple(int(name.split(":")[1]) for name in joined if name.startswith("tokenizer:")))
        self._endpoints = remote.to_json()

    def serve(self, roster: Roster, engines: Engines) -> None:
        """Answer every request waiting on the bootstrap socket (none without --listen)."""
        while self.socket is not None and self.socket.poll(0):
            self._answer(self.socket, roster, engines)

    def _answer(self, sock: zmq.Socket, roster: Roster, engines: Engines) -> None:
        """A remote client that proves it holds the client key gets the tcp:// endpoints (an
        answer proven with the key in turn: endpoints_answer); a stage on another host that
        proves it has the stage key joins (roster.py); any other request gets an empty
        answer (a REP socket must answer) and is counted."""
        try:
            frames = sock.recv_multipart()
        except zmq.ZMQError as exc:
            logger.warning("bootstrap request failed: %s", exc)
            return
        reply = b""
        try:
            if frames[0] == ENDPOINTS_REQUEST:
                reply = endpoints_answer(frames, self.cfg.keys.client_key, self._endpoints)
                if not reply:
                    self.num_refused += 1
            elif frames[0] in (b"hello", b"join"):
                reply = self._answer_join(frames, roster, engines)
            else:
                self.num_refused += 1
        except Exception:  # whatever a request holds, the supervisor goes on
            logger.exception("a bootstrap request could not be answered")
        try:
            sock.send(reply)  # (a REP socket answers every request)
        except zmq.ZMQError as exc:
            logger.warning("bootstrap answer failed: %s", exc)

    def _answer_join(self, frames: list[bytes], roster: Roster, engines: Engines) -> bytes:
        if not self.cfg.accepts_stages:
            return NO_JOINS
        waiting = engines.needs_host()
        reply, member = roster.answer(frames, self.cfg.keys.stage_key, self.fingerprint,
                                      time.monotonic(), self.public, waiting)
        if member is not None:
            logger.warning("%s is joining from %s", member.name, member.tcp)
            if member.kind == "engine":
                engines.grow()
            elif member.kind == "pipeline" and waiting is not None:  # (it loads now:
                engines.hosts[waiting] = member.name  # EngineRestarts.advance)
        return reply

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
