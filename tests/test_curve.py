"""CURVE on tcp:// endpoints (ipc/curve.py): the keys, one socket serving ipc:// in the clear and
tcp:// encrypted, the ZAP handler refusing unknown keys, the proven endpoints exchange."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from ipc import curve
from ipc.curve import CurveKeys, client_identity, derived_server_secret, stage_identity
from ipc.keys import proof
from pipeline.runtime.client import endpoints_answer, endpoints_request


def test_identities_follow_their_keys() -> None:
    assert client_identity("key-a") == client_identity("key-a") != client_identity("key-b")
    assert stage_identity("stage", "run-1") != stage_identity("stage", "run-2")
    assert derived_server_secret("stage", "run-1") != derived_server_secret("stage", "run-2")
    public, secret = client_identity("key-a")
    assert zmq.curve_public(secret) == public and len(public) == 40
    keys = CurveKeys.for_stage(derived_server_secret("s" * 16, "r"), "key-a", "s" * 16, "r")
    assert keys.admitted[curve.CLIENTS] == {public}
    assert keys.admitted[curve.STAGES] == {stage_identity("s" * 16, "r")[0]}
    assert keys.admitted[curve.ALL] == keys.admitted[curve.CLIENTS] | keys.admitted[curve.STAGES]
    alone = CurveKeys.for_stage(zmq.curve_keypair()[1], "key-a", "", "r")  # no stage key
    assert alone.admitted[curve.STAGES] == frozenset() and alone.public == b""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[zmq.Socket, str, str, CurveKeys]]:
    """A PULL socket of a 'stage': ipc:// in the clear, then tcp:// for clients under CURVE."""
    ctx = zmq.Context()
    keys = CurveKeys.for_stage(zmq.curve_keypair()[1], "the-client-key", "", "run")
    curve.install(ctx, keys)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    ipc = f"ipc://{tmp_path}/inbox.sock"
    curve.bind(sock, ipc, curve.STAGES)
    port = curve.bind(sock, "tcp://127.0.0.1:0", curve.CLIENTS)
    try:
        yield sock, ipc, f"tcp://127.0.0.1:{port}", keys
    finally:
        curve.destroy(ctx, linger=0)


Server = tuple[zmq.Socket, str, str, CurveKeys]


def dial(address: str, keys: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    """A raw PUSH socket to `address`: in the clear, or as the CURVE client (public, secret,
    server key)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    sock.connect(address)
    return sock


def _delivered(sock: zmq.Socket, address: str, keys: tuple[bytes, bytes, bytes] | None,
               text: bytes, wait_ms: int = 3000) -> bool:
    push = dial(address, keys)
    if not curve.send_now(push, [text]):
        push.close()
        return False
    try:
        return bool(sock.poll(wait_ms)) and sock.recv() == text
    finally:
        push.close()


def test_a_send_with_no_pipe_is_refused_not_waited_for() -> None:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        assert not curve.send_now(push, [b"x"])  # no pipe (as after a refused handshake)
        push.connect("tcp://127.0.0.1:9")
        assert curve.send_now(push, [b"x", b"y"])  # queued on the pipe made by connect
    finally:
        push.close()


def test_tcp_takes_only_the_admitted_key_and_ipc_stays_clear(server: Server) -> None:
    sock, ipc, tcp, keys = server
    assert sock.get(zmq.MECHANISM) == zmq.NULL  # set back after the tcp:// endpoint
    public, secret = client_identity("the-client-key")
    assert _delivered(sock, ipc, None, b"local, in the clear")
    assert _delivered(sock, tcp, (public, secret, keys.server_public), b"the client")
    # (a refused handshake takes ~1 ms here: 500 ms is room, not a race)
    assert not _delivered(sock, tcp, None, b"in the clear", 500)
    assert not _delivered(sock, tcp, (*zmq.curve_keypair(), keys.server_public), b"unknown",
                          500)
    other = client_identity("another-key")
    assert not _delivered(sock, tcp, (*other, keys.server_public), b"another client key", 500)
    # A client that expects another server key (a man in the middle's) never talks to it.
    assert not _delivered(sock, tcp, (public, secret, zmq.curve_keypair()[0]), b"wrong server",
                          500)


def test_a_client_dials_through_its_installed_keys(server: Server) -> None:
    sock, _, tcp, keys = server
    ctx = zmq.Context()
    try:
        curve.install(ctx, CurveKeys.for_client("the-client-key", keys.server_public))
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        curve.connect(push, tcp)
        assert push.get(zmq.MECHANISM) == zmq.NULL  # only that endpoint is CURVE
        push.send(b"through the client's keys")
        assert sock.poll(3000) and sock.recv() == b"through the client's keys"
        push.close()
        with pytest.raises(RuntimeError, match="without CURVE keys"):
            curve.connect(zmq.Context.instance().socket(zmq.PUSH), tcp)
    finally:
        curve.destroy(ctx, linger=0)


def test_the_endpoints_exchange_proves_the_key_both_ways() -> None:
    body = json.dumps({"tokenizers": ["tcp://h:1"]})
    request = endpoints_request("the-key")
    assert b"the-key" not in b"".join(request)  # the key itself is never sent
    reply = json.loads(endpoints_answer(request, "the-key", body))
    nonce = request[1].decode()
    assert reply == {"answer": body, "proof": proof("the-key", "endpoints answer", nonce, body)}
    assert endpoints_answer(endpoints_request("not-the-key"), "the-key", body) == b""
    assert endpoints_answer([b"endpoints", b"n"], "the-key", body) == b""
    assert endpoints_answer([b"endpoints", b"\xff", b"\xfe"], "the-key", body) == b""
    assert endpoints_answer(request, "", body) == b""  # no key: nothing to prove
