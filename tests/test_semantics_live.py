"""Request semantics through the live four-process pipeline, with and without overlap: seeded
requests reproduce whatever shares their batches, a stop string frees its sequence within a
step or two, n > 1 and logprobs reach the client, prefix-cache hits show in the stats, and the
run ends with every block free."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from live import live_config, running

from ipc.messages import SamplingParams
from pipeline.runtime.client import CompletionOutput, PipelineClient
from stages.executor.linear.quantized import kernel_missing

pytestmark = [pytest.mark.live, pytest.mark.timeout(240)]
needs_quantized = pytest.mark.skipif(kernel_missing() is not None,
                                     reason=f"quantized kernels: {kernel_missing()}")

SEEDED = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, top_p=tp, top_k=tk,
                         min_p=mp, repetition_penalty=rp, ignore_eos=True)
          for s, tp, tk, mp, rp in [(1, 1.0, 0, 0.0, 1.0), (2, 0.9, 0, 0.0, 1.0),
                                    (3, 1.0, 20, 0.0, 1.3), (4, 0.95, 50, 0.05, 1.0)]]
PROMPTS = [[5 + i, 17, 99, 3 * i + 1, 250, 42] for i in range(4)]


async def seeded_with_noise(client: PipelineClient, noise: int) -> list[list[int]]:
    """The seeded requests, started among `noise` unseeded ones of other lengths."""
    async def one(prompt: list[int], params: SamplingParams, delay: float) -> list[int]:
        await asyncio.sleep(delay)
        ids: list[int] = []
        async for out in client.stream(prompt, params):
            ids += out.token_ids
        return ids

    noisy = [one([9] * (3 + i), SamplingParams(max_tokens=5 + 3 * i, temperature=1.0,
                                               ignore_eos=True), 0.01 * i) for i in range(noise)]
    seeded = [one(p, sp, 0.02 * i) for i, (p, sp) in enumerate(zip(PROMPTS, SEEDED,
                                                                    strict=True))]
    results = await asyncio.gather(*seeded, *noisy)
    return list(results[:len(seeded)])


def test_seeded_requests_are_reproducible_across_batches_and_overlap(
        tiny_model_dir: Path) -> None:
    runs = []
    for depth, noise in ((2, 0), (2, 6), (1, 3)):
        cfg = live_config(tiny_model_dir, depth=depth, max_num_seqs=8,
                          max_num_batched_tokens=32)
        with running(cfg) as pipe:
            runs.append(asyncio.run(seeded_with_noise(pipe.client(), noise)))
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(r) for r in runs[0]}) == 4


@pytest.mark.parametrize("quantization,dtype", [
    (None, "float32"), pytest.param("int8", "float32", marks=needs_quantized),
    pytest.param("gguf", "float32", marks=needs_quantized),
    pytest.param("gguf", "bfloat16", marks=needs_quantized)])  # (widened on AMX, where it is)
def test_stop_string_n_logprobs_and_prefix_cache(request: pytest.FixtureRequest,
                                                 tiny_model_dir: Path,
                                                 quantization: str | None, dtype: str) -> None:
    """The request semantics through the live pipeline, with float32 weights, quantized
    ones (whose kernel also runs one-token decode steps and multi-token prefill chunks),
    and a GGUF file's blocks (its tokenizer and config read from the file's metadata), in
    float32 and, with bf16 activations, its products widened on AMX where the CPU has it."""
    if quantization == "gguf":
        model, quantization = request.getfixturevalue("tiny_gguf_dir"), None
    else:
        model = tiny_model_dir
    cfg = live_config(model, max_num_seqs=8, max_num_batched_tokens=64,
                      quantization=quantization, dtype=dtype)
    with running(cfg) as pipe:
        client = pipe.client()
        system = "You are a helpful assistant. Answer in one short sentence, please. " * 2
        prompt = system + "Question one?"
        (free_run,) = client.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0,
                                                               ignore_eos=True))
        stop = free_run.text[len(free_run.text) // 2:][:3]
        assert len(stop) == 3
        steps_before = pipe.idle_stats().num_steps
        (stopped,) = client.generate([prompt], SamplingParams(
            max_tokens=60, temperature=0.0, ignore_eos=True, stop=[stop]))
        assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
        assert stopped.text == free_run.text[:free_run.text.index(stop)]
        assert stopped.num_cached_tokens > 0  # the same prompt ran just before
        # The scheduler was told: it stopped soon after the match, not at 60. (The tiny
        # model's steps take about a millisecond, so the detokenizer's round trip on two
        # busy cores spans several: CI once saw 7 steps past 36 tokens.)
        steps = pipe.idle_stats().num_steps - steps_before
        assert steps < 60 and steps <= len(stopped.token_ids) + 16

        outs = client.generate([system + "Question two?"], SamplingParams(
            max_tokens=8, temperature=1.0, n=3, seed=5, logprobs=2, ignore_eos=True))
        (multi,) = outs
        assert isinstance(multi, CompletionOutput) and len(multi.samples) == 3
        assert all(len(s.token_ids) == 8 and s.finish_reason == "length" for s in multi.samples)
        assert len({tuple(s.token_ids) for s in multi.samples}) > 1
        for s in multi.samples:
            assert [lp.token_id for lp in s.logprobs] == s.token_ids
            assert all(len(lp.top_ids) == 2 and len(lp.top_tokens) == 2 for lp in s.logprobs)
            assert "".join(lp.token for lp in s.logprobs) != ""
        assert multi.num_output_tokens == 24
        stats = pipe.idle_stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    assert stats.num_free_blocks == stats.num_blocks
