"""Data-parallel engines (--data-parallel-size): two scheduler+executor pairs behind the same
tokenizers and detokenizers, live. Requests spread over both and are answered alike; an abort
reaches whichever holds the request; a shared prefix goes where its KV is; an engine killed
by pid takes only its own requests with it while the other serves on; every process ends.
Real processes, the tiny model's tokenizer, the timed device (outputs are deterministic)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from live import alive, live_config, running, shm_segments

from ipc.config import PipelineConfig
from ipc.messages import (
    DetokBatch,
    DetokRequestInfo,
    RequestOutput,
    SamplingParams,
    TokenDelta,
)
from pipeline.runtime.client import PipelineClient
from pipeline.runtime.launcher import Pipeline

pytestmark = pytest.mark.timeout(240)
LONG = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.0)


def dp_config(model_dir: Path, router: str = "prefix") -> PipelineConfig:
    cfg = live_config(model_dir, num_tokenizers=2, num_detokenizers=2, device="timed:10,0",
                      max_num_seqs=32)
    return dataclasses.replace(cfg, data_parallel_size=2, router=router)


def _dp_pipeline(model_dir: Path) -> Iterator[Pipeline]:
    with running(dp_config(model_dir)) as p:
        yield p
    assert shm_segments(p.cfg.run_id) == []
    assert alive(list(p.stage_pids.values())) == []


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path) -> Iterator[Pipeline]:
    """One pipeline for the tests that kill nothing (each counts from what it finds)."""
    yield from _dp_pipeline(tiny_model_dir)


@pytest.fixture()
def pipe(tiny_model_dir: Path) -> Iterator[Pipeline]:
    """A pipeline of the test's own, for one that kills an engine."""
    yield from _dp_pipeline(tiny_model_dir)


def engine_stats(pipe: Pipeline, engine: int, settle: float = 0.6) -> tuple[int, int]:
    """(generation tokens, prefix-cache hits) engine `engine` reported, once settled."""
    time.sleep(settle)  # stats arrive a few times a second
    stats = pipe.engines.stats[engine]
    assert stats is not None
    return stats.generation_tokens, stats.prefix_cache_hits


@pytest.mark.live
def test_requests_spread_over_both_engines_and_are_answered_alike(pipeline: Pipeline) -> None:
    pipe = pipeline
    client = pipe.client()
    before = [engine_stats(pipe, e)[0] for e in (0, 1)]
    total_before = pipe.idle_stats().generation_tokens
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(16)]
    outs = client.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), timeout=60)
    assert [o.error for o in outs] == [None] * 16
    assert all(o.num_output_tokens == 20 for o in outs)
    # The timed device's tokens depend on the sequence alone: the same on either engine.
    alone = client.generate([prompts[3]], SamplingParams(max_tokens=20, ignore_eos=True))
    assert alone[0].token_ids == outs[3].token_ids
    per_engine = [engine_stats(pipe, e)[0] - before[e] for e in (0, 1)]
    assert min(per_engine) >= 5 * 20 and sum(per_engine) == 17 * 20, per_engine
    total = pipe.idle_stats()
    assert total.generation_tokens == total_before + 17 * 20
    assert total.num_blocks == 2 * pipe.engines.stats[0].num_blocks  # type: ignore[union-attr]
    assert client.health().ok and client.health().engines_down == []


@pytest.mark.live
def test_an_abort_reaches_the_engine_that_holds_the_request(pipeline: Pipeline) -> None:
    pipe = pipeline
    client = pipe.client()

    async def scenario() -> list[list[RequestOutput]]:
        async def one(i: int) -> list[RequestOutput]:
            return [o async for o in client.stream(f"abort me {i}", LONG, request_id=f"ab{i}")]

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        while not all(s is not None and s.num_running > 0 for s in pipe.engines.stats):
            await asyncio.sleep(0.02)
        for i in range(8):
            client.abort(f"ab{i}")
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))

    results = asyncio.run(scenario())
    assert [r[-1].finish_reason for r in results] == ["abort"] * 8
    assert all(r[-1].num_output_tokens < 300 for r in results)
    stats = pipe.idle_stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.live
def test_requests_sharing_a_prefix_go_where_its_kv_is(pipeline: Pipeline) -> None:
    client = pipeline.client()
    shared = list(range(10, 10 + 64))  # four full blocks
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    first = client.generate([shared + [1]], params)[0]
    assert first.num_cached_tokens == 0
    later = client.generate([shared + [2 + i, 3] for i in range(6)], params)
    assert [o.num_cached_tokens for o in later] == [64] * 6


@pytest.mark.live
def test_a_killed_engine_takes_only_its_requests(pipe: Pipeline) -> None:
    client = pipe.client()

    async def scenario() -> list[list[RequestOutput]]:
        async def one(i: int) -> list[RequestOutput]:
            return [o async for o in client.stream(f"stream {i}", LONG)]

        tasks = [asyncio.create_task(one(i)) for i in range(16)]
        while not all(s is not None and s.num_running >= 4 for s in pipe.engines.stats):
            await asyncio.sleep(0.02)
        os.kill(old["scheduler:1"], signal.SIGKILL)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 120))

    old = dict(pipe.stage_pids)

    results = asyncio.run(scenario())
    finals = [r[-1] for r in results]
    assert all(sum(o.finished for o in r) >= 1 and r[-1].finished for r in results)
    failed = [o for o in finals if o.error is not None]
    done = [o for o in finals if o.error is None]
    assert failed and done, [o.error for o in finals]
    assert all("engine 1 stopped" in (o.error or "") for o in failed), {o.error for o in failed}
    assert all(o.error_kind == "unavailable" for o in failed)
    assert all(o.num_output_tokens == 300 for o in done)
    assert pipe.is_alive and pipe.failure is None
    deadline = time.monotonic() + 30
    while alive([old["executor:1"]]):  # its executor is stopped with it
        assert time.monotonic() < deadline, "executor:1 still runs"
        time.sleep(0.05)
    while (health := client.health()).engines_down:  # then engine 1 is started again
        assert health.ok, health  # (engine 0 serves meanwhile)
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert pipe.status().restarts == {"engine:1": 1}
    assert pipe.stage_pids["scheduler:1"] != old["scheduler:1"]
    after = client.generate([f"after {i}" for i in range(8)],
                            SamplingParams(max_tokens=3, ignore_eos=True), timeout=60)
    assert [o.error for o in after] == [None] * 8
    stats = pipe.idle_stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.live
def test_both_engines_killed_at_once_come_back(tiny_model_dir: Path) -> None:
    """With no engine serving for a while the pipeline lives: both are started again."""
    with running(dp_config(tiny_model_dir, router="load")) as pipe:
        client = PipelineClient.connect(pipe.cfg.run_dir)
        for name in ("executor:0", "executor:1"):
            os.kill(pipe.stage_pids[name], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while len(client.wait_for_status().engines_down) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not client.health().ok and "down" in (client.health().problem or "")
        while not (health := client.health()).ok or health.engines_down:
            assert pipe.is_alive, pipe.failure
            assert time.monotonic() < deadline + 30, health
            time.sleep(0.05)
        after = client.generate([f"after {i}" for i in range(4)],
                                SamplingParams(max_tokens=3, ignore_eos=True), timeout=60)
        assert [o.error for o in after] == [None] * 4
        assert pipe.status().restarts == {"engine:0": 1, "engine:1": 1}
        client.close()


def test_a_detokenizer_fails_the_requests_of_a_dead_engine_only() -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from stages.detokenizer import Detokenizer

    detok = Detokenizer(Tokenizer(WordLevel({"a": 0, "b": 1}, unk_token="a")))

    def info(rid: str) -> DetokRequestInfo:
        return DetokRequestInfo(rid, f"client-{rid}", 3, True, 0.0)

    detok.feed(DetokBatch([info("x")], [TokenDelta("x", [0])], [], engine=1))
    detok.feed(DetokBatch([info("y")], [TokenDelta("y", [1])], [], engine=0))
    assert detok.engine_of("x") == 1 and detok.engine_of("y") == 0
    failed = detok.fail_engine(1, "engine 1 stopped")
    assert list(failed) == ["client-x"]
    (out,) = failed["client-x"]
    assert out.finished and out.error == "engine 1 stopped" and out.error_kind == "unavailable"
    late = detok.feed(DetokBatch([info("z")], [TokenDelta("z", [0])], [], engine=1))
    assert [(o.request_id, o.finished, o.error_kind) for o in late["client-z"]] == [
        ("z", True, "unavailable")]
    assert list(detok.requests) == ["y"]
    # engine 1 started again: its batches (the next incarnation's) are streamed
    again = detok.feed(DetokBatch([info("w")], [TokenDelta("w", [0])], [], engine=1,
                                  incarnation=1))
    assert [(o.request_id, o.finished, o.error) for o in again["client-w"]] == [
        ("w", False, None)]
