"""The CUDA path: streams, events and page-locked rings. Skipped without a GPU; run by
scripts/gpu_check on a machine that has one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from live import live_config, running, stream_and_abort
from tiny_model import hf_greedy

from ipc.messages import SamplingParams
from stages.inprocess import InProcessEngine

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXTS = ["The quick brown fox", "Paged attention", "Héllo wörld 🚀", "def main():",
         "Continuous batching lets new requests join. " * 3, "a", "日本語", "Grüße aus Köln."]


def _prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


def test_paged_model_on_cuda_matches_transformers(tiny_model_dir: Path) -> None:
    prompts = _prompts(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, prompts, 16)
    engine = InProcessEngine(str(tiny_model_dir), max_num_batched_tokens=16, device="cuda")
    got = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                  ignore_eos=True))
    assert [g[:len(e)] for g, e in zip(got, expected, strict=True)] == expected


@pytest.mark.live
@pytest.mark.parametrize("depth", [1, 2])
def test_live_pipeline_on_cuda_overlapped_equals_synchronous(tiny_model_dir: Path,
                                                              depth: int) -> None:
    prompts = _prompts(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, prompts, 12)
    cfg = live_config(tiny_model_dir, depth=depth, device="cuda", max_num_batched_tokens=16)
    with running(cfg) as pipe:
        outs = pipe.client().generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.live
def test_stream_and_abort_on_cuda(tiny_model_dir: Path) -> None:
    with running(live_config(tiny_model_dir, device="cuda")) as pipe:
        assert stream_and_abort(pipe.client(), [5, 6, 7], max_tokens=400, after=5) == "abort"


def test_decode_graphs_on_cuda_give_the_ordinary_compiled_tokens(tiny_model_dir: Path) -> None:
    prompts = _prompts(tiny_model_dir)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = {}
    for graphs in (False, True):
        engine = InProcessEngine(str(tiny_model_dir), max_num_batched_tokens=16, device="cuda",
                                 block_size=16, compile=True, graphs=graphs)
        got[graphs] = engine.generate(prompts, params)
        if graphs:
            assert engine.runner.graphs is not None
            assert engine.runner.graphs.stats.captures > 0
            assert engine.runner.graphs.stats.replays > engine.runner.graphs.stats.captures
    assert got[True] == got[False]


@pytest.mark.parametrize("compiled", [True, False])
def test_no_host_sync_on_cuda_and_run_ahead_equals_synchronised(tiny_model_dir: Path,
                                                                 compiled: bool) -> None:
    """The executor's device path (pipeline/tools/device_run.py) with any host sync an error,
    once a first run compiled and captured; then run-ahead against every step waited for and
    against a slowed GPU, bit for bit."""
    from pipeline.tools.device_run import DeviceRun, comparable, overlap_workload
    from pipeline.tools.gpu_check import small_limits, small_runner

    limits = small_limits(tiny_model_dir)
    run = DeviceRun(small_runner(tiny_model_dir, limits, "cuda", compiled), limits)
    requests = overlap_workload(limits.vocab_size)
    run.run(requests)
    synced, _ = run.run(requests, sync=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        ahead, stats = run.run(requests)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    slowed, _ = run.run(requests, slow_cycles=2_000_000)
    assert comparable(ahead) == comparable(synced) == comparable(slowed)
    assert stats.preemptions > 0


def test_embeddings_on_cuda_equal_the_cpu_ones(tmp_path: Path) -> None:
    """Pooled rows on CUDA (the hidden states the executor returns for them): each text's
    vector, mean pooled over a prompt prefilled in chunks, has cosine >= 0.9999 with the CPU
    engine's (which tests/test_embeddings.py holds to sentence-transformers')."""
    import numpy as np
    from transformers import AutoTokenizer

    from ipc.pooling import PoolingConfig
    from pipeline.tools.random_model import add_pooling_modules, build_random_llama

    folder = add_pooling_modules(build_random_llama(tmp_path, num_layers=2, hidden=64,
                                                    weight_std=0.05, seed=3), "mean")
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling="mean")
    cfg = PoolingConfig.from_dir(folder)
    vectors = {}
    for device in ("cpu", "cuda"):
        engine = InProcessEngine(str(folder), max_num_batched_tokens=16, block_size=16,
                                 device=device)
        results = engine.run([(f"e{i}", ids, params) for i, ids in enumerate(prompts)])
        vectors[device] = [cfg.finish(results[f"e{i}", 0].embedding)
                           for i in range(len(prompts))]
    for cpu, cuda in zip(vectors["cpu"], vectors["cuda"], strict=True):
        assert float(np.dot(cpu, cuda)) >= 0.9999
