"""A client in another process: by run directory on this host, and over tcp:// given only
the address and the key a pipeline started with --listen prints (every address it then uses
is tcp://, its outputs come back to its own tcp:// socket). Generate, stream, abort, health.
Without the key nothing gets in: no endpoints, no request, no abort."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq
from live import live_config, running
from test_curve import dial

from ipc import curve
from ipc.addresses import RemoteSettings
from ipc.codec import encode
from ipc.curve import client_identity
from ipc.messages import AbortRequest, SamplingParams, TokenizedRequest
from pipeline.runtime.client import (
    PipelineClient,
    PipelineError,
    fetch_endpoints,
    make_add_request,
)

pytestmark = [pytest.mark.live, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parent.parent

CLIENT = textwrap.dedent("""
    import asyncio, json, sys
    from ipc.messages import SamplingParams
    from pipeline.runtime.client import PipelineClient

    client = PipelineClient.connect(sys.argv[1])  # the key: $LLM_PIPELINE_KEY
    health = client.wait_for_status()
    (out,) = client.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0))

    async def aborted():
        seen = 0
        rid = "long-" + sys.argv[2]  # its own id: a late abort of an ended id is remembered
        async for delta in client.stream([9, 10], SamplingParams(max_tokens=400,
                                                                   ignore_eos=True), rid):
            seen += len(delta.token_ids)
            if seen >= 3:
                client.abort(rid)
            if delta.finished:
                return delta.finish_reason

    reason = asyncio.run(aborted())
    print(json.dumps({"ok": health.ok, "stages": sorted(health.stages), "ids": out.token_ids,
                      "reply_to": client.reply_to, "abort": reason}))
    client.close()
""")


def run_client(where: str, name: str, key: str = "") -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", CLIENT, where, name], capture_output=True,
                          text=True, timeout=60, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "LLM_PIPELINE_KEY": key})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_clients_by_run_directory_and_over_tcp(tiny_model_dir: Path) -> None:
    cfg = dataclasses.replace(live_config(tiny_model_dir),
                              remote=RemoteSettings(listen_host="0.0.0.0"))
    with running(cfg) as pipe:
        (expected,) = pipe.client().generate([[5, 6, 7, 8]],
                                             SamplingParams(max_tokens=6, temperature=0.0))
        assert pipe.address is not None and pipe.address.startswith("tcp://")
        # Dialled by IP, whatever name the pipeline gives itself: every endpoint follows.
        address = "tcp://127.0.0.1:" + pipe.address.rsplit(":", 1)[1]
        key = pipe.cfg.keys.client_key
        assert len(key) >= 16  # made by the launcher, since none was given
        remote = fetch_endpoints(address, key)
        addresses = [*remote.tokenizers, *remote.schedulers, remote.status]
        assert all(a.startswith("tcp://127.0.0.1:") for a in addresses) and remote.reply == "tcp://"
        stages = ["detokenizer:0", "executor:0", "scheduler:0", "tokenizer:0"]
        for where in (pipe.cfg.run_dir, address):
            got = run_client(where, "tcp" if where == address else "local",
                             key if where == address else "")
            assert got["ok"] is True and got["stages"] == stages
            assert got["ids"] == expected.token_ids
            assert got["abort"] == "abort"
            assert str(got["reply_to"]).startswith("tcp://" if where == address else "ipc://")
        # Without the key: the bootstrap answers nothing useful (a frame in the clear gets
        # no answer at all: CURVE; the old request, the key in a frame, proves nothing).
        with pytest.raises(PipelineError, match="refused the key"):
            fetch_endpoints(address, "not-the-key")
        assert bootstrap_answer(address, [key.encode()], encrypted=False) is None
        assert bootstrap_answer(address, [key.encode()]) == b""
        assert bootstrap_answer(address, [b"endpoints", b"00", b"ff"]) == b""
        assert pipe.num_refused_bootstraps == 3
        # A request with the client key in its frame reaches no tokenizer in the clear or
        # from an unknown CURVE key (ZAP); with the client key's identity but not the key
        # in the frame, or sent to the scheduler's network inbox, it is refused there.
        client = pipe.client()
        request = make_add_request("no-key", client.reply_to, [5, 6, 7], SamplingParams())
        c_public, c_secret = client_identity(key)
        server = remote.server_key.encode()
        frame = key.encode() + encode(request)
        senders = [dial(remote.tokenizers[0], None), dial(remote.tokenizers[0],
                                                          (*zmq.curve_keypair(), server)),
                   dial(remote.tokenizers[0], (c_public, c_secret, server)),
                   dial(remote.schedulers[0], (c_public, c_secret, server))]
        for sock, data in zip(senders, [frame, frame, encode(request), encode(AbortRequest(
                "long-tcp"))], strict=True):
            curve.send_now(sock, [data])  # (the first two may be refused before it)
        senders[3].send(key.encode() + encode(
            TokenizedRequest("sneaky", "tcp://127.0.0.1:9", [5] * 4, SamplingParams(), 0)))
        deadline = time.monotonic() + 10  # the sends are asynchronous: wait for the two
        while (stats := pipe.idle_stats()).num_refused_messages < 2 and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        time.sleep(0.5)  # (time for the other two to arrive, were they let in)
        assert pipe.is_alive
        stats = pipe.idle_stats()
        assert stats.prompt_tokens == 3 * 4 + 2 * 2  # ours only (3 x 4, 2 x 2)
        assert stats.num_refused_messages == 2  # the unkeyed abort and the sneak
        assert fetch_endpoints(address, key) == remote
        for sock in senders:
            sock.close()


def bootstrap_answer(address: str, frames: list[bytes], encrypted: bool = True
                     ) -> bytes | None:
    """What the bootstrap socket answers `frames` (None: nothing within 3 s)."""
    req = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    if encrypted:
        curve.connect_bootstrap(req, address)
    else:
        req.connect(address)
    try:
        if not curve.send_now(req, frames):
            return None  # refused before the send: no answer either
        return req.recv() if req.poll(3000) else None
    finally:
        req.close()


def test_a_remote_client_needs_the_key() -> None:
    with pytest.raises(PipelineError, match="needs the pipeline's key"):
        PipelineClient.connect("tcp://127.0.0.1:9", key="")


def test_no_pipeline_at_an_address_is_a_clear_error() -> None:
    with pytest.raises(PipelineError, match="no pipeline answered"):
        fetch_endpoints("tcp://127.0.0.1:9", "some-key", timeout=0.5)
