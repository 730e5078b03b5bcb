"""Stages on other hosts: an engine, a tokenizer and a detokenizer worker join a running
pipeline over tcp:// with the stage key (`run_pipeline stage KIND --connect ADDRESS`), serve
in it, and leave it; what they held ends with a clear error. Across two network namespaces
joined by a veth pair that the test creates (skipped where it may not), and on this host.
The join protocol and the roster, unit by unit."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import zmq
from live import alive_after, kill_pids, running, shm_segments

from ipc import curve
from ipc.addresses import RemoteSettings
from ipc.config import ExecutorConfig, PipelineConfig, RunKeys, SchedulerConfig
from ipc.keys import derive_run_secret
from ipc.messages import ErrorKind, RequestOutput, SamplingParams, TokenizedRequest
from ipc.model_info import ModelInfo, model_fingerprint
from pipeline.runtime.client import PipelineClient
from pipeline.runtime.roster import JoinError, Roster, proof
from stages.dispatch import Dispatcher
from stages.router import EngineRouter

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent
KEY = "stage-key-of-this-test"


# ---------------------------------------------------------------- the roster, unit by unit


def _roster(tmp_path: Path, tiny_model_dir: Path) -> Roster:
    cfg = PipelineConfig(model=ModelInfo.from_dir(tiny_model_dir), run_dir=str(tmp_path),
                         run_id="r1", remote=RemoteSettings(listen_host="127.0.0.1"),
                         keys=RunKeys(stage_key=KEY),
                         num_detokenizers=2)
    return Roster(cfg, "10.0.0.1")


def _join(roster: Roster, kind: str = "engine", key: str = KEY, fingerprint: str = "fp",
          challenge: str | None = None) -> dict[str, object]:
    challenge = challenge or roster.challenge(0.0)
    request = {"kind": kind, "host": "10.0.0.2", "challenge": challenge, "nonce": "n1",
               "fingerprint": fingerprint, "proof": proof(key, "join", kind, "10.0.0.2",
                                                          challenge)}
    return roster.join(request, KEY, "fp", 1.0, {"control": "tcp://c", "status": "tcp://s"})


def test_a_join_needs_the_key_a_fresh_challenge_and_the_same_model(tmp_path: Path,
                                                                    tiny_model_dir: Path) -> None:
    roster = _roster(tmp_path, tiny_model_dir)
    with pytest.raises(JoinError, match="wrong stage key"):
        _join(roster, key="another-key-entirely")
    with pytest.raises(JoinError, match="unknown or expired"):
        _join(roster, challenge="made-up")
    with pytest.raises(JoinError, match="model folder differs"):
        _join(roster, fingerprint="other")
    with pytest.raises(JoinError, match="cannot join as"):
        _join(roster, kind="executor")
    challenge = roster.challenge(0.0)
    reply = _join(roster, challenge=challenge)
    with pytest.raises(JoinError, match="unknown or expired"):  # a challenge is used once
        _join(roster, challenge=challenge)
    # The launcher proves it holds the key too, over the answer it sends.
    assert reply["proof"] == proof(KEY, "answer", "n1", str(reply["answer"]))
    answer = json.loads(str(reply["answer"]))
    assert answer["index"] == 1 and answer["run_id"] == "r1"
    # Of the keys only the client key is sent; nor is the launcher's own host.
    assert answer["config"]["keys"] == {"client_key": ""} and "remote" not in answer["config"]
    assert not any(KEY in str(v) for v in answer.values())
    old = roster.challenge(0.0)
    roster.challenge(100.0)  # handing out another one voids those past their time
    with pytest.raises(JoinError, match="unknown or expired"):
        _join(roster, challenge=old)


def test_each_stage_sees_the_others_where_it_can_reach_them(tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    roster = _roster(tmp_path, tiny_model_dir)
    for kind, port in (("engine", 7001), ("tokenizer", 7002), ("detokenizer", 7003),
                       ("detokenizer", 7004)):
        roster.local_ready(kind, 0 if kind != "detokenizer" else port - 7003, port)
    _join(roster, "detokenizer")
    pending = roster.view(False)
    assert pending.detokenizers[2] == "" and pending.epoch == 0  # not ready: not named
    assert roster.joined_ready("detokenizer", 2, {"stage_port": 7100}, 2.0)
    here, there = roster.view(False), roster.view(True)
    assert here.epoch == there.epoch == 1
    assert here.engines[0].startswith("ipc://") and there.engines == ["tcp://10.0.0.1:7001"]
    assert here.detokenizers[2] == there.detokenizers[2] == "tcp://10.0.0.2:7100"
    assert here.local_detokenizers == [True, True, False]
    assert [m.name for m in roster.silent(2.0 + 1.0)] == []
    (gone,) = roster.silent(2.0 + 60.0)  # silent past REMOTE_SILENCE_S: it left
    assert gone.name == "detokenizer:2" and roster.view(False).detokenizers[2] == ""
    assert roster.view(False).epoch == 2 and roster.left() == ["detokenizer:2"]
    _join(roster, "tokenizer")  # one whose report lacks its ports is not taken
    assert not roster.joined_ready("tokenizer", 1, {"tcp_port": 7200}, 3.0)
    assert roster.left() == ["detokenizer:2", "tokenizer:1"]
    _join(roster, "detokenizer")  # one that says it stops is gone at once, not when silent
    assert roster.joined_ready("detokenizer", 3, {"stage_port": 7101}, 4.0)
    roster.said_leaving("detokenizer", 3, "interrupted")
    (gone,) = roster.silent(4.1)
    assert gone.name == "detokenizer:3" and gone.leaving == "interrupted"


def test_a_worker_routes_to_an_engine_once_the_roster_names_it() -> None:
    sent: list[tuple[int, object]] = []
    replies: list[tuple[str, object]] = []
    dispatcher = Dispatcher(EngineRouter(1, 4, "load"), 0,
                            lambda e, m: sent.append((e, m)) or True,
                            lambda a, o: replies.append((a, o)))
    dispatcher.set_status([0, 0], [True, True])  # the status names engine 1 first
    assert dispatcher.serving == [True]
    dispatcher.set_engines([True, True])
    dispatcher.set_status([100, 0], [True, True])
    dispatcher.forward(TokenizedRequest("r", "ipc://c", [1, 2, 3], SamplingParams(), 0.0))
    assert sent[-1][0] == 1  # the less loaded one, which joined
    dispatcher.set_engines([True, False], {"1": "scheduler:1 died, exit code -9: x"})
    assert dispatcher.serving == [True, False]  # it left: what it was sent lately fails,
    ((_, outputs),) = replies  # naming the death (the roster may bring it before the status)
    assert outputs.outputs[0].error_kind == ErrorKind.UNAVAILABLE
    assert "engine 1 stopped (scheduler:1 died, exit code -9: x)" in (outputs.outputs[0].error
                                                                      or "")
    dispatcher.set_status([0, 0], [True, False])  # the launcher's word on it
    dispatcher.set_engines([True, True])  # the roster names it again: not yet alive
    assert dispatcher.serving == [True, False]
    dispatcher.set_status([0, 0], [True, True])  # started again: both say so
    assert dispatcher.serving == [True, True]
    assert len(replies) == 1


def test_the_run_secret_is_derived_not_sent() -> None:
    a, b = derive_run_secret(KEY, "run-a"), derive_run_secret(KEY, "run-b")
    assert len(a) == 16 and a != b and a == derive_run_secret(KEY, "run-a")
    assert derive_run_secret("another-key-entirely", "run-a") != a


# ---------------------------------------------------------------- on this host


def _config(model_dir: Path, device: str = "timed:3,0") -> PipelineConfig:
    return PipelineConfig(model=ModelInfo.from_dir(model_dir),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                          executor=ExecutorConfig.for_device(device, kv_cache_memory=32 << 20),
                          remote=RemoteSettings(listen_host="127.0.0.1"),
                          keys=RunKeys(stage_key=KEY), ready_timeout_s=120)


def _stage(kind: str, address: str, model_dir: Path, key: str = KEY,
            netns: str | None = None) -> subprocess.Popen[str]:
    """`run_pipeline stage KIND` in its own session (so that the test can end it and its
    children by process group), its run directory under a folder of its own (so that what a
    SIGKILL leaves, as a lost host would, is removed by `_end`)."""
    cmd = [sys.executable, "-m", "pipeline.cli", "stage", kind, "--connect", address,
           "--model", str(model_dir)]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    base = tempfile.mkdtemp(prefix="remote-stage-")
    proc = subprocess.Popen(cmd, cwd=ROOT, text=True, start_new_session=True,
                            env=dict(os.environ, LLM_PIPELINE_STAGE_KEY=key,
                                     XDG_RUNTIME_DIR=base),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.run_base = base  # type: ignore[attr-defined]
    return proc


def _end(procs: list[subprocess.Popen[str]]) -> None:
    """Stop each stage as a user would (SIGTERM), SIGKILL its group past 15 s."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if base := getattr(proc, "run_base", None):
            shutil.rmtree(base, ignore_errors=True)


def _wait_joined(pipe, name: str, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(m.name == name and m.ready for m in pipe.roster.members.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} did not join within {timeout} s")


@pytest.mark.live
def test_a_stage_without_the_key_or_with_another_model_is_refused(tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3  # the same shapes, another model
    (other / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(other) != model_fingerprint(tiny_model_dir)
    with running(_config(tiny_model_dir)) as pipe:
        assert pipe.address is not None
        wrong = _stage("engine", pipe.address, tiny_model_dir, key="not-the-stage-key-at-all")
        differs = _stage("tokenizer", pipe.address, other)
        try:
            (_, wrong_err), (_, differs_err) = wrong.communicate(60), differs.communicate(60)
        finally:
            _end([wrong, differs])
        assert wrong.returncode == 1 and "wrong stage key" in wrong_err
        assert differs.returncode == 1 and "model folder differs" in differs_err
        assert not any(m.joined for m in pipe.roster.members.values())
        # Whatever anyone sends the bootstrap socket (under CURVE: in the clear it answers
        # nothing), it answers and the launcher supervises on.
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        curve.connect_bootstrap(sock, pipe.address)
        try:
            for frames in ([b"join", b"[" * 200_000], [b"hello"],
                           [b"join", json.dumps({"kind": "engine", "host": "h", "nonce": "n",
                                                 "challenge": "c", "fingerprint": "f",
                                                 "proof": "\u00e9"}).encode()],
                           [b"join", b"[1, 2]"], [b"join", b'{"kind": 3}']):
                sock.send_multipart(frames)
                assert sock.poll(10_000), frames[:1]
                sock.recv()
        finally:
            sock.close()
        assert pipe.is_alive and pipe._supervisor is not None and pipe._supervisor.is_alive()
    cfg = _config(tiny_model_dir)
    with running(dataclasses.replace(cfg, keys=RunKeys())) as pipe:  # no stage key
        assert pipe.address is not None
        refused = _stage("engine", pipe.address, tiny_model_dir)
        try:
            _, err = refused.communicate(60)
        finally:
            _end([refused])
        assert refused.returncode == 1 and "takes no stages from other hosts" in err


@pytest.mark.live
def test_an_engine_that_joined_serves_and_its_leaving_fails_only_its_requests(
        tiny_model_dir: Path) -> None:
    with running(_config(tiny_model_dir, "timed:50,0")) as pipe:  # 20 s a request
        assert pipe.address is not None
        stage = _stage("engine", pipe.address, tiny_model_dir)
        try:
            _wait_joined(pipe, "scheduler:1")
            client = pipe.client()
            long = SamplingParams(max_tokens=400, ignore_eos=True)
            outs: list[RequestOutput] = []  # every delta, as the client's I/O thread hands it
            rids = [client._submit([3 + i, 4, 5, 6], long, None, outs.extend) for i in range(6)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(pipe.engines.loads()):
                time.sleep(0.1)
            assert all(pipe.engines.loads()), pipe.engines.loads()  # both hold some
            os.killpg(stage.pid, signal.SIGKILL)  # the host of engine 1 is gone
            stage.wait(10)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(o.finished for o in outs):
                time.sleep(0.1)
            failed = [o for o in outs if o.finished]
            assert 0 < len(failed) < len(rids)  # engine 0's still run
            assert all(o.error_kind == ErrorKind.UNAVAILABLE for o in failed)
            assert all("engine 1 stopped" in str(o.error) for o in failed)
            status = pipe.status()
            assert "scheduler:1" not in status.stages and status.left == ["scheduler:1"]
            assert status.engines_alive == [True, False]
            (after,) = client.generate([[7, 8, 9]], SamplingParams(max_tokens=4), timeout=30)
            assert after.finish_reason == "length"  # engine 0 serves on
            for rid in rids:
                client.abort(rid)
        finally:
            _end([stage])


# ---------------------------------------------------------------- across network namespaces


@pytest.mark.live
def test_an_engine_a_tokenizer_and_a_detokenizer_join_from_another_network_namespace(
        namespaces: tuple[str, str, str], tiny_model_dir: Path, tmp_path: Path) -> None:
    """... with every frame on both namespaces' wires captured raw: none shows a prompt's
    text, the client key, the stage key or the run's secret (every tcp:// link is under
    CURVE), while the capture holds the links' ZeroMQ greetings (it saw them)."""
    ns_a, ns_b, address_a = namespaces
    sniffers = [capture(ns, tmp_path / f"{ns}.raw") for ns in (ns_a, ns_b)]
    driver = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, sys.executable, str(ROOT / "tests" / "remote_driver.py"),
         str(tiny_model_dir), address_a, KEY, "engine,tokenizer,detokenizer", "24", PROMPT],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    stages: list[subprocess.Popen[str]] = []
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        assert line.startswith("address tcp://10.213.7.1:"), line + driver.stderr.read()
        address = line.split()[1]
        stages = [_stage(kind, address, tiny_model_dir, netns=ns_b)
                  for kind in ("engine", "tokenizer", "detokenizer")]
        out, err = driver.communicate(timeout=240)
        assert driver.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        outcomes = [stage.communicate(timeout=60) for stage in stages]
    finally:
        _end([driver, *stages])
        for sniffer in sniffers:
            sniffer.terminate()
            sniffer.wait(timeout=10)
    assert result["finish"] == ["length"] and result["tokens"] == [6] * 24
    assert result["joined"] == ["detokenizer:1", "scheduler:1", "tokenizer:1"]
    assert all(result["stages"][name] for name in result["joined"])
    assert all(steps > 0 for steps in result["engine_steps"]), result  # both engines ran
    # The remote client was handed both tokenizers, the one in namespace B included.
    assert [a.startswith("tcp://10.213.7.") for a in result["client_tokenizers"]] == [True] * 2
    assert any("10.213.7.2" in a for a in result["client_tokenizers"])
    for stage, (stage_out, stage_err) in zip(stages, outcomes, strict=True):
        assert stage.returncode == 0, stage_err  # each left when the pipeline stopped
        assert "listening on 10.213.7.2" in stage_out
        assert "the pipeline stopped" in stage_err
    assert shm_segments(result["run_id"]) == []  # the joined engine's rings (-e1) too
    wire = b"".join((tmp_path / f"{ns}.raw").read_bytes() for ns in (ns_a, ns_b))
    assert wire.count(b"CURVE") >= 10, len(wire)  # the greetings of the links: it saw them
    secret = derive_run_secret(KEY, result["run_id"])
    for what, needle in (("the prompt", PROMPT.encode()), ("the stage key", KEY.encode()),
                         ("the client key", result["client_key"].encode()),
                         ("the run secret", secret), ("part of the prompt", b"lantern")):
        assert needle not in wire, f"{what} crossed a wire in the clear"


PROMPT = "the password is zebra lantern"  # what no wire may show


def capture(netns: str, out: Path) -> subprocess.Popen[str]:
    """A raw sniffer on every interface of `netns` (tests/capture.py), once it listens."""
    proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable,
                             str(ROOT / "tests" / "capture.py"), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line + (proc.stderr.read() if proc.stderr else "")
    return proc


@pytest.mark.live
def test_the_pids_of_a_joined_stage_end_with_it(tiny_model_dir: Path) -> None:
    """Stopping a joined stage (SIGTERM, as Ctrl-C or a service manager does) ends its
    processes and the pipeline learns it is gone, from the stage itself (StageLeaving)."""
    import psutil

    with running(_config(tiny_model_dir)) as pipe:
        assert pipe.address is not None
        stage = _stage("detokenizer", pipe.address, tiny_model_dir)
        children: list[int] = []
        try:
            _wait_joined(pipe, "detokenizer:1")
            children = [p.pid for p in psutil.Process(stage.pid).children(recursive=True)]
            assert children
            stage.send_signal(signal.SIGTERM)
            assert stage.wait(30) == 0
            assert alive_after(children) == []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and "detokenizer:1" in pipe.status().stages:
                time.sleep(0.2)
            assert pipe.status().left == ["detokenizer:1"]
            # (it said so as it stopped: gone at once, not after REMOTE_SILENCE_S)
            assert pipe.roster.members["detokenizer", 1].leaving == "interrupted"
            client = PipelineClient.connect(pipe.address, key=pipe.cfg.keys.client_key)
            assert client.wait_for_status().ok  # healthy without it
            (out,) = client.generate([[3, 4, 5]], SamplingParams(max_tokens=3), timeout=30)
            assert out.finish_reason == "length"  # detokenizer 0 streams everything now
            client.close()
        finally:
            _end([stage])
            kill_pids(children)


@pytest.mark.live
def test_a_connected_client_follows_stages_that_join_and_leave(tiny_model_dir: Path) -> None:
    """A remote client connected before a tokenizer and an engine join takes the tokenizer
    in turn and aborts on the engine too; when the tokenizer leaves, what it held ends
    with an error instead of waiting for ever."""
    with running(_config(tiny_model_dir, "timed:50,0")) as pipe:
        assert pipe.address is not None
        client = PipelineClient.connect(pipe.address, key=pipe.cfg.keys.client_key)
        stages = [_stage(kind, pipe.address, tiny_model_dir) for kind in ("tokenizer", "engine")]
        try:
            _wait_joined(pipe, "tokenizer:1")
            _wait_joined(pipe, "scheduler:1")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (len(client._turns) < 2
                                                   or len(client._aborts) < 2):
                time.sleep(0.1)
            assert client._turns == [0, 1] and all(client._aborts)
            outs = client.generate([[3 + i, 4, 5] for i in range(6)],
                                   SamplingParams(max_tokens=2), timeout=60)
            assert {o.finish_reason for o in outs} == {"length"}
            long: list[RequestOutput] = []
            for i in range(2):  # one to each tokenizer, in turn
                client._submit([9, 8, 7 + i], SamplingParams(max_tokens=400, ignore_eos=True),
                               None, long.extend)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len({o.request_id for o in long}) < 2:
                time.sleep(0.1)  # both run (each has streamed a token)
            stages[0].send_signal(signal.SIGTERM)  # the tokenizer's host stops it
            assert stages[0].wait(30) == 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(o.finished for o in long):
                time.sleep(0.1)
            (failed,) = [o for o in long if o.finished]
            assert failed.error_kind == ErrorKind.UNAVAILABLE
            assert "tokenizer:1 left" in str(failed.error)
            assert client._turns == [0]
            (after,) = client.generate([[5, 6]], SamplingParams(max_tokens=2), timeout=30)
            assert after.finish_reason == "length"
        finally:
            client.close()
            _end(stages)


@pytest.mark.live
def test_the_stage_command_says_what_it_lacks() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LLM_PIPELINE_STAGE_KEY"}
    cmd = [sys.executable, "-m", "pipeline.cli", "stage", "engine"]
    no_key = subprocess.run([*cmd, "--connect", "tcp://127.0.0.1:9"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert no_key.returncode == 2 and "--stage-key or $LLM_PIPELINE_STAGE_KEY" in no_key.stderr
    short = subprocess.run([*cmd, "--connect", "tcp://127.0.0.1:9", "--stage-key", "short"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and "at least 16 characters" in short.stderr
    not_tcp = subprocess.run([*cmd, "--connect", "/tmp/run", "--stage-key", KEY], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=60)
    assert not_tcp.returncode == 2 and "tcp://HOST:PORT" in not_tcp.stderr


@pytest.mark.live
def test_an_engine_that_joined_runs_the_model_as_the_first_one_does(tiny_model_dir: Path
                                                                     ) -> None:
    """With the model on the CPU (not the timed device): a joined engine loads its copy of
    the model and its greedy tokens are the first engine's."""
    with running(_config(tiny_model_dir, "cpu")) as pipe:
        assert pipe.address is not None
        stage = _stage("engine", pipe.address, tiny_model_dir)
        try:
            _wait_joined(pipe, "scheduler:1")
            client = pipe.client()
            greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            outs = client.generate([[5, 9, 13, 7]] * 8, greedy, timeout=60)
            time.sleep(0.5)  # the engines' last stats
            assert all(s is not None and s.num_steps > 0 for s in pipe.engines.stats)
            assert len({tuple(o.token_ids) for o in outs}) == 1 and len(outs[0].token_ids) == 12
        finally:
            _end([stage])
