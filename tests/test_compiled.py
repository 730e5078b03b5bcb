"""The compiled forward (torch.compile, padded steps, FlexAttention over the paged cache)
against the transformers oracle, in process: greedy tokens equal, on Llama, Qwen2 (biases,
tied embeddings) and Mistral shapes with GQA, with and without a sliding window, with chunked
prefill, prefix hits, run-ahead and preemption; and the number of compiled graphs stays
bounded by the step buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model import hf_greedy

from ipc.messages import SamplingParams
from ipc.model_info import ModelInfo
from stages.executor.backends.flex import token_buckets
from stages.executor.backends.select import compile_unavailable
from stages.inprocess import InProcessEngine

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(compile_unavailable("cpu") is not None,
                                 reason="TorchInductor needs a C++ compiler here")]


def _prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    shared = "A shared system prompt that spans several pages of the cache. " * 2
    texts = ["The quick brown fox", shared + "first question", "Héllo wörld 🚀",
             shared + "second question", "def main():", "a",
             "Continuous batching lets new requests join at any step. " * 3]
    return [tok(t)["input_ids"] for t in texts]


def _engine(folder: Path, **kwargs: object) -> InProcessEngine:
    return InProcessEngine(str(folder), compile=True,
                           eos_token_ids=ModelInfo.from_dir(folder).eos_token_ids,
                           **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "mistral-window"])
def test_compiled_greedy_matches_transformers(tmp_path: Path, arch: str) -> None:
    """mistral-window: a sliding window of 6 positions that prompts, chunks with past and
    decodes outgrow (the windows' block masks, flex.SlidingWindows)."""
    from pipeline.tools.random_model import build_random_llama

    folder = build_random_llama(tmp_path / arch, arch=arch, heads=4, kv_heads=2)
    prompts = _prompts(folder)
    expected = hf_greedy(folder, prompts, max_new_tokens=12)
    # A 16-token budget: prompts are chunked, steps mix chunks and decodes.
    engine = _engine(folder, depth=2, max_num_batched_tokens=16, max_num_seqs=4)
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert got == expected
    # The shared prompt was reused; but with a window of 6 on every layer, the first one's
    # pages went back, keys and all, as it moved past them (KVManager.trim): no hit then.
    assert (engine.scheduler.prefix_cache_hits > 0) == (arch != "mistral-window")
    assert engine.runner.compile_stats.num_graphs <= len(token_buckets(engine.limits))


def test_compiles_are_bounded_by_the_step_buckets(tiny_model_dir: Path) -> None:
    """A long mixed run (prompts of many lengths, chunked, joining and leaving) compiles once
    per padded step size and kind (decode-only steps attend row by row on the CPU) it meets,
    within the bound, and never again; a second run compiles nothing."""
    engine = _engine(tiny_model_dir, max_num_batched_tokens=64, max_num_seqs=8)
    sizes: set[tuple[int, bool]] = set()
    prepare = engine.runner.prepare

    def recording_prepare(plan, ring):  # type: ignore[no-untyped-def]
        step = prepare(plan, ring)
        sizes.add((step.counts["input_ids"], step.decode_only))
        return step

    engine.runner.prepare = recording_prepare  # type: ignore[method-assign]
    prompts = [[(7 * i + j) % 200 + 3 for j in range(1 + (13 * i) % 90)] for i in range(24)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)
    # One 3-token prompt (a 4-token bucket, with a prefill) and four short ones (decoding
    # in 4-token steps): one bucket, both kinds.
    engine.generate([[5, 6, 7]], params)
    engine.generate([[5, 6, 7], [8, 9], [10, 11], [12, 13]], params)
    stats = engine.runner.compile_stats
    assert {size for size, _ in sizes} <= set(token_buckets(engine.limits))
    assert len(sizes) > 3 and any(decode for _, decode in sizes)
    assert any((size, not decode) in sizes for size, decode in sizes)  # both kinds at a size
    assert stats.num_graphs == len(sizes) <= stats.max_graphs
    engine.generate(prompts[::-1], params)
    engine.generate([[9, 8, 7]], params)
    assert stats.num_graphs == len(sizes)


def test_compiled_greedy_survives_preemption_and_decode_graphs_agree(tiny_model_dir: Path
                                                                      ) -> None:
    """The ordinary compiled path through preemption: greedy tokens equal transformers'.
    Then decode steps through the graphs' static buffers (graphs.py; on the CPU the captured
    function runs as a plain call): the same tokens as the ordinary compiled path, greedy and
    seeded with penalties, through preemption; one capture per decode bucket, no compile more."""
    prompts = [p for p in _prompts(tiny_model_dir) if len(p) < 40]  # each fits the cache
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=5, repetition_penalty=1.2,
                            ignore_eos=True)
    kwargs = {"block_size": 4, "kv_cache_memory": 25 * 2048, "max_num_seqs": 4}
    plain = _engine(tiny_model_dir, **kwargs)  # (each engine starts dynamo afresh)
    assert plain.runner.num_blocks == 24  # 25 blocks' memory, one of them scratch
    expected = [plain.generate(prompts, greedy)]
    assert expected[0] == hf_greedy(tiny_model_dir, prompts, max_new_tokens=24)
    assert plain.scheduler.num_preemptions > 0
    expected.append(plain.generate(prompts, seeded))
    graphed = _engine(tiny_model_dir, graphs=True, **kwargs)
    assert plain.runner.graphs is None and graphed.runner.graphs is not None
    assert [graphed.generate(prompts, params) for params in (greedy, seeded)] == expected
    # The static buffers are the staging buffers' kind of tensor: nothing compiles again.
    assert graphed.runner.compile_stats.num_graphs == plain.runner.compile_stats.num_graphs
    stats = graphed.runner.graphs.stats
    decode_buckets = {b for b in token_buckets(graphed.limits) if b <= 4}
    assert stats.replays > 20 and 0 < stats.captures == len(stats.buckets)
    assert set(stats.buckets) <= decode_buckets and len(set(stats.buckets)) == stats.captures
    assert graphed.scheduler.num_preemptions > 0


def test_compile_default_and_refusals() -> None:
    """Compiled by default on CUDA, eager on the CPU; on CUDA a page size that is not a whole
    number of Triton tiles runs eager by default and is a ConfigError when --compile asks for
    it. (Sliding windows are no reason: test_compiled_sliding_windows_match_transformers.)"""
    from ipc.errors import ConfigError
    from stages.executor.backends.select import ForwardRequest, select_backend

    def chosen(device: str, compile: bool | None, block_size: int = 16, tp: int = 1) -> str:
        return select_backend(ForwardRequest(device, compile, None, block_size, tp),
                              probe=False).backend

    assert chosen("cuda", None) == "flex"
    assert chosen("cpu", None) == "cpu_kernels"
    assert chosen("cpu", True) == "flex"
    assert chosen("cuda", None, block_size=4) == "torch"
    assert chosen("cuda", False) == "torch"
    assert chosen("cuda", None, tp=2) == "torch"
    with pytest.raises(ConfigError, match="multiple of 16"):
        chosen("cuda", True, block_size=8)
    assert chosen("cpu", True, tp=2) == "flex"  # (test_tensor_parallel runs it)
    with pytest.raises(ConfigError, match="tensor parallelism is tested on the CPU only"):
        chosen("cuda", True, tp=2)
