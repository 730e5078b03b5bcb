"""The executor core against the transformers oracle: greedy tokens through the paged model,
with chunked prefill, mixed prefill/decode batches, run-ahead and preemption (in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_model import hf_greedy

from ipc.messages import SamplingParams
from stages.executor import kernels
from stages.inprocess import InProcessEngine


def _prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["The quick brown fox", "Paged attention stores keys", "Héllo wörld 🚀",
             "def main():", "Continuous batching lets new requests join at any step. " * 3,
             "a", "日本語のテキスト", "Grüße aus Köln. The lazy dog."]
    return [tok(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("budget", [8, 256])
def test_greedy_matches_transformers(tiny_model_dir: Path, depth: int, budget: int) -> None:
    prompts = _prompts(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, prompts, max_new_tokens=12)
    engine = InProcessEngine(str(tiny_model_dir), depth=depth, max_num_batched_tokens=budget,
                             max_num_seqs=8 if budget > 8 else 4,
                             eos_token_ids=_eos(tiny_model_dir))
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert got == expected
    assert engine.scheduler.allocator.num_free == engine.scheduler.num_blocks
    assert engine.runner.cpu_kernels == kernels.available()


@pytest.mark.skipif(not kernels.available(), reason="the warm-up runs on the CPU kernels")
def test_a_warmed_up_engine_gives_what_a_cold_one_gives(tiny_model_dir: Path) -> None:
    """The executor's warm-up step (ModelRunner.warm_up, before it serves) fills the token
    budget as far as the KV cache and the context allow, across slots and blocks that
    requests take afterwards: greedy tokens and a seeded request with penalties (the slots'
    sampling state and token counts) come out as from an engine that never warmed up."""
    prompts = _prompts(tiny_model_dir)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, seed=7, repetition_penalty=1.3,
                             presence_penalty=0.5)

    def engine(**kw: object) -> InProcessEngine:
        return InProcessEngine(str(tiny_model_dir), max_num_seqs=8, block_size=4,
                               eos_token_ids=_eos(tiny_model_dir), **kw)  # type: ignore[arg-type]

    cold = engine(max_num_batched_tokens=256)
    want = cold.generate(prompts, greedy), cold.generate(prompts, sampled)
    # the budget, in rows of the context's length (64 tokens: 4 rows)
    warm = engine(max_num_batched_tokens=256, max_model_len=64)
    assert warm.runner.warm_up() == 256
    assert warm.generate(prompts, greedy) == want[0]
    assert warm.generate(prompts, sampled) == want[1]
    assert warm.generate(prompts, greedy) == hf_greedy(tiny_model_dir, prompts, max_new_tokens=12)
    # a KV cache smaller than the budget: as many tokens as its blocks hold
    small = engine(max_num_batched_tokens=256, kv_cache_memory=1 << 16)
    assert small.runner.num_blocks * 4 < 256
    assert small.runner.warm_up() == small.runner.num_blocks * 4
    assert small.generate(prompts[:2], greedy) == [want[0][0], want[0][1]]


def test_greedy_matches_transformers_on_pytorch_ops_alone(tiny_model_dir: Path) -> None:
    """The eager forward without the CPU kernels (as on CUDA, or where none can be built)."""
    prompts = _prompts(tiny_model_dir)
    engine = InProcessEngine(str(tiny_model_dir), max_num_batched_tokens=16, cpu_kernels=False,
                             eos_token_ids=_eos(tiny_model_dir))
    assert not engine.runner.cpu_kernels
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert got == hf_greedy(tiny_model_dir, prompts, max_new_tokens=12)


def test_preemption_keeps_greedy_outputs(tiny_model_dir: Path) -> None:
    prompts = _prompts(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, prompts, max_new_tokens=16)
    # A cache of a few blocks: sequences must be preempted and recomputed.
    engine = InProcessEngine(str(tiny_model_dir), block_size=4, kv_cache_memory=24 * 2048,
                             eos_token_ids=_eos(tiny_model_dir))
    assert engine.runner.num_blocks == 24  # 2 layers x K,V x 4 tokens x 2 heads x 16 x fp32
    got = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.allocator.num_free == engine.scheduler.num_blocks


def _staggered(engine: InProcessEngine, prompts: list[list[int]], max_tokens: list[int],
               arrive_at: list[int]) -> tuple[list[list[int]], int]:
    """InProcessEngine.run with request i added before loop turn arrive_at[i], so requests
    join and leave at different steps (as over the live pipeline's sockets); returns the
    tokens and the most steps that were in flight at once."""
    from collections import deque

    from ipc.messages import TokenizedRequest

    sched, got = engine.scheduler, {str(i): [] for i in range(len(prompts))}
    waiting = sorted(range(len(prompts)), key=lambda i: arrive_at[i])
    inflight: deque = deque()
    turn = most = 0
    while waiting or sched.requests or inflight:
        while waiting and arrive_at[waiting[0]] <= turn:
            i = waiting.pop(0)
            params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0)
            sched.add_request(TokenizedRequest(str(i), "", prompts[i], params, 0.0))
        while (step := sched.schedule()) is not None:
            ring = engine.rings[step.ring_slot]
            inflight.append((step.step_id, engine.runner.execute(step.write(ring), ring)))
        turn, most = turn + 1, max(most, len(inflight))
        if inflight:
            step_id, out = inflight.popleft()
            sched.on_sampled(step_id, out.tokens.tolist(), None, None)
            for delta in sched.take_outputs().deltas:
                got[delta.request_id] += delta.token_ids
    return [got[str(i)] for i in range(len(prompts))], most


def test_run_ahead_equals_synchronous_with_staggered_arrivals(tiny_model_dir: Path) -> None:
    """Overlapped (depth 2) and synchronous (depth 1) steps give the same greedy tokens, and
    transformers', while requests arrive at different steps and finish after 1 or 2 tokens
    (at the very step whose successor was already planned); nothing is left held."""
    prompts = _prompts(tiny_model_dir) * 2
    max_tokens = [1, 2, 3, 17, 9, 1, 30, 5, 2, 8, 1, 13, 21, 3, 6, 2]
    arrive_at = [0, 0, 1, 3, 3, 4, 6, 9, 10, 10, 12, 15, 16, 20, 21, 25]
    runs = {}
    for depth in (1, 2):
        engine = InProcessEngine(str(tiny_model_dir), depth=depth, max_num_seqs=4,
                                 max_num_batched_tokens=16, eos_token_ids=_eos(tiny_model_dir))
        runs[depth], most = _staggered(engine, prompts, max_tokens, arrive_at)
        assert most == depth  # depth 2 planned a step before the last one's tokens came
        assert engine.scheduler.allocator.num_free == engine.scheduler.num_blocks
    assert runs[2] == runs[1]
    expected = hf_greedy(tiny_model_dir, prompts[:8], max(max_tokens))
    assert [e[:n] for e, n in zip(expected * 2, max_tokens, strict=True)] == runs[1]


def _eos(model_dir: Path) -> tuple[int, ...]:
    from ipc.model_info import ModelInfo

    return ModelInfo.from_dir(model_dir).eos_token_ids


def test_sampling_with_temperature_stays_in_vocab(tiny_model_dir: Path) -> None:
    engine = InProcessEngine(str(tiny_model_dir))
    got = engine.generate(_prompts(tiny_model_dir)[:4],
                          SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
    vocab = engine.runner.model.cfg["vocab_size"]
    assert all(len(g) == 10 and all(0 <= t < vocab for t in g) for g in got)


def test_bfloat16_runs_with_a_bfloat16_cache(tiny_model_dir: Path) -> None:
    import torch

    from stages.executor.linear.amx import unpack

    engine = InProcessEngine(str(tiny_model_dir), dtype=torch.bfloat16)
    assert engine.runner.kv_caches[0].dtype == torch.bfloat16
    head = engine.runner.model.lm_head  # bf16 weights in the format this CPU takes them in
    if head.method.name in ("amx-bf16", "avx512-bf16"):  # (AMX's layout: bytes of bf16 pairs)
        assert unpack(head.amx_weight, head.out_features).dtype == torch.bfloat16
    else:  # oneDNN's packed layout where it can pack bf16 (can_pack), else plain
        assert getattr(head, "packed_weight", getattr(head, "weight", None)).dtype == torch.bfloat16
    prompts = _prompts(tiny_model_dir)
    got = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                  ignore_eos=True))
    fp32 = hf_greedy(tiny_model_dir, prompts, 1)
    # bf16 rounding may change later tokens, but most first tokens agree with fp32
    assert sum(g[0] == e[0] for g, e in zip(got, fp32, strict=True)) >= len(prompts) // 2
    assert all(len(g) == 8 for g in got)


def test_decode_groups_bound_the_padding() -> None:
    import numpy as np

    from stages.executor.backends.torch_sdpa import group_by_length

    lens = np.array(sorted([20, 21, 30, 45, 90, 100, 2000, 2500, 17]))
    groups = group_by_length(lens)
    assert [(g.start, g.end) for g in groups][0][0] == 0 and groups[-1].end == len(lens)
    assert all(a.end == b.start for a, b in zip(groups, groups[1:], strict=False))
    for g in groups:  # within a group the longest is at most twice the shortest
        assert g.max_len == lens[g.end - 1] <= 2 * max(lens[g.start], 16)
    assert len(groups) <= 5


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama-bias", "mistral-window", "qwen3",
                                  "phi3"])
def test_other_llama_family_shapes_match_transformers(tmp_path: Path, arch: str) -> None:
    """Qwen2 (q/k/v biases, tied embeddings), Mistral, Llama with attention and MLP biases,
    Mistral with a sliding window of 6, Qwen3 (q/k norms, its own head_dim) and Phi-3
    (fused checkpoint projections, a window of 10) shapes with GQA: greedy tokens equal
    transformers', with chunked prefill and run-ahead; prompts and outputs outgrow the
    windows, in prefill chunks with and without past and in decodes."""
    from pipeline.tools.random_model import build_random_llama

    folder = build_random_llama(tmp_path / arch, arch=arch, heads=4, kv_heads=2)
    prompts = _prompts(folder)
    expected = hf_greedy(folder, prompts, max_new_tokens=12)
    engine = InProcessEngine(str(folder), depth=2, max_num_batched_tokens=16, max_num_seqs=4,
                             eos_token_ids=_eos(folder))
    assert engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0)) == expected


@pytest.mark.parametrize("change, field", [
    ({"model_type": "mamba"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1], "long_factor": [1]}},
     "rope_scaling"),
    # (sliding layers without a window: transformers cannot mask them)
    ({"model_type": "qwen2", "use_sliding_window": True,
      "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_what_the_engine_does_not_implement_is_refused_before_loading(
        tiny_model_dir: Path, tmp_path: Path, change: dict, field: str) -> None:
    """Refused when the model's info is read (before any stage starts), naming the field."""
    import json
    import shutil

    from ipc.arch import UnsupportedModel
    from ipc.errors import ConfigError
    from ipc.model_info import ModelInfo

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModel) as err:
        ModelInfo.from_dir(folder)
    assert isinstance(err.value, ConfigError) and f"{field} = " in str(err.value)


def test_a_sliding_window_model_is_served_compiled(tmp_path: Path) -> None:
    """--compile takes a model with a sliding window (the compiled attention has a block mask
    per window; test_compiled checks its tokens): FlexAttention, told the model's windows."""
    import torch

    from ipc.config import EngineLimits
    from ipc.model_info import ModelInfo
    from pipeline.tools.random_model import build_random_llama
    from stages.executor.runner import ModelRunner

    folder = build_random_llama(tmp_path / "w", arch="mistral-window")
    info = ModelInfo.from_dir(folder)
    limits = EngineLimits(4, 64, 16, 128, info.vocab_size, info.eos_token_ids)
    runner = ModelRunner.from_dir(str(folder), torch.float32, torch.device("cpu"), limits,
                                  1 << 22, compile=True)
    assert runner.backend.name == "flex" and runner.backend.windows == (6,)


@pytest.mark.parametrize("rope", [
    {"rope_theta": 10000.0},  # a config that names its theta: computed here
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    {},  # no theta: the config class's default
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
     "rope_theta": 500000.0},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 10000.0},
])
def test_rope_tables_are_transformers(rope: dict) -> None:
    """The cos/sin tables equal those of transformers' LlamaRotaryEmbedding, for the plain
    rope computed here and the scaled ones taken from its rope functions."""
    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from stages.executor.models.base import rope_tables

    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 128,
           "vocab_size": 32, "max_position_embeddings": 256, **rope}
    got_cos, got_sin = rope_tables(cfg, 16, 256)
    hf = LlamaRotaryEmbedding(AutoConfig.for_model(**cfg))
    x = torch.zeros(1, 256, 64)
    cos, sin = hf(x, torch.arange(256)[None])
    assert torch.allclose(got_cos, cos[0], atol=1e-6)
    assert torch.allclose(got_sin, sin[0], atol=1e-6)
