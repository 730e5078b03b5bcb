"""Asynchronous batching through the live pipeline: overlapped (depth 2) and synchronous
(depth 1) runs give identical greedy outputs with requests arriving and finishing at different
steps; a long mixed run with aborts leaks no KV block, executor slot or ring slot."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from live import live_config, running
from tiny_model import hf_greedy

from ipc.messages import SamplingParams
from pipeline.runtime.client import PipelineClient

pytestmark = [pytest.mark.live, pytest.mark.timeout(240)]

TEXTS = ["The quick brown fox", "Paged attention", "Héllo wörld 🚀", "def main():",
         "Continuous batching lets new requests join. " * 3, "a", "日本語", "Grüße aus Köln."]


async def _staggered(client: PipelineClient, prompts: list[list[int]],
                     max_tokens: list[int]) -> list[list[int]]:
    """Each request arrives after its own delay, so they join and leave at different steps."""
    rng = random.Random(7)
    delays = [rng.uniform(0, 0.15) for _ in prompts]

    async def one(i: int) -> list[int]:
        await asyncio.sleep(delays[i])
        ids: list[int] = []
        params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0)
        async for out in client.stream(prompts[i], params):
            ids += out.token_ids
        return ids

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _run(model_dir: Path, depth: int, prompts: list[list[int]], max_tokens: list[int]
         ) -> list[list[int]]:
    cfg = live_config(model_dir, depth=depth, max_num_seqs=4, max_num_batched_tokens=16)
    with running(cfg) as pipe:
        return asyncio.run(_staggered(pipe.client(), prompts, max_tokens))


def test_overlapped_and_synchronous_outputs_are_identical(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS] * 2
    # 1 and 2 tokens: finished at the very step whose successor was already planned.
    max_tokens = [1, 2, 3, 17, 9, 1, 30, 5, 2, 8, 1, 13, 21, 3, 6, 2]
    sync = _run(tiny_model_dir, 1, prompts, max_tokens)
    overlapped = _run(tiny_model_dir, 2, prompts, max_tokens)
    assert overlapped == sync
    expected = hf_greedy(tiny_model_dir, prompts[:8], max(max_tokens))
    assert [e[:n] for e, n in zip(expected * 2, max_tokens, strict=True)] == sync


def test_long_mixed_run_with_aborts_leaks_nothing(tiny_model_dir: Path) -> None:
    cfg = live_config(tiny_model_dir, depth=2, max_num_seqs=8, max_num_batched_tokens=64,
                      kv_cache_memory=16 << 20, device="timed:0.2,0.01")
    with running(cfg) as pipe:
        reasons = asyncio.run(_mixed_with_aborts(pipe.client(), num_requests=200))
        assert reasons["abort"] > 20 and reasons["length"] > 20
        stats = pipe.idle_stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_free_slots == stats.num_slots == 8
    assert stats.num_free_ring_slots == stats.num_ring_slots == 3
    assert stats.num_inflight_steps == stats.num_requests == 0


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
