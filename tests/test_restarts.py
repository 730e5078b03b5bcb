"""A dead tokenizer or detokenizer comes back (issue: nothing from outside can stop the
engine, a dead stage comes back): kill -9 of each under 32 streams; the launcher starts it
again within 2 s while the others keep serving; every request gets exactly one final output
or an error, never silence; a stage that keeps dying fails the pipeline. Real processes, the
tiny model's tokenizer, the timed device (so streams last long enough to be cut)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from live import alive, live_config, running, shm_segments

from ipc.messages import RequestOutput, SamplingParams
from pipeline.runtime.client import PipelineClient
from pipeline.runtime.launcher import Pipeline
from pipeline.runtime.restarts import MAX_RESTARTS

pytestmark = pytest.mark.timeout(240)
LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)


@pytest.fixture()
def pipe(tiny_model_dir: Path) -> Iterator[Pipeline]:
    cfg = live_config(tiny_model_dir, num_tokenizers=2, num_detokenizers=2,
                      device="timed:10,0", max_num_seqs=64)
    with running(cfg) as p:
        yield p
    assert shm_segments(p.cfg.run_id) == []


async def _stream(client: PipelineClient, prompt: str) -> list[RequestOutput]:
    return [out async for out in client.stream(prompt, LONG)]


def finals(outputs: list[RequestOutput]) -> list[RequestOutput]:
    return [o for o in outputs if o.finished]


def respawned(pipe: Pipeline, name: str, old_pid: int, within: float) -> float:
    """Seconds until `name` runs under a new pid (asserts it happens within `within`)."""
    start = time.monotonic()
    while pipe.stage_pids[name] == old_pid:
        assert time.monotonic() - start < within, f"{name} was not started again"
        time.sleep(0.01)
    return time.monotonic() - start


def kill_under_streams(pipe: Pipeline, name: str) -> list[list[RequestOutput]]:
    """32 streams; once each has output, kill -9 `name`; 32 more are sent right after.
    Returns every stream's outputs, after checking the stage came back within 2 s."""
    client = pipe.client()

    async def scenario() -> list[list[RequestOutput]]:
        first = [asyncio.create_task(_stream(client, f"stream {i}")) for i in range(32)]
        while (client.status is None or client.status.scheduler is None
               or client.status.scheduler.num_running < 32):
            await asyncio.sleep(0.02)
        old = pipe.stage_pids[name]
        os.kill(old, signal.SIGKILL)
        late = [asyncio.create_task(_stream(client, f"late {i}")) for i in range(32)]
        await asyncio.get_running_loop().run_in_executor(None, respawned, pipe, name, old, 2.0)
        return list(await asyncio.wait_for(asyncio.gather(*first, *late), 120))

    results = asyncio.run(scenario())
    assert pipe.is_alive, pipe.failure
    assert pipe.status().restarts == {name: 1}
    for outputs in results:  # exactly one final output each, and it is the last
        assert len(finals(outputs)) == 1 and outputs[-1].finished, outputs[-3:]
    client.wait_for_status()
    deadline = time.monotonic() + 60  # the new worker is ready, health says so
    (after,) = client.generate(["after"], SamplingParams(max_tokens=3, ignore_eos=True),
                               timeout=60)
    assert after.error is None and after.num_output_tokens == 3
    while not client.health().ok:
        assert time.monotonic() < deadline, client.health().problem
        time.sleep(0.1)
    stats = pipe.idle_stats()
    assert stats.num_free_blocks == stats.num_blocks  # nothing left running for nobody
    return results


@pytest.mark.live
def test_a_killed_detokenizer_comes_back_and_only_its_requests_fail(pipe: Pipeline) -> None:
    results = kill_under_streams(pipe, "detokenizer:1")
    errors = [finals(r)[0].error for r in results if finals(r)[0].error is not None]
    assert errors, "the requests of the dead worker's shard should have failed"
    assert all("detokenizer:1 stopped" in e for e in errors), set(errors)
    done = [finals(r)[0] for r in results if finals(r)[0].error is None]
    assert done and all(o.num_output_tokens == 200 and o.finish_reason == "length"
                        for o in done)


@pytest.mark.live
def test_a_killed_tokenizer_comes_back_and_streams_go_on(pipe: Pipeline) -> None:
    results = kill_under_streams(pipe, "tokenizer:0")
    for r in results:
        final = finals(r)[0]
        if final.error is not None:  # it was in the dead worker
            assert "tokenizer:0 stopped" in final.error
        else:
            assert final.num_output_tokens == 200


@pytest.mark.live
def test_requests_a_killed_tokenizer_held_get_an_error(pipe: Pipeline) -> None:
    """Requests sent to a stopped tokenizer (SIGSTOP: they sit in its socket buffer) are lost
    when it is killed: its client learns of the restart and each of them gets an error,
    while those the other worker took are answered."""
    client = pipe.client()
    # One request through each worker first: the client's connections are up (a message to a
    # worker it has not connected to yet would wait in the client, for the new worker).
    assert [o.error for o in client.generate(["a", "b"], SamplingParams(max_tokens=1))] == [
        None, None]
    got: dict[str, list[RequestOutput]] = {}
    old = pipe.stage_pids["tokenizer:0"]
    os.kill(old, signal.SIGSTOP)
    while psutil.Process(old).status() != psutil.STATUS_STOPPED:  # the signal takes a moment
        time.sleep(0.01)
    try:  # round-robin from rank 0: the even ones go to the stopped worker
        ids = [client._submit(f"held {i}", SamplingParams(max_tokens=2, ignore_eos=True),
                              f"held-{i}",
                              lambda outs: [got.setdefault(o.request_id, []).append(o)
                                            for o in outs])
               for i in range(8)]
        time.sleep(0.3)
    finally:
        os.kill(old, signal.SIGKILL)
    respawned(pipe, "tokenizer:0", old, 2.0)
    deadline = time.monotonic() + 30
    while sum(any(o.finished for o in got.get(i, [])) for i in ids) < 8:
        assert time.monotonic() < deadline, {i: got.get(i) for i in ids}
        time.sleep(0.05)
    for i, rid in enumerate(ids):
        (final,) = [o for o in got[rid] if o.finished]
        if i % 2 == 0:
            assert final.error is not None and "tokenizer:0 stopped" in final.error, final
        else:
            assert final.error is None and final.num_output_tokens == 2


@pytest.mark.live
@pytest.mark.parametrize("name", ["scheduler:0", "executor:0"])
def test_a_killed_engine_stage_comes_back_and_fails_only_what_it_held(tiny_model_dir: Path,
                                                                      name: str) -> None:
    """The scheduler and the executor hold the engine's state: kill -9 of either under 32
    streams ends each of them with one final output, an `unavailable` error naming the death
    (none hangs, none raises: the pipeline lives), as does a request sent just after it; the
    engine is started again (new scheduler and executor, model loaded anew) and serves new
    requests within model-load time + 2 s; health says "restarting" meanwhile; the dead
    processes are gone and, once the run ends, nothing of it is left."""
    cfg = live_config(tiny_model_dir, device="timed:10,0", max_num_seqs=64)
    with running(cfg) as pipe:
        client = pipe.client()
        old = dict(pipe.stage_pids)

        streaming: set[int] = set()  # streams that have their first output
        longer = dataclasses.replace(LONG, max_tokens=480)  # (~5 s: none ends before the kill)

        async def one(i: int) -> list[RequestOutput]:
            outs = []
            async for out in client.stream(f"stream {i}", longer):
                streaming.add(i)
                outs.append(out)
            return outs

        async def scenario() -> tuple[list[list[RequestOutput]], list[str]]:
            tasks = [asyncio.create_task(one(i)) for i in range(32)]
            deadline = time.monotonic() + 60
            while len(streaming) < 32:  # every stream running
                assert time.monotonic() < deadline, f"{len(streaming)} of 32 streams started"
                await asyncio.sleep(0.02)
            os.kill(old[name], signal.SIGKILL)
            tasks.append(asyncio.create_task(one(32)))  # sent just after the death
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 30))

        killed = time.monotonic()
        results = asyncio.run(scenario())
        assert pipe.is_alive, pipe.failure
        for outputs in results:  # exactly one final output each, and it is the last
            assert len(finals(outputs)) == 1 and outputs[-1].finished, outputs[-3:]
        errors = [o[-1].error or "" for o in results[:32]]
        # (from the detokenizer, or from the tokenizer for a request sent there lately: both
        # name the death)
        assert all(f"engine 0 stopped ({name} died, exit code -9" in e for e in errors), errors
        while client.health().ok:  # the status says so (it may come after the errors)
            assert time.monotonic() - killed < 10
            time.sleep(0.01)
        seen = set()
        while not (health := client.health()).ok or health.stats is None:  # the engine is up
            seen.add(health.problem)
            assert time.monotonic() - killed < 60, health.problem
            time.sleep(0.02)
        back = time.monotonic() - killed
        assert any("restarting" in (problem or "") for problem in seen), seen
        (after,) = client.generate(["after"], SamplingParams(max_tokens=3, ignore_eos=True),
                                   timeout=30)
        assert after.error is None and after.num_output_tokens == 3
        assert pipe.status().restarts == {"engine:0": 1}
        new = pipe.stage_pids
        for stage in ("scheduler:0", "executor:0"):
            assert new[stage] != old[stage]
        assert alive([old["scheduler:0"], old["executor:0"]]) == []
        print(f"engine back in {back:.2f} s")
        assert back < 30, back  # (model-load time + 2 s; the figure is in the docs)
        pids = list(new.values())
    assert alive(pids) == []
    assert shm_segments(pipe.cfg.run_id) == []


# ---------------------------------------------------------------- the cores, directly


def test_an_engine_names_only_the_ids_it_holds() -> None:
    from scheduler_driver import Driver, make_limits, make_request

    driver = Driver(make_limits())
    driver.add(make_request("known", 4, max_tokens=3))
    assert driver.core.known_requests(["known", "lost-1", "lost-2"]) == ["known"]
    driver.run()
    assert len(driver.outputs["known"]) == 3  # untouched
    # Finished, but its final output may still be on its way: not lost.
    assert driver.core.known_requests(["known"]) == ["known"]


def test_failing_a_shard_ends_its_requests_with_no_delta_and_frees_them() -> None:
    """Live requests of the dead detokenizer's shard end with an error and no delta; one that
    ended just before (its final output may have died with the worker) gets the error too;
    requests of other shards are untouched."""
    from scheduler_driver import Driver, make_limits, make_request

    driver = Driver(make_limits())
    driver.add(make_request("done", 4, max_tokens=1))
    driver.run()
    for rid in ("a", "b"):
        driver.add(make_request(rid, 4, max_tokens=20))
    for _ in range(3):
        driver.tick()
    driver.core.fail_requests(lambda rid: rid in ("a", "done"), "detokenizer:1 stopped")
    _, deltas, rejected, _ = driver.core.take_outputs()
    assert [d.request_id for d in deltas if d.request_id == "a"] == []
    assert sorted((r.request_id, r.error) for r in rejected) == [
        ("a", "detokenizer:1 stopped"), ("done", "detokenizer:1 stopped")]
    driver.run()
    driver.check_idle()
    assert len(driver.outputs["b"]) == 20


def test_a_forgotten_client_loses_its_requests_and_later_ones_are_refused() -> None:
    from scheduler_driver import Driver, make_limits, make_request

    from ipc.messages import TokenizedRequest

    driver = Driver(make_limits())
    dead = make_request("x", 4, max_tokens=20)
    driver.add(dead)
    driver.add(make_request("other", 4, max_tokens=5, user="u"))
    driver.tick()
    driver.core.forget_client("client")
    driver.add(TokenizedRequest("late", "client", [5, 6], SamplingParams(max_tokens=2), 0.0))
    driver.run()
    driver.check_idle()
    assert driver.finished["x"].finish_reason == "abort"
    assert [r.finish_reason for r in driver.rejected if r.request_id == "late"] == ["abort"]


def test_the_tokenizer_forwards_only_a_clients_reconcile_for_its_own_rank() -> None:
    from ipc.messages import Reconcile
    from ipc.params import MAX_RECONCILE_IDS
    from stages.tokenizer import forward_reconcile

    sent: list[object] = []

    class Sink:
        def reconcile(self, msg: object) -> None:
            sent.append(msg)

    def is_client(address: str) -> bool:
        return address.startswith("ipc:///run/client-")

    good = Reconcile("ipc:///run/client-1.sock", 1, ["a"])
    for msg in (good, Reconcile("ipc:///run/executor.sock", 1, ["a"]),
                Reconcile("ipc:///run/client-1.sock", 0, ["a"]),
                Reconcile("ipc:///run/client-1.sock", 1, ["a"] * (MAX_RECONCILE_IDS + 1))):
        forward_reconcile(msg, 1, Sink(), is_client)  # type: ignore[arg-type]
    assert sent == [good]


def test_the_restart_policy_backs_off_then_gives_up() -> None:
    from pipeline.runtime.restarts import RestartPolicy

    policy = RestartPolicy()
    delays = [policy.delay("tokenizer:0") for _ in range(MAX_RESTARTS + 1)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, None][:MAX_RESTARTS] + [None]
    assert policy.delay("tokenizer:1") == 0.0  # each process on its own
    assert policy.counts == {"tokenizer:0": MAX_RESTARTS, "tokenizer:1": 1}
