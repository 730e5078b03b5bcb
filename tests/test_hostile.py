"""Hostile messages (issue: nothing from outside can stop the engine). Against a live pipeline
on the tiny model: an AddRequest whose reply address is another stage's socket, well-formed
but foreign frames on every stage-to-stage socket, malformed and random frames on every socket
of the run, and frames to the launcher's control socket. After each, every stage is alive,
the pipeline answers, and health stays ok. Bounded loops, loopback and ipc:// only."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from live import alive, live_config, running

from ipc.addresses import RemoteSettings
from ipc.channels import ReplySockets
from ipc.codec import encode
from ipc.config import PipelineConfig
from ipc.messages import (
    AbortRequest,
    AddRequest,
    DetokBatch,
    DetokRequestInfo,
    EngineDown,
    ReconcileAnswer,
    SampledTokens,
    SamplingParams,
    StageFailed,
    StepPlan,
    TokenDelta,
    TokenizedRequest,
    TokenLogprob,
)
from pipeline.runtime.launcher import Pipeline

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pipe(tiny_model_dir: Path) -> Iterator[Pipeline]:
    with running(live_config(tiny_model_dir, num_detokenizers=2)) as p:
        yield p


def stage_sockets(cfg: PipelineConfig) -> dict[str, str]:
    """Every socket a stage or the launcher binds in the run directory."""
    return {"executor": cfg.executor_address, "sampled": cfg.sampled_address,
            "scheduler": cfg.scheduler_address, "abort": cfg.abort_address,
            "control": cfg.control_address, "tokenizer": cfg.tokenizer_address(0),
            "tokenizer-stages": cfg.tokenizer_stage_address(0),
            **{f"detokenizer-{r}": cfg.detokenizer_address(r)
               for r in range(cfg.num_detokenizers)}}


def send_raw(address: str, frames: list[bytes]) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    for frame in frames:
        sock.send(frame)
    sock.close()


def assert_still_serving(pipe: Pipeline) -> None:
    """Every stage alive, health ok, and a real request answered."""
    time.sleep(0.3)  # let the frames arrive and be refused
    assert alive(list(pipe.stage_pids.values())) == list(pipe.stage_pids.values())
    assert pipe.is_alive, pipe.failure
    client = pipe.client()
    (out,) = client.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0),
                             timeout=60)
    assert out.error is None and len(out.token_ids) == 3
    client.wait_for_status()
    assert client.health().ok, client.health().problem


def test_a_reply_address_that_is_a_stage_socket_is_never_dialled(pipe: Pipeline) -> None:
    """A request that asks for its outputs to go into the executor's (or any stage's) inbox:
    the tokenizer and the detokenizers refuse to send there; the engine goes on."""
    cfg = pipe.cfg
    for name, address in stage_sockets(cfg).items():
        good = AddRequest(f"hostile-{name}", address, "hello", None, None,
                          SamplingParams(max_tokens=2), 0.0)
        bad = AddRequest(f"hostile-bad-{name}", address, "", None, None,
                         SamplingParams(max_tokens=0), 0.0)  # an error answer, also refused
        key = cfg.keys.client_key.encode()  # a client with the key, but hostile
        send_raw(cfg.tokenizer_address(0), [key + encode(good), key + encode(bad)])
    assert_still_serving(pipe)


def test_foreign_frames_on_stage_sockets_are_refused(pipe: Pipeline) -> None:
    """Well-formed messages of the right type for each stage-to-stage socket, with hostile
    contents, but without the run's secret: a token id of 10**6, an empty prompt, a plan for
    a ring slot that does not exist, ids of -1 for the detokenizer, a fake stage failure."""
    cfg = pipe.cfg
    hostile = {
        cfg.scheduler_address: [
            TokenizedRequest("big-id", "x", [10**6], SamplingParams(), 0.0),
            TokenizedRequest("empty", "x", [], SamplingParams(), 0.0),
        ],
        cfg.executor_address: [StepPlan(0, 7, 9, 10**6, 3, 1, 1), StepPlan(10**9, 0, 1, 1, 0,
                                                                             0, 0)],
        cfg.sampled_address: [SampledTokens(0, 2, 10**6), SampledTokens(99, 0, 1)],
        cfg.control_address: [StageFailed("executor", 0, 1, "forged failure")],
        cfg.tokenizer_stage_address(0): [ReconcileAnswer(0, 0, ["x"])],
        **{cfg.detokenizer_address(r): [DetokBatch(
            [DetokRequestInfo("d", "x", 1, True, 0.0)],
            [TokenDelta("d", [-1], logprobs=[TokenLogprob(-1, 0.0, [-1], [0.0])])]),
            EngineDown(0, "forged: fail every request")]
           for r in range(cfg.num_detokenizers)},
    }
    for address, messages in hostile.items():
        send_raw(address, [encode(m) for m in messages])
    assert_still_serving(pipe)
    assert pipe.failure is None


def test_random_and_mutated_frames_on_every_socket(pipe: Pipeline) -> None:
    """10,000 frames of garbage, truncated and mutated messages, spread over every socket of
    the run (client-facing ones included)."""
    rng = random.Random(7)
    cfg = pipe.cfg
    samples = [encode(m) for m in (
        AddRequest("m", "x", "hi", None, None, SamplingParams(), 0.0), AbortRequest("m"),
        StepPlan(0, 0, 1, 1, 0, 0, 0), SampledTokens(0, 0, 1))]

    def frame() -> bytes:
        kind = rng.randrange(4)
        if kind == 0:
            return rng.randbytes(rng.randrange(0, 64))
        base = bytearray(rng.choice(samples))
        if kind == 1:
            return bytes(base[:rng.randrange(len(base))])
        if kind == 2:
            for _ in range(rng.randrange(1, 4)):
                base[rng.randrange(len(base))] = rng.randrange(256)
            return bytes(base)
        return msgpack.packb([rng.randrange(1, 14), *(rng.randrange(-5, 5) for _ in range(6))])

    sockets = list(stage_sockets(cfg).values())
    keyed = {cfg.tokenizer_address(0), cfg.abort_address}  # client-facing: past the key check
    key = cfg.keys.client_key.encode()
    for address in sockets:
        prefix = key if address in keyed else b""
        send_raw(address, [prefix + frame() for _ in range(10_000 // len(sockets))])
    assert_still_serving(pipe)


def test_client_addresses_are_told_apart_from_stage_sockets(tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    cfg = dataclasses.replace(live_config(tiny_model_dir), run_dir=str(tmp_path))
    client = f"ipc://{tmp_path}/client-0123abcd.sock"
    assert cfg.is_client_address(client)
    for address in stage_sockets(cfg).values():
        assert not cfg.is_client_address(address)
    assert not cfg.is_client_address(f"ipc://{tmp_path}/client-x/../executor.sock")
    assert not cfg.is_client_address("tcp://127.0.0.1:5555")  # without --listen
    listening = dataclasses.replace(cfg, remote=RemoteSettings(listen_host="127.0.0.1"))
    assert listening.is_client_address("tcp://127.0.0.1:5555")
    replies = ReplySockets(zmq.Context.instance(), is_client=cfg.is_client_address)
    assert not replies.send(cfg.executor_address, AbortRequest("x"))
    assert replies.num_refused == 1
    replies.close()


def test_the_scheduler_refuses_a_request_the_tokenizer_should_have_refused() -> None:
    from scheduler_driver import Driver, make_limits

    driver = Driver(make_limits())  # vocabulary of 1000, context of 64
    bad = {"ids": TokenizedRequest("ids", "c", [5, 10**6], SamplingParams(), 0.0),
           "empty": TokenizedRequest("empty", "c", [], SamplingParams(), 0.0),
           "long": TokenizedRequest("long", "c", [5] * 64, SamplingParams(), 0.0),
           "params": TokenizedRequest("params", "c", [5], SamplingParams(top_p=0.0), 0.0)}
    for req in bad.values():
        driver.add(req)
    rejected = {r.request_id: r for r in driver.core.take_outputs().rejected}
    assert set(rejected) == set(bad) and not driver.core.requests
    assert all(r.finish_reason == "error" and r.error_kind == "invalid_request"
               for r in rejected.values())
    assert "outside the vocabulary" in (rejected["ids"].error or "")
    assert "top_p" in (rejected["params"].error or "")


def test_a_delta_the_detokenizer_cannot_decode_ends_only_its_sample(
        tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    from ipc.messages import StopSample
    from stages.detokenizer import Detokenizer

    detok = Detokenizer(Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")))
    client = "ipc:///tmp/client-a.sock"
    infos = [DetokRequestInfo(rid, client, 1, True, 0.0, logprobs=1) for rid in ("bad", "ok")]
    out = detok.feed(DetokBatch(infos, [
        TokenDelta("bad", [5], logprobs=[TokenLogprob(5, -0.1, [-1], [-0.1])]),
        TokenDelta("ok", [5], logprobs=[TokenLogprob(5, -0.1, [6], [-0.2])])]))[client]
    by_id = {o.request_id: o for o in out}
    assert by_id["bad"].finished and by_id["bad"].finish_reason == "error"
    assert by_id["bad"].error_kind == "internal" and "detokenizer error" in (
        by_id["bad"].error or "")
    assert not by_id["ok"].finished and by_id["ok"].token_ids == [5]
    assert detok.stopped == [StopSample("bad", 0)]  # the scheduler frees it
    later = detok.feed(DetokBatch([], [TokenDelta("bad", [6]), TokenDelta("ok", [6], "length",
                                       logprobs=[TokenLogprob(6, -0.1, [5], [-0.2])])]))
    assert [o.request_id for o in later[client]] == ["ok"]  # nothing more for the bad one


def test_max_waiting_is_counted_where_requests_wait() -> None:
    """A burst between two status reports cannot overfill the queue: the scheduler refuses
    what would pass max_waiting, as unavailable (a 503 with Retry-After over HTTP)."""
    from scheduler_driver import make_limits

    from stages.scheduler.core import Scheduler

    limits = make_limits()
    core = Scheduler(limits.engine, limits.num_blocks, max_waiting=5)
    for i in range(8):
        core.add_request(TokenizedRequest(f"r{i}", "c", [5, 6], SamplingParams(n=2), 0.0))
    rejected = core.take_outputs().rejected
    assert len(core.waiting) + sum(map(len, core.book.held.values())) == 4  # 2 requests x n = 2
    assert [r.request_id for r in rejected] == [f"r{i}" for i in range(2, 8)]
    assert all(r.error_kind == "unavailable" and "overloaded" in (r.error or "")
               for r in rejected)
    core.schedule()  # admitted requests leave the queue: room again
    core.add_request(TokenizedRequest("later", "c", [5, 6], SamplingParams(), 0.0))
    assert "later" in core.requests
