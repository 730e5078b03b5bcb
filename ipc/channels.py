"""ZeroMQ channel helpers and the per-run address book. Used by every process.

All addresses of one pipeline come from one run directory (mode 0700), so two pipelines on one
machine never collide. (Clients on other hosts reach it over `tcp://`: see --listen; stages on
other hosts are not wired up yet.)
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import zmq

from ipc.codec import Codec, ProtocolError, encode
from ipc.messages import Message

logger = logging.getLogger(__name__)


def make_run_dir() -> Path:
    """A fresh private directory for this run's ipc:// sockets."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix="llm-pipeline-", dir=base))
    path.chmod(0o700)
    return path


class PushChannel:
    """Sends messages. `bind=False` connects to a peer that binds."""

    def __init__(self, ctx: zmq.Context, address: str, *, bind: bool,
                 linger_ms: int = 2000) -> None:
        self.address = address
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, linger_ms)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block on our own stages
        if bind:
            self.socket.bind(address)
        else:
            self.socket.connect(address)

    def send(self, msg: Message) -> None:
        self.socket.send(encode(msg), copy=False)

    def try_send(self, msg: Message) -> bool:
        """Send without blocking; False if the peer cannot take it now."""
        try:
            self.socket.send(encode(msg), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self.socket.close()


class PullChannel:
    """Receives messages of the types its codec accepts."""

    def __init__(
        self, ctx: zmq.Context, address: str | list[str], codec: Codec, *, bind: bool
    ) -> None:
        self.codec = codec
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        for addr in [address] if isinstance(address, str) else address:
            (self.socket.bind if bind else self.socket.connect)(addr)

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """The next message, None on timeout. Raises ProtocolError on a malformed one."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self.codec.decode(self.socket.recv(copy=True))

    def recv_valid(self, timeout_ms: int,
                   on_error: Callable[[ProtocolError], None] | None = None) -> Message | None:
        """The next message, or None on timeout or after a malformed one (handed to on_error,
        else logged): channels that face clients survive bad input."""
        try:
            return self.recv(timeout_ms)
        except ProtocolError as exc:
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
        return self.codec.decode(data)

    def close(self) -> None:
        self.socket.close()


def listen_tcp(inbox: PullChannel, host: str) -> dict[str, int]:
    """With --listen, an inbox also takes remote clients on a tcp:// port of `host`:
    {"tcp_port": port}, for the stage's StageReady info ({} without --listen)."""
    if not host:
        return {}
    return {"tcp_port": inbox.socket.bind_to_random_port(f"tcp://{host}")}


class SubChannel(PullChannel):
    """Receives everything a PUB socket publishes (the launcher's status), decoded alike.
    A subscriber that connects late misses what was published before: status is periodic."""

    def __init__(self, ctx: zmq.Context, address: str, codec: Codec) -> None:
        self.codec = codec
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(address)


__all__ = ["ProtocolError", "PullChannel", "PushChannel", "SubChannel", "listen_tcp",
           "make_run_dir"]


class ReplySockets:
    """One PUSH socket per client reply address (a PUSH connected to several would round-robin).

    Sends never block: a client that has gone away must not stall a stage; its outputs are
    dropped with a warning. Sockets of idle addresses are closed, oldest first.
    """

    def __init__(self, ctx: zmq.Context, max_open: int = 256) -> None:
        self._ctx, self._max_open = ctx, max_open
        self._sockets: dict[str, PushChannel] = {}

    def send(self, address: str, msg: Message) -> bool:
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
            socket.connect(address)
        except zmq.ZMQError as exc:
            socket.close()
            logger.error("cannot reply to %r: %s", address, exc)
            return None
        chan = PushChannel.__new__(PushChannel)
        chan.address, chan.socket = address, socket
        return chan

    def close(self) -> None:
        for chan in self._sockets.values():
            chan.close()
        self._sockets.clear()
