"""ZeroMQ channel helpers and the per-run address book. Used by every process.

Channels between stages carry the run's secret (a random prefix of every frame, handed to each
stage process at spawn and never written to disk): a frame without it did not come from a stage
of this run and is refused (`ForeignFrame`), counted and dropped; it never kills the stage.
Channels that face clients (tokenizer inboxes, the abort inbox) carry the run's client key
the same way (local clients read it from the private run directory, remote ones are given it:
--listen); reply sockets carry none (the client dialled nothing: the pipeline connects to it).

All addresses of one pipeline come from one run directory (mode 0700), so two pipelines on one
machine never collide. (Clients on other hosts reach it over `tcp://` with the key: see
--listen; stages on other hosts over `tcp://` too, with the stage key: see --stage-key.
Every tcp:// endpoint is encrypted and its peer's key checked: ipc/curve.py.)
"""

from __future__ import annotations

import hmac
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from ipc import curve
from ipc.codec import Codec, ProtocolError, encode
from ipc.messages import Message

if TYPE_CHECKING:
    from ipc.config import PipelineConfig

logger = logging.getLogger(__name__)


def make_run_dir() -> Path:
    """A fresh private directory for this run's ipc:// sockets."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix="llm-pipeline-", dir=base))
    path.chmod(0o700)
    return path


class ForeignFrame(ProtocolError):
    """A frame on a stage-to-stage channel without the run's secret: not from this run."""


class PushChannel:
    """Sends messages. `bind=False` connects to a peer that binds. With `secret`, every frame
    starts with it (a stage-to-stage channel)."""

    def __init__(self, ctx: zmq.Context, address: str, *, bind: bool,
                 linger_ms: int = 2000, secret: bytes = b"") -> None:
        self.address, self.secret = address, secret
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, linger_ms)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on our own stages
        if bind:
            curve.bind(self.socket, address, curve.STAGES)
        else:
            curve.connect(self.socket, address)  # (tcp:// under CURVE: ipc/curve.py)

    def _frame(self, msg: Message) -> bytes:
        return self.secret + encode(msg) if self.secret else encode(msg)

    def send(self, msg: Message) -> None:
        self.socket.send(self._frame(msg), copy=False)

    def try_send(self, msg: Message) -> bool:
        """Send without blocking; False if the peer cannot take it now."""
        try:
            self.socket.send(self._frame(msg), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self.socket.close()


class PullChannel:
    """Receives messages of the types its codec accepts. With `secret`, only frames that start
    with it (a stage-to-stage channel); others raise ForeignFrame and are counted."""

    def __init__(
        self, ctx: zmq.Context, address: str | list[str], codec: Codec, *, bind: bool,
        secret: bytes = b""
    ) -> None:
        self.codec, self.secret = codec, secret
        self.num_refused = 0  # frames refused: foreign, or malformed on a client-facing one
        self.address_name = address if isinstance(address, str) else ", ".join(address)
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.port = 0  # the tcp:// port bound (the last, of several; 0: none)
        for addr in [address] if isinstance(address, str) else address:
            if bind:
                self.port = curve.bind(self.socket, addr, curve.STAGES) or self.port
            else:
                curve.connect(self.socket, addr)

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """The next message, None on timeout. Raises ProtocolError on a malformed one."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self._decode(self.socket.recv(copy=True))

    def _decode(self, data: bytes) -> Message:
        if self.secret:
            n = len(self.secret)
            if not hmac.compare_digest(data[:n], self.secret):  # no timing to learn it from
                self.num_refused += 1
                raise ForeignFrame(f"a frame of {len(data)} bytes without this run's secret")
            return self.codec.decode(memoryview(data)[n:])
        return self.codec.decode(data)

    def recv_foreign_safe(self, timeout_ms: int | None = None) -> Message | None:
        """recv() on a stage-to-stage channel: a foreign frame is logged and dropped (None);
        a malformed frame that carries the secret is a bug and still raises."""
        try:
            return self.recv(timeout_ms)
        except ForeignFrame as exc:
            logger.warning("refused a frame on %s: %s", self.address_name, exc)
            return None

    def recv_valid(self, timeout_ms: int,
                   on_error: Callable[[ProtocolError], None] | None = None) -> Message | None:
        """The next message, or None on timeout or after a malformed one (handed to on_error,
        else logged): channels that face clients survive bad input."""
        try:
            return self.recv(timeout_ms)
        except ProtocolError as exc:
            if not isinstance(exc, ForeignFrame):
                self.num_refused += 1
            if on_error is None:
                logger.error("dropped a malformed message: %s", exc)
            else:
                on_error(exc)
            return None

    def recv_nowait(self) -> Message | None:
        try:
            data = self.socket.recv(flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return None
        return self._decode(data)

    def close(self) -> None:
        self.socket.close()


def listen_tcp(inbox: PullChannel, host: str, port: int = 0) -> dict[str, int]:
    """With --listen, an inbox also takes remote clients on a tcp:// port of `host` (`port`,
    or any free one): {"tcp_port": port}, for the stage's StageReady info ({} without
    --listen). A restarted stage binds the port its predecessor had."""
    if not host:
        return {}
    return {"tcp_port": curve.bind(inbox.socket, f"tcp://{host}:{port}", curve.CLIENTS)}


def stage_listen(inbox: PullChannel, cfg: PipelineConfig, port: int = 0) -> int:
    """When stages on other hosts may join (cfg.accepts_stages), a stage's inbox from the
    other stages also listens on a tcp:// port of the listen host (`port`, a restarted
    stage's predecessor's, or any free one): the port (else 0)."""
    if not cfg.accepts_stages:
        return 0
    return curve.bind(inbox.socket, f"tcp://{cfg.remote.listen_host}:{port}", curve.STAGES)


class SubChannel(PullChannel):
    """Receives everything a PUB socket publishes (the launcher's status), decoded alike.
    A subscriber that connects late misses what was published before: status is periodic."""

    def __init__(self, ctx: zmq.Context, address: str, codec: Codec) -> None:
        self.codec, self.secret, self.num_refused, self.address_name = codec, b"", 0, address
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        curve.connect(self.socket, address)


__all__ = ["ForeignFrame", "ProtocolError", "PullChannel", "PushChannel", "SubChannel",
           "listen_tcp", "make_run_dir", "stage_listen"]


class ReplySockets:
    """One PUSH socket per client reply address (a PUSH connected to several would round-robin).

    Sends never block: a client that has gone away must not stall a stage; its outputs are
    dropped with a warning. Sockets of idle addresses are closed, oldest first. An address
    that `is_client` refuses (a stage's own socket, say) is never dialled: a request cannot
    make a stage send its outputs into another stage.
    """

    def __init__(self, ctx: zmq.Context, max_open: int = 256,
                 is_client: Callable[[str], bool] = lambda address: True) -> None:
        self._ctx, self._max_open, self._is_client = ctx, max_open, is_client
        self._sockets: dict[str, PushChannel] = {}
        self.num_refused = 0  # outputs not sent: the address is not a client's

    def send(self, address: str, msg: Message) -> bool:
        if address not in self._sockets and not self._is_client(address):
            self.num_refused += 1
            logger.warning("refused to reply to %r: not a client's address", address)
            return False
        chan = self._sockets.pop(address, None)
        if chan is None:
            chan = self._connect(address)
            if chan is None:
                return False
        self._sockets[address] = chan  # most recently used last
        while len(self._sockets) > self._max_open:
            oldest = next(iter(self._sockets))
            self._sockets.pop(oldest).close()
        if chan.try_send(msg):
            return True
        logger.warning("client %s is not reading its outputs; dropped a message", address)
        return False

    def _connect(self, address: str) -> PushChannel | None:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 2000)
        socket.setsockopt(zmq.SNDHWM, 100_000)  # set before connect, or it does not apply
        try:
            curve.connect_as_server(socket, address)  # (a client's tcp:// socket: CURVE)
        except zmq.ZMQError as exc:
            socket.close()
            logger.error("cannot reply to %r: %s", address, exc)
            return None
        chan = PushChannel.__new__(PushChannel)
        chan.address, chan.socket, chan.secret = address, socket, b""
        return chan

    def close(self) -> None:
        for chan in self._sockets.values():
            chan.close()
        self._sockets.clear()
