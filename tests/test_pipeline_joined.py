"""Pipeline stages on another host (`--joined-pipeline-stages N`, `run_pipeline stage
pipeline`): the ranks that run on each side, a step's ring slot carried whole to a rank that
maps no ring, who may join, and, live on this host over tcp://, the joined stages' greedy
tokens against one rank's through a kill of a joined rank and a host that leaves and is
replaced. (Across two network namespaces, with the wire captured: tests/test_remote_stages.py.)
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from live import alive_after, one_rank, ranks_config, running, shm_segments
from test_remote_stages import KEY, PROMPT, ROOT, _end, _roster, _stage, capture

from ipc.addresses import RemoteSettings
from ipc.config import PipelineConfig, RunKeys
from ipc.errors import ConfigError
from ipc.keys import derive_run_secret
from ipc.messages import SampledTokens, SamplingParams
from ipc.ranks import RankLayout
from ipc.step import StepRow as Row
from ipc.step import (
    local_buffers,
    put_columns,
    sampled_columns,
    sampled_specs,
    step_columns,
    step_input_specs,
    write_step,
)
from pipeline.runtime.roster import JoinError, proof

PROMPTS = [[5, 9, 13, 7, 3, 8, 22, 4, 1, 6, 11, 2, 14, 10, 12, 30, 31, 18], [4, 4, 4],
           [7, 8, 9, 10, 11], [60, 61]]


def test_the_launcher_starts_the_first_stages_and_the_joined_host_the_rest() -> None:
    layout = RankLayout(2, tensor_parallel_size=2, pipeline_parallel_size=3, joined_stages=1)
    assert list(layout.local_ranks(1)) == [6, 7, 8, 9] and list(layout.joined_ranks(1)) == [10, 11]
    assert [layout.joined(r) for r in layout.engine_ranks(0)] == [False] * 4 + [True] * 2
    assert layout.reporter(0) in layout.joined_ranks(0)  # the last stage samples, over there
    assert list(RankLayout(1, 1, 2).local_ranks(0)) == [0, 1]  # (none joined: all here)
    with pytest.raises(ValueError, match="first stage runs on the launcher's host"):
        RankLayout(1, 1, 2, joined_stages=2)


def test_joined_stages_need_a_listening_pipeline_and_a_model(tiny_model_dir: Path) -> None:
    cfg = ranks_config(tiny_model_dir, pipeline_parallel_size=2)
    joined = dataclasses.replace(cfg.executor, joined_pipeline_stages=1)
    with pytest.raises(ConfigError, match="needs --listen HOST and --stage-key KEY"):
        dataclasses.replace(cfg, executor=joined)
    with pytest.raises(ConfigError, match="below --pipeline-parallel-size 2"):
        dataclasses.replace(cfg.executor, joined_pipeline_stages=2)
    with pytest.raises(ConfigError, match="give this host's address there, not 0.0.0.0"):
        _joined_config(tiny_model_dir, "0.0.0.0")
    from stages.executor.preflight import check_executor

    with pytest.raises(ConfigError, match=r"no network interface of this host has the address "
                                          r"192\.0\.2\.7"):  # (TEST-NET-1: nobody's)
        check_executor(_joined_config(tiny_model_dir, "192.0.2.7"))
    check_executor(_joined_config(tiny_model_dir))  # (127.0.0.1: lo's)


def test_a_slot_carried_to_another_host_reads_as_the_slot_it_came_from() -> None:
    """A step's entries (step_columns) written into a slot that held something else read
    back as the step; samples alike (sampled_columns), logprobs and prompt logprobs too."""
    from ipc.config import EngineLimits
    from ipc.step import read_prompt_logprobs, read_sampled, read_step

    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=32, block_size=4,
                          max_model_len=64, vocab_size=100, eos_token_ids=(2,), depth=2)
    src, dst = local_buffers(step_input_specs(limits)), local_buffers(step_input_specs(limits))
    sampled, got = local_buffers(sampled_specs(limits)), local_buffers(sampled_specs(limits))
    for view in [*dst.values(), *got.values()]:  # (what the receiver's slot held: none shows)
        view.reshape(-1).view(np.uint8)[:] = 0xAB
    plan = write_step(src, 7, 1, [Row(3, [-1], 9, True), Row(5, [4, 8, 15], 3, False)],
                      block_updates=[(5, 0, 11)], stop_ids=[(3, 2)], prompt_logprobs=[(1, 8)])
    put_columns(dst, step_columns(src, plan))
    assert _same(read_step(dst, plan), read_step(src, plan))
    sampled["token_ids"][:2] = [17, 19]
    sampled["logprob"][:2] = [-0.5, -1.5]
    sampled["top_ids"][:2] = np.arange(2 * sampled["top_ids"].shape[1]).reshape(2, -1)
    sampled["plp_logprob"][:1], sampled["plp_rank"][:1] = [-2.0], [3]
    tokens = SampledTokens(7, 0, 2, num_top_logprobs=2, num_prompt_logprobs=1)
    put_columns(got, sampled_columns(sampled, tokens, num_rows=2))
    assert read_sampled(got, 2, 2) == read_sampled(sampled, 2, 2)
    assert read_prompt_logprobs(got, 1) == read_prompt_logprobs(sampled, 1)
    with pytest.raises(ValueError, match="for ring field 'stamp'"):
        put_columns(dst, {"stamp": bytes(64)})


def _same(a: object, b: object) -> bool:
    return all(np.array_equal(getattr(a, f.name), getattr(b, f.name))
               for f in dataclasses.fields(a))  # type: ignore[arg-type]


def _pipeline_join(roster, host_for: int | None):  # type: ignore[no-untyped-def]
    challenge = roster.challenge(0.0)
    request = {"kind": "pipeline", "host": "10.0.0.2", "challenge": challenge, "nonce": "n",
               "fingerprint": "fp", "proof": proof(KEY, "join", "pipeline", "10.0.0.2",
                                                   challenge)}
    return roster.join(request, KEY, "fp", 0.0, {}, host_for)


def test_a_pipeline_host_joins_only_where_an_engine_waits_for_one(tmp_path: Path,
                                                                   tiny_model_dir: Path) -> None:
    roster = _roster(tmp_path, tiny_model_dir)
    with pytest.raises(JoinError, match="not started with --joined-pipeline-stages"):
        _pipeline_join(roster, None)
    import json

    answer = json.loads(str(_pipeline_join(roster, 3)["answer"]))
    assert (answer["index"], answer["engine"]) == (0, 3)  # (its own; whose stages it runs)
    member = roster.members[("pipeline", 0)]
    assert member.name == "pipeline:0" and member.joined and not member.ready
    assert len(roster.view(True).engines) == 1  # (not an engine: nothing routes to it)
    roster.leave(member)  # (one that took its place later is another: its own name)
    answer = json.loads(str(_pipeline_join(roster, 3)["answer"]))
    assert (answer["index"], answer["engine"]) == (1, 3) and roster.left() == ["pipeline:0"]


def _joined_config(folder: Path, host: str = "127.0.0.1") -> PipelineConfig:
    cfg = ranks_config(folder, pipeline_parallel_size=2)
    return dataclasses.replace(
        cfg, executor=dataclasses.replace(cfg.executor, joined_pipeline_stages=1),
        remote=RemoteSettings(listen_host=host), keys=RunKeys(stage_key=KEY))


def _serving(pipe, client, incarnation: int, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while pipe.engines.incarnation[0] != incarnation or pipe.engines.restarting \
            or not client.health().ok:
        assert pipe.is_alive and time.monotonic() < deadline, (pipe.failure,
                                                               pipe.engines.down_why)
        time.sleep(0.05)


def _joined_ranks(host: psutil.Process) -> dict[str, int]:
    """The joined host's executor ranks: their names in `ps` -> pids."""
    return {" ".join(p.cmdline()).strip(): p.pid for p in host.children()
            if "llm-pipeline:executor" in " ".join(p.cmdline())}


@pytest.mark.live
def test_joined_stages_give_one_ranks_tokens_through_a_killed_rank_and_a_new_host(
        tiny_model_dir: Path) -> None:
    """The engine waits, down, until a pipeline host joins; then its tokens are one rank's.
    kill -9 of the joined rank starts the engine again, both sides (the host follows the new
    rendezvous); a host that leaves takes the engine down until another joins, whose tokens
    are one rank's again. Nothing of the joined hosts outlives them."""
    reference = one_rank(tiny_model_dir, PROMPTS)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    hosts = []
    with running(_joined_config(tiny_model_dir)) as pipe:
        assert pipe.address is not None
        client = pipe.client()
        assert not client.health().ok and "waiting for the host of its pipeline stages" \
            in pipe.status().engines_down_why["0"]
        try:
            hosts.append(_stage("pipeline", pipe.address, tiny_model_dir))
            _serving(pipe, client, 0)
            assert [o.token_ids for o in client.generate(PROMPTS, greedy)] == reference
            host = psutil.Process(hosts[0].pid)
            (name, pid), = _joined_ranks(host).items()
            assert name == "llm-pipeline:executor:1 e0.s1.t0"
            assert pipe.status().rendezvous == {"pipeline:0": pipe.engines.rendezvous[0]}
            first = pipe.engines.rendezvous[0]

            psutil.Process(pid).send_signal(signal.SIGKILL)
            _serving(pipe, client, 1)
            assert pipe.engines.rendezvous[0] != first  # (a new store, a new port)
            assert [o.token_ids for o in client.generate(PROMPTS, greedy)] == reference
            assert list(_joined_ranks(host).values()) != [pid]

            old = [p.pid for p in host.children(recursive=True)] + [host.pid]
            hosts[0].send_signal(signal.SIGTERM)
            assert hosts[0].wait(30) == 0  # (stopped as a user stops it)
            deadline = time.monotonic() + 30
            while "the host of its pipeline stages (pipeline:0) left" not in \
                    pipe.status().engines_down_why.get("0", ""):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert alive_after(old) == []
            refused = client.generate([[4, 4, 4]], greedy)[0]
            assert refused.token_ids == [] and "waiting for another to join" in str(
                refused.error)  # (why the engine is down, in the error: the status's)

            hosts.append(_stage("pipeline", pipe.address, tiny_model_dir))
            _serving(pipe, client, 2)
            status = pipe.status()  # (the new host is another, by name)
            assert list(status.rendezvous) == ["pipeline:1"] and "pipeline:0" in status.left
            assert [o.token_ids for o in client.generate(PROMPTS, greedy)] == reference
            run_id = pipe.cfg.run_id
        finally:
            _end(hosts)
    assert shm_segments(run_id) == []


@pytest.mark.live
def test_two_pipeline_stages_across_network_namespaces_keep_the_plans_off_the_wire(
        namespaces: tuple[str, str, str], tiny_model_dir: Path, tmp_path: Path) -> None:
    """The second stage joins from namespace B over a veth pair: one rank's greedy tokens,
    the ranks named in the status, an abort from a remote client that connected before the
    engine started reaches it, and with every frame captured on both sides neither the
    prompt's text nor the id prompts' token ids (the plans: under CURVE) nor any key crosses
    the wire in the clear. (The hidden states, the sampled ids going back to the first
    stage and the TCP store are gloo's, clear: docs/ARCHITECTURE.md.)"""
    ns_a, ns_b, address_a = namespaces
    reference = one_rank(tiny_model_dir, PROMPTS, max_tokens=6)
    sniffers = [capture(ns, tmp_path / f"{ns}.raw") for ns in (ns_a, ns_b)]
    driver = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, sys.executable, str(ROOT / "tests" / "remote_driver.py"),
         str(tiny_model_dir), address_a, KEY, "pipeline", json.dumps(PROMPTS), PROMPT],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    host = None
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        assert line.startswith("address tcp://10.213.7.1:"), line + driver.stderr.read()
        host = _stage("pipeline", line.split()[1], tiny_model_dir, netns=ns_b)
        out, err = driver.communicate(timeout=240)
        assert driver.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        host_out, host_err = host.communicate(timeout=60)
    finally:
        _end([driver, *([host] if host else [])])
        for sniffer in sniffers:
            sniffer.terminate()
            sniffer.wait(timeout=10)
    assert result["errors"] == [] and result["tokens"][:len(PROMPTS)] == reference
    assert len(result["tokens"][-1]) == 6  # (the text's)
    assert result["abort"] == "abort"  # (the remote client found the engine as it started)
    assert result["ranks"] == {"executor:0": "e0.s0.t0", "executor:1": "e0.s1.t0"}
    assert host.returncode == 0 and "listening on 10.213.7.2" in host_out, host_err
    assert shm_segments(result["run_id"]) == []
    wire = b"".join((tmp_path / f"{ns}.raw").read_bytes() for ns in (ns_a, ns_b))
    assert wire.count(b"CURVE") >= 4, len(wire)  # (it saw the links' greetings)
    secret = derive_run_secret(KEY, result["run_id"])
    for what, needle in (("the prompt", PROMPT.encode()), ("part of the prompt", b"lantern"),
                         ("the stage key", KEY.encode()), ("the run secret", secret),
                         ("the client key", result["client_key"].encode()),
                         *((f"prompt {i}'s ids", np.array(p, dtype=np.int64).tobytes())
                           for i, p in enumerate(PROMPTS) if len(p) >= 5)):
        assert needle not in wire, f"{what} crossed a wire in the clear"


def test_each_host_numbers_its_own_gpus_from_0() -> None:
    """Two engines of three stages of two tensor ranks, the last stage joined: the launcher's
    host has 8 ranks on cuda:0-7, each pipeline host its 2 on cuda:0-1."""
    layout = RankLayout(2, tensor_parallel_size=2, pipeline_parallel_size=3, joined_stages=1)
    assert layout.num_local_ranks == 8
    assert [layout.device_index(r) for r in range(12)] == [0, 1, 2, 3, 0, 1,
                                                            4, 5, 6, 7, 0, 1]
    unjoined = RankLayout(3, tensor_parallel_size=1)  # (as before: the global rank)
    assert [unjoined.device_index(r) for r in range(3)] == [0, 1, 2]
