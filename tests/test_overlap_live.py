"""Asynchronous batching through the live pipeline: a long mixed run with aborts leaks no KV
block, executor slot or ring slot. (Overlapped equals synchronous is checked in process, with
staggered arrivals, in test_executor_model.py, and live once by the overlap benchmark in
test_bench.py.)"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import psutil
import pytest
from live import live_config, running

from ipc.messages import SamplingParams
from pipeline.runtime.client import PipelineClient
from stages.detokenizer import DETOKENIZER_NICE

pytestmark = [pytest.mark.live, pytest.mark.timeout(240)]


@pytest.mark.parametrize(("depth", "ring_slots"), [(2, 3), ("auto", 4)])
def test_long_mixed_run_with_aborts_leaks_nothing(tiny_model_dir: Path, depth: int | str,
                                                  ring_slots: int) -> None:
    """(auto: three steps in flight behind the instrument's sub-millisecond steps.)"""
    cfg = live_config(tiny_model_dir, depth=depth, max_num_seqs=8, max_num_batched_tokens=64,
                      kv_cache_memory=16 << 20, device="timed:0.2,0.01")
    with running(cfg) as pipe:
        reasons = asyncio.run(_mixed_with_aborts(pipe.client(), num_requests=200))
        assert reasons["abort"] > 20 and reasons["length"] > 20
        stats = pipe.idle_stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_free_slots == stats.num_slots == 8
    assert stats.num_free_ring_slots == stats.num_ring_slots == ring_slots
    assert stats.num_inflight_steps == stats.num_requests == 0
    assert stats.run_ahead_depth == (3 if depth == "auto" else 2)


@pytest.mark.parametrize(("device", "deep"), [("timed:1,0", 3), ("timed:20,0", 2), ("cpu", 2)])
def test_auto_depth_runs_three_deep_only_behind_a_separate_devices_short_steps(
        tiny_model_dir: Path, device: str, deep: int) -> None:
    """Under 10 ms a step the instrument (a separate device) gets a third step in flight; its
    20 ms steps and the CPU device (whose forward shares the cores with the host; the tiny
    model's steps are short too) keep 2. Same tokens either way (the instrument's are a function
    of the context)."""
    cfg = live_config(tiny_model_dir, depth="auto", max_num_seqs=8, device=device)
    prompts = [[5 + i, 6, 7] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with running(cfg) as pipe:
        outs = pipe.client().generate(prompts, params)  # type: ignore[arg-type]
        stats = pipe.idle_stats()
        # (off the chain, the detokenizer yields the cores to the stages on it)
        pids = pipe.stage_pids
        assert psutil.Process(pids["detokenizer:0"]).nice() == (
            psutil.Process().nice() + DETOKENIZER_NICE)
        assert psutil.Process(pids["scheduler:0"]).nice() == psutil.Process().nice()
    assert stats.run_ahead_depth == deep and stats.num_ring_slots == 4
    assert all(o.num_output_tokens == 24 and o.error is None for o in outs)


async def _mixed_with_aborts(client: PipelineClient, num_requests: int) -> dict[str, int]:
    rng = random.Random(3)
    reasons: dict[str, int] = {}
    sem = asyncio.Semaphore(24)

    async def one(i: int) -> None:
        async with sem:
            prompt = [rng.randrange(5, 400) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(max_tokens=rng.randint(1, 60), temperature=1.0,
                                    ignore_eos=True)
            abort_after = rng.choice([None, 0, 1, 3, 10])
            rid = f"r{i}"
            seen = 0
            if abort_after == 0:
                client.abort(rid)  # may arrive before the request itself
            async for out in client.stream(prompt, params, request_id=rid):
                seen += len(out.token_ids)
                if abort_after and seen >= abort_after:
                    client.abort(rid)
                if out.finished:
                    reasons[out.finish_reason or ""] = reasons.get(out.finish_reason or "", 0) + 1

    await asyncio.gather(*(one(i) for i in range(num_requests)))
    return reasons
