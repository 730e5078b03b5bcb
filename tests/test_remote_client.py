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

from ipc.channels import PushChannel
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
    cfg = dataclasses.replace(live_config(tiny_model_dir), listen_host="0.0.0.0")
    with running(cfg) as pipe:
        (expected,) = pipe.client().generate([[5, 6, 7, 8]],
                                             SamplingParams(max_tokens=6, temperature=0.0))
        assert pipe.address is not None and pipe.address.startswith("tcp://")
        # Dialled by IP, whatever name the pipeline gives itself: every endpoint follows.
        address = "tcp://127.0.0.1:" + pipe.address.rsplit(":", 1)[1]
        key = pipe.cfg.client_key
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
        # Without the key: the bootstrap answers nothing useful, a request to a tokenizer
        # and an abort to the scheduler are dropped; a request sent straight to the
        # scheduler's network inbox (which takes aborts only) changes nothing either.
        with pytest.raises(PipelineError, match="refused the key"):
            fetch_endpoints(address, "not-the-key")
        ctx = zmq.Context.instance()
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(address)
        req.send_multipart([key.encode(), b"b"])
        assert req.poll(5000) and req.recv() == b""
        req.close()
        assert pipe.num_refused_bootstraps == 2
        client = pipe.client()
        unkeyed = [PushChannel(ctx, a, bind=False) for a in (remote.tokenizers[0],
                                                             remote.schedulers[0])]
        unkeyed[0].send(make_add_request("no-key", client.reply_to, [5, 6, 7], SamplingParams()))
        unkeyed[1].send(AbortRequest("long-tcp"))
        keyed = PushChannel(ctx, remote.schedulers[0], bind=False, secret=key.encode())
        keyed.send(TokenizedRequest("sneaky", "tcp://127.0.0.1:9", [5] * 4, SamplingParams(), 0))
        deadline = time.monotonic() + 10  # the sends are asynchronous: wait until both arrived
        while (stats := pipe.idle_stats()).num_refused_messages < 2 and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        assert pipe.is_alive
        assert stats.prompt_tokens == 3 * 4 + 2 * 2  # ours only (3 x 4, 2 x 2)
        assert stats.num_refused_messages >= 2  # the scheduler's: the unkeyed abort, the sneak
        assert fetch_endpoints(address, key) == remote
        for chan in (*unkeyed, keyed):
            chan.close()


def test_a_remote_client_needs_the_key() -> None:
    with pytest.raises(PipelineError, match="needs the pipeline's key"):
        PipelineClient.connect("tcp://127.0.0.1:9", key="")


def test_no_pipeline_at_an_address_is_a_clear_error() -> None:
    with pytest.raises(PipelineError, match="no pipeline answered"):
        fetch_endpoints("tcp://127.0.0.1:9", "some-key", timeout=0.5)
