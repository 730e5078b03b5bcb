"""CURVE on every tcp:// socket: ZeroMQ's CurveZMQ (Curve25519 keys, each connection's frames
encrypted and authenticated with keys of that connection only). ipc:// sockets stay as they
are: the run directory (mode 0700) guards them. Used by every process that has a tcp:// side.

Keys (all z85 text, as libzmq takes them):
- **S, the run's server key**: every tcp:// socket of a stage or the launcher answers as the
  CURVE server with it, whichever side binds (a stage replying to a client's tcp:// socket
  dials it as the server). Per run: derived from the stage key and the run id where stages
  may join from other hosts (each side derives it; it never crosses the network), else
  random. Clients learn its public half from the bootstrap answer, which proves that it
  came from a holder of the client key.
- **C, the client key's identity**: derived from the client key, so every client holding
  the key has it; the stages' ZAP handler admits it on the sockets that face clients.
- **K, the stage key's identity**: derived from the stage key and the run id; a stage dials
  another host's stage with it; admitted on the sockets that face stages.
- **B, the bootstrap key**: derived from a public label, so anyone can open the bootstrap
  socket (encrypted, as every tcp:// socket); what is asked there is proven inside with the
  client or stage key (challenge and answer proofs), so a man in the middle, who can know B,
  learns nothing and can hand out nothing a client or stage would take.

A process that binds or dials tcp:// installs its keys on its ZeroMQ context (`install`):
the channels then set each tcp:// endpoint's options at its bind or connect (libzmq takes a
socket's options when an endpoint is made, so one socket serves ipc:// in the clear and
tcp:// under CURVE), and a ZAP handler thread refuses every public key not admitted for the
endpoint's domain.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

# The ZAP domains of the tcp:// endpoints: who each admits.
CLIENTS, STAGES, ALL, BOOTSTRAP = b"clients", b"stages", b"all", b"bootstrap"
_CLEAR = b"clear"  # the domain set back after a tcp:// endpoint (ipc:// ones use NULL)


def keypair_from(seed: bytes) -> tuple[bytes, bytes]:
    """A Curve25519 key pair (public, secret; z85) made from a seed: any 32 bytes are a secret
    key (the curve clamps them)."""
    secret = z85.encode(hashlib.sha256(seed).digest())
    return zmq.curve_public(secret), secret


def client_identity(client_key: str) -> tuple[bytes, bytes]:
    """C: the key pair every holder of the client key dials with."""
    return keypair_from(b"llm-pipeline client identity\n" + client_key.encode())


def stage_identity(stage_key: str, run_id: str) -> tuple[bytes, bytes]:
    """K: the key pair a stage dials another host's stage with."""
    return keypair_from(hmac.new(stage_key.encode(), f"llm-pipeline stage identity {run_id}"
                                 .encode(), hashlib.sha256).digest())


def derived_server_secret(stage_key: str, run_id: str) -> bytes:
    """S's secret half for a run that stages may join: each side derives it from the key."""
    return keypair_from(hmac.new(stage_key.encode(), f"llm-pipeline server key {run_id}"
                                 .encode(), hashlib.sha256).digest())[1]


BOOTSTRAP_KEYS = keypair_from(b"llm-pipeline bootstrap (a public label: see ipc/curve.py)")


@dataclass(frozen=True)
class CurveKeys:
    """One process's keys for its tcp:// endpoints.

    server_secret: S's secret half (stages and the launcher; empty in a client);
    server_public: S's public half (what a dialler expects the far side to prove);
    public, secret: the identity this process dials with (C in a client, K in a stage);
    admitted: the public keys each ZAP domain lets in (stages and the launcher)."""

    server_public: bytes
    server_secret: bytes = b""
    public: bytes = b""
    secret: bytes = b""
    admitted: dict[bytes, frozenset[bytes]] = field(default_factory=dict)

    @classmethod
    def for_stage(cls, server_secret: bytes, client_key: str, stage_key: str,
                  run_id: str) -> CurveKeys:
        clients = {client_identity(client_key)[0]} if client_key else set()
        own = stage_identity(stage_key, run_id) if stage_key else (b"", b"")
        stages = {own[0]} if stage_key else set()
        return cls(zmq.curve_public(server_secret), server_secret, own[0], own[1],
                   {CLIENTS: frozenset(clients), STAGES: frozenset(stages),
                    ALL: frozenset(clients | stages)})

    @classmethod
    def for_client(cls, client_key: str, server_public: bytes) -> CurveKeys:
        public, secret = client_identity(client_key)
        return cls(server_public, b"", public, secret)


class _Admit:
    """The ZAP handler's question for one domain: is this public key let in?"""

    def __init__(self, keys: frozenset[bytes] | None) -> None:
        self.keys = keys  # None: any (the bootstrap, whose requests prove themselves)

    def callback(self, domain: str, key: bytes) -> bool:
        return self.keys is None or key in self.keys


_installed: weakref.WeakKeyDictionary[zmq.Context, tuple[CurveKeys, object | None]] = (
    weakref.WeakKeyDictionary())


def install(ctx: zmq.Context, keys: CurveKeys) -> None:
    """Use `keys` for every tcp:// endpoint made on `ctx`'s sockets from now on; where the
    keys admit anyone (a stage or the launcher), start the ZAP handler that checks them."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = None
    if keys.server_secret:
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("ipc.curve.zap"))
        auth.start()
        for domain, admitted in keys.admitted.items():
            auth.configure_curve_callback(domain.decode(), _Admit(admitted))
        auth.configure_curve_callback(BOOTSTRAP.decode(), _Admit(None))
    _installed[ctx] = (keys, auth)


def destroy(ctx: zmq.Context, linger: int) -> None:
    """Destroy `ctx`, its ZAP handler (if `install` started one) stopped first: the handler's
    socket is one of the context's."""
    entry = _installed.pop(ctx, None)
    if entry is not None and entry[1] is not None:
        entry[1].stop()  # type: ignore[attr-defined]
    ctx.destroy(linger=linger)


def keys_of(ctx: zmq.Context) -> CurveKeys | None:
    entry = _installed.get(ctx)
    return entry[0] if entry else None


def _server_options(socket: zmq.Socket, keys: CurveKeys, domain: bytes,
                    secret: bytes | None = None) -> None:
    socket.setsockopt(zmq.ZAP_DOMAIN, domain)
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret or keys.server_secret)


def _client_options(socket: zmq.Socket, public: bytes, secret: bytes, server: bytes) -> None:
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
    socket.setsockopt(zmq.CURVE_SERVERKEY, server)


@contextmanager
def _one_endpoint(socket: zmq.Socket) -> Iterator[None]:
    """The CURVE options set inside apply to the endpoint made inside only: the socket is back
    to the NULL mechanism for its next ones (ipc://)."""
    try:
        yield
    finally:
        socket.setsockopt(zmq.CURVE_SERVER, 0)
        socket.setsockopt(zmq.ZAP_DOMAIN, _CLEAR)


def _required(socket: zmq.Socket, address: str) -> CurveKeys:
    keys = keys_of(socket.context)
    if keys is None:
        raise RuntimeError(f"{address}: a tcp:// endpoint on a context without CURVE keys "
                           "(ipc.curve.install)")
    return keys


def bind(socket: zmq.Socket, address: str, domain: bytes) -> int:
    """Bind `address` (tcp://HOST:PORT, a port of 0: any free one; or ipc://); tcp:// ones as
    the CURVE server, letting in the keys `domain` admits. The port bound (0 for ipc://)."""
    if not address.startswith("tcp://"):
        socket.bind(address)
        return 0
    keys = _required(socket, address)
    host, _, port = address.rpartition(":")
    with _one_endpoint(socket):
        _server_options(socket, keys, domain,
                        BOOTSTRAP_KEYS[1] if domain == BOOTSTRAP else None)
        if int(port):
            socket.bind(address)
            return int(port)
        return socket.bind_to_random_port(host)


def connect(socket: zmq.Socket, address: str) -> None:
    """Connect to `address`; to a tcp:// one as the CURVE client with this process's identity,
    expecting the run's server key."""
    if not address.startswith("tcp://"):
        socket.connect(address)
        return
    keys = _required(socket, address)
    with _one_endpoint(socket):
        _client_options(socket, keys.public, keys.secret, keys.server_public)
        socket.connect(address)


def connect_as_server(socket: zmq.Socket, address: str, domain: bytes = CLIENTS) -> None:
    """Dial a client's tcp:// reply socket as the CURVE server (the client binds, and proves
    it holds the client key); other addresses plainly."""
    if not address.startswith("tcp://"):
        socket.connect(address)
        return
    keys = _required(socket, address)
    with _one_endpoint(socket):
        _server_options(socket, keys, domain)
        socket.connect(address)


def bind_as_client(socket: zmq.Socket, host: str) -> int:
    """A client's reply socket on any free tcp:// port of `host`, as the CURVE client: only a
    holder of the run's server key can send into it. The port."""
    keys = _required(socket, f"tcp://{host}")
    with _one_endpoint(socket):
        _client_options(socket, keys.public, keys.secret, keys.server_public)
        return socket.bind_to_random_port(f"tcp://{host}")


def connect_bootstrap(socket: zmq.Socket, address: str) -> None:
    """Dial a pipeline's bootstrap socket: encrypted under the bootstrap key, as a fresh
    identity (the request inside proves what its sender holds)."""
    public, secret = zmq.curve_keypair()
    _client_options(socket, public, secret, BOOTSTRAP_KEYS[0])
    socket.connect(address)


def send_now(socket: zmq.Socket, frames: list[bytes]) -> bool:
    """Send `frames` without blocking; False where the socket has no pipe to queue them on. A
    peer that refuses a dialled socket's handshake drops its only pipe, and a REQ or PUSH
    socket without one would wait for a peer for ever (the caller's poll then times out)."""
    try:
        socket.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
