"""Pipeline parallelism (stages/executor/parallel.py, ipc/ranks.py): the layers split into
stages, each rank loading only its own layers and their cache; P = 2, 3 and P = 2 x K = 2
executor ranks over gloo give the greedy tokens of one rank through the live pipeline, on
Llama, Qwen3, Gemma 3 (sliding and global layers), a mixture of experts and a quantized GGUF
file, with chunked prefill; an uneven partition plans with the fewest blocks; a killed stage
restarts its engine as a group; what the stages cannot run is refused before anything
starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import live
import pytest
import torch
from kernel_marks import needs_quantized_kernels
from live import alive, kill_and_serve_again, running, stop_under_load

from ipc.config import EngineLimits, ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.errors import ConfigError
from ipc.messages import SamplingParams
from ipc.ranks import RankLayout, partition_layers
from pipeline.runtime.launcher import Pipeline
from pipeline.tools.random_model import build_random_llama, build_random_model
from stages.executor.backends.torch_sdpa import TorchBackend
from stages.executor.linear.dense import DenseMethod
from stages.executor.models import load_model
from stages.executor.parallel import PipelineParallel
from stages.inprocess import InProcessEngine

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5 + i, 9, 13 + 2 * i] * (1 + 3 * i) for i in range(6)]  # 3 to 48 tokens


def pp_config(folder: Path, stages: int, tensor: int = 1, kv_cache_memory: int = 1 << 22,
              partition: tuple[int, ...] | None = None) -> PipelineConfig:
    return live.ranks_config(folder, kv_cache_memory, tensor_parallel_size=tensor,
                             pipeline_parallel_size=stages, pipeline_layer_partition=partition)


def one_rank(folder: Path, max_tokens: int = 12, **engine: Any) -> list[list[int]]:
    """The greedy tokens of one rank on PROMPTS (tests/live.py)."""
    return live.one_rank(folder, PROMPTS, max_tokens, **engine)


def generate(cfg: PipelineConfig, max_tokens: int = 12) -> tuple[list[list[int]], int]:
    """Greedy outputs and the engine's KV blocks (tests/live.py generate_on_ranks)."""
    got, stats = live.generate_on_ranks(cfg, PROMPTS, max_tokens)
    return got, stats.num_blocks


def test_layers_split_evenly_with_the_remainder_before_the_last_stage() -> None:
    assert partition_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert partition_layers(7, 3) == [range(0, 2), range(2, 5), range(5, 7)]
    assert partition_layers(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert partition_layers(16, 2, (9, 7)) == [range(0, 9), range(9, 16)]
    assert partition_layers(4, 1) == [range(0, 4)]
    with pytest.raises(ValueError, match="sum to the model's 16 layers"):
        partition_layers(16, 2, (9, 8))
    with pytest.raises(ValueError, match="at least one layer"):
        partition_layers(4, 2, (4, 0))
    with pytest.raises(ValueError, match="gives 3 stage"):
        partition_layers(6, 2, (2, 2, 2))
    with pytest.raises(ValueError, match="has only 2 layers"):
        partition_layers(2, 3)


def test_an_engines_ranks_are_stages_of_tensor_ranks() -> None:
    """vLLM's layout: rank = stage * K + tensor rank; the head is stage 0's first rank, the
    reporter the last stage's first."""
    layout = RankLayout(2, tensor_parallel_size=2, pipeline_parallel_size=3)
    assert layout.ranks_per_engine == 6 and layout.num_ranks == 12
    assert list(layout.engine_ranks(1)) == list(range(6, 12))
    assert [layout.stage_of(r) for r in range(6, 12)] == [0, 0, 1, 1, 2, 2]
    assert [layout.tensor_rank(r) for r in range(6, 12)] == [0, 1, 0, 1, 0, 1]
    assert layout.head(1) == 6 and layout.reporter(1) == 10 and layout.reporter(0) == 4
    assert layout.describe(9) == "e1.s1.t1"
    assert RankLayout(1).reporter(0) == 0
    with pytest.raises(ValueError, match="at least 1"):
        RankLayout(1, 1, 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied head; one tied to the embedding
def test_each_stage_loads_only_its_layers(tmp_path: Path, arch: str) -> None:
    """Stage s holds the model's layers of its range (the same weights, indexed from 0),
    the embedding only where it embeds (and on the last stage when the head is tied to
    it), the norm and the head only on the last, and a KV shape of its own layers."""
    folder = build_random_llama(tmp_path / arch, arch=arch, num_layers=5)
    cpu = torch.device("cpu")
    backend = TorchBackend(EngineLimits(4, 16, 4, 64, 100), cpu)  # (not run)
    full = load_model(folder, torch.float32, cpu, 64, backend, DenseMethod())
    ranges = partition_layers(5, 2)
    stages = [load_model(folder, torch.float32, cpu, 64, backend, DenseMethod(),
                         stage=PipelineParallel(s, 2, ranges[s])) for s in range(2)]
    full_params = dict(full.named_parameters())
    for stage, layers in zip(stages, ranges, strict=True):
        assert len(stage.model.layers) == len(layers) == stage.kv_shape.num_layers
        for name, param in stage.named_parameters():
            if name.startswith("model.layers."):
                index, rest = name.removeprefix("model.layers.").split(".", 1)
                name = f"model.layers.{int(index) + layers.start}.{rest}"
            assert torch.equal(param, full_params[name]), name
    first, last = stages
    assert first.model.embed_tokens is not None and first.lm_head is None
    assert first.model.norm is None
    assert last.model.norm is not None and last.lm_head is not None
    tied = arch == "qwen2"
    assert (last.model.embed_tokens is not None) == tied
    if tied:
        assert last.lm_head.weight is last.model.embed_tokens.weight
    whole = sum(p.numel() for p in full.parameters())
    assert sum(p.numel() for s in stages for p in s.parameters()) == whole + (
        full.model.embed_tokens.weight.numel() if tied else 0)


@pytest.mark.parametrize(("stages", "tensor"), [(2, 1), (3, 1), (2, 2)])
@pytest.mark.live
def test_stages_give_the_tokens_of_one_rank(tmp_path: Path, stages: int, tensor: int) -> None:
    folder = build_random_llama(tmp_path / "llama", heads=4, kv_heads=2, num_layers=4)
    got, _ = generate(pp_config(folder, stages, tensor))
    assert got == one_rank(folder)


@pytest.mark.parametrize(("model_type", "fields"), [
    ("qwen3", {"head_dim": 16}),  # per-head q/k norms
    ("gemma3_text", {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 16,
                     # a sliding layer on each stage, the global one on the last
                     "layer_types": ["sliding_attention", "sliding_attention",
                                     "sliding_attention", "full_attention"]}),
    ("qwen2_moe", {"num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                   "shared_expert_intermediate_size": 64}),
])
@pytest.mark.live
def test_two_stages_of_each_kind_of_family_give_the_tokens_of_one(
        tmp_path: Path, model_type: str, fields: dict) -> None:
    folder = build_random_model(
        tmp_path / model_type, model_type, hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, **fields)
    got, _ = generate(pp_config(folder, 2))
    assert got == one_rank(folder)


@pytest.mark.live
def test_two_stages_of_a_quantized_gguf_file_give_its_tokens_on_one(tmp_path: Path) -> None:
    """Each stage takes its layers' blocks from the file; the last its head, here tied to the
    embedding's blocks (Qwen2)."""
    from pipeline.tools.gguf_export import export
    from pipeline.tools.model_source import resolve_model
    from stages.executor.linear.quantized import kernel_missing

    if kernel_missing() is not None:
        pytest.skip(str(kernel_missing()))
    source = build_random_llama(tmp_path / "source", arch="qwen2", num_layers=4)
    folder = resolve_model(export(source, tmp_path / "tiny-Q8_0.gguf", "Q8_0"))
    got, _ = generate(pp_config(folder, 2))
    assert got == one_rank(folder)


@pytest.mark.live
def test_two_stages_quantize_their_own_layers_as_one_rank_does(tmp_path: Path) -> None:
    from stages.executor.linear.quantized import kernel_missing

    if kernel_missing() is not None:
        pytest.skip(str(kernel_missing()))
    folder = build_random_llama(tmp_path / "llama", heads=4, kv_heads=2, num_layers=4)
    cfg = pp_config(folder, 2)
    cfg = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor,
                                                                quantization="int8"))
    got, _ = generate(cfg)
    assert got == one_rank(folder, quantization="int8")


@pytest.mark.live
def test_an_uneven_partition_plans_with_the_fewest_blocks(tmp_path: Path) -> None:
    """3 layers and 1: the first stage's cache holds a third of the blocks the second's does;
    the scheduler gets the first's count, and the tokens are one rank's."""
    folder = build_random_llama(tmp_path / "llama", heads=4, kv_heads=2, num_layers=4)
    memory = 1 << 20
    per_layer_block = 2 * 4 * 2 * 16 * 4  # K and V, positions, KV heads, head size, float32
    got, blocks = generate(pp_config(folder, 2, kv_cache_memory=memory, partition=(3, 1)))
    assert blocks == memory // (3 * per_layer_block)
    assert got == one_rank(folder)


@pytest.mark.live
def test_a_killed_stage_restarts_its_engine_as_a_group(tmp_path: Path) -> None:
    """kill -9 of the last stage: every rank and the scheduler start again, and the engine
    gives one rank's tokens again."""
    folder = build_random_llama(tmp_path / "llama", heads=4, kv_heads=2, num_layers=4)
    assert kill_and_serve_again(pp_config(folder, 2), "executor:1", PROMPTS) == one_rank(folder)


def test_what_the_stages_cannot_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from ipc.speculative import parse_speculative

    folder = build_random_llama(tmp_path / "llama", num_layers=4)
    with pytest.raises(ConfigError, match="gives 3 stage"):
        pp_config(folder, 2, partition=(1, 1, 2))
    for cfg, match in [
        (pp_config(folder, 2, partition=(3, 2)), "sum to the model's 4 layers"),
        (pp_config(folder, 5), "has only 4 layers"),
        (dataclasses.replace(pp_config(folder, 2), scheduler=SchedulerConfig(
            speculative=parse_speculative("ngram:3"))), "runs on one pipeline stage"),
    ]:
        pipe = Pipeline(cfg)
        with pytest.raises(ConfigError, match=match):
            pipe.start()
        assert pipe.stage_pids == {}
    with pytest.raises(ConfigError, match="needs a model"):  # (its ranks would not split)
        ExecutorConfig.for_device("timed:1,0", tensor_parallel_size=2)


@pytest.mark.live
def test_two_stages_of_the_default_model_give_its_greedy_and_seeded_tokens(
        tmp_path: Path) -> None:
    """SmolLM2 (30 layers, a tied head) on two stages: greedy and seeded sampling outputs
    are one rank's."""
    from pipeline.tools.model_cache import ensure_default_model

    folder = ensure_default_model()
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7,
                             ignore_eos=True)]
    engine = InProcessEngine(str(folder), max_num_seqs=4, max_num_batched_tokens=16,
                             block_size=4, max_model_len=96)
    want = [engine.generate(PROMPTS, p) for p in params]
    with running(pp_config(folder, 2)) as pipe:
        client = pipe.client()
        got = [[o.token_ids for o in client.generate(PROMPTS, p)] for p in params]
        pids = list(pipe.stage_pids.values())
    assert got == want
    assert alive(pids) == []


@pytest.mark.live
def test_stages_of_the_timed_instrument_give_its_tokens_on_one(tmp_path: Path) -> None:
    """The timed device (no model) on P = 3 stages: each stage takes the step time once the
    stage before passed the step on, the first once the samples exist (device.py
    TimedDevice); the tokens, a function of each context, are one stage's."""
    folder = build_random_llama(tmp_path / "llama", num_layers=2)

    def run(stages: int) -> list[list[int]]:
        cfg = dataclasses.replace(pp_config(folder, 1), executor=ExecutorConfig.for_device(
            "timed:0.2,0", pipeline_parallel_size=stages))
        with running(cfg) as pipe:
            outs = pipe.client().generate(PROMPTS, SamplingParams(max_tokens=12,
                                                                  ignore_eos=True))
            pids = list(pipe.stage_pids.values())
        assert alive(pids) == []
        assert not [o.error for o in outs if o.error]
        return [o.token_ids for o in outs]

    assert run(3) == run(1)


@pytest.mark.live
def test_two_stages_sample_score_and_constrain_as_one_rank(tmp_path: Path) -> None:
    """What the last stage alone does (penalties from its own samples, logprobs, prompt
    logprobs) through two stages: one rank's results, on the default model; and a structured
    output's matcher, on the sampling rank, holds the output to its pattern (the in-process
    engine has no matchers to compare with)."""
    from ipc.messages import StructuredOutputs
    from pipeline.tools.model_cache import ensure_default_model

    folder = ensure_default_model()
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.5,
                       frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                       prompt_logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.0,
                       structured_outputs=StructuredOutputs(regex="(yes|no)-[0-9]{3}")),
    ]
    engine = InProcessEngine(str(folder), max_num_seqs=4, max_num_batched_tokens=16,
                             block_size=4, max_model_len=96)
    want = engine.run([(f"{i}-{j}", prompt, p) for i, p in enumerate(params[:2])
                       for j, prompt in enumerate(PROMPTS[:4])])
    with running(pp_config(folder, 2)) as pipe:
        client = pipe.client()
        got = {(i, j): out for i, p in enumerate(params)
               for j, out in enumerate(client.generate(PROMPTS[:4], p))}
    for (i, j), out in got.items():
        if i == 2:
            import re

            assert out.error is None and re.fullmatch("(yes|no)-[0-9]{3}", out.text), out.text
            continue
        ref = want[f"{i}-{j}", 0]
        assert out.error is None and out.token_ids == ref.token_ids, (i, j)
        assert [(x.token_id, x.top_ids) for x in out.logprobs] == [
            (x.token_id, x.top_ids) for x in ref.logprobs]
        assert [x.logprob for x in out.logprobs] == pytest.approx(
            [x.logprob for x in ref.logprobs], abs=1e-4)
        if i == 1:
            assert out.samples[0].prompt_logprobs is not None and ref.prompt_logprobs
            assert [x.logprob for x in out.samples[0].prompt_logprobs[1:]] == pytest.approx(
                [x.logprob for x in ref.prompt_logprobs[1:]], abs=1e-4)


@pytest.mark.live
def test_two_stages_through_preemption(tmp_path: Path) -> None:
    """A cache too small for every sequence at once: sequences are preempted and run again
    (their slots taken by others while old samples are on their way), one rank's tokens."""
    folder = build_random_llama(tmp_path / "llama", heads=4, kv_heads=2, num_layers=4)
    one = one_rank(folder, max_tokens=30)
    # 30 blocks of 4 tokens a rank (2 layers each) for 4 sequences of up to 78 tokens
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # layers, K and V, positions, KV heads, dim, float32
    with running(pp_config(folder, 2, kv_cache_memory=30 * per_block)) as pipe:
        outs = pipe.client().generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0,
                                                              ignore_eos=True))
        stats = pipe.idle_stats()
    assert [o.token_ids for o in outs] == one
    assert stats.num_preemptions > 0


@pytest.mark.live
def test_a_stop_under_load_lets_every_stage_finish_its_steps(tmp_path: Path) -> None:
    """SIGTERM while three stages stream: each runs up to the last step rank 0 forwarded,
    the first waits for that step's samples before it leaves the group, and every executor
    exits 0 (none fails its last send, none is killed past the stop timeout)."""
    folder = build_random_llama(tmp_path / "llama", heads=8, kv_heads=4, num_layers=6,
                                hidden=256)
    codes, took = stop_under_load(pp_config(folder, 3), PROMPTS)
    assert codes == {"executor:0": 0, "executor:1": 0, "executor:2": 0}, codes
    assert took < 8, took


@needs_quantized_kernels  # (a Q8_0 file's blocks)
def test_a_stage_reads_only_its_own_layers_blocks_of_a_gguf_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader asks the GGUF reader for a stage's own tensors only: the other stages'
    layers' blocks are never converted (nor held), the embedding's only on the first stage
    and the head's only on the last (untied here)."""
    from ipc.gguf_source import gguf_source
    from pipeline.tools.gguf_export import export
    from pipeline.tools.model_source import resolve_model
    from stages.executor import gguf_loader
    from stages.executor.linear.select import select_linear_method

    source = build_random_llama(tmp_path / "source", num_layers=4)  # (an untied head)
    folder = resolve_model(export(source, tmp_path / "tiny-Q8_0.gguf", "Q8_0"))
    read: list[int] = []
    convert = gguf_loader.gguf_blocks

    def counted(data: Any, kind: str, rows: int) -> Any:
        read.append(rows)
        return convert(data, kind, rows)

    monkeypatch.setattr(gguf_loader, "gguf_blocks", counted)
    cpu = torch.device("cpu")
    backend = TorchBackend(EngineLimits(4, 16, 4, 64, 100), cpu)  # (not run)
    ranges = partition_layers(4, 2)
    per_stage = []
    for s in (None, 0, 1):
        read.clear()
        linear = select_linear_method(torch.float32, cpu, False, None, None,
                                      gguf_source(folder), False)
        load_model(folder, torch.float32, cpu, 64, backend, linear,
                   stage=None if s is None else PipelineParallel(s, 2, ranges[s]))
        per_stage.append(len(read))
    whole, first, last = per_stage
    projections = 7  # q, k, v, o, gate, up, down a layer
    assert first == 2 * projections + 1  # (its layers and the embedding)
    assert last == 2 * projections + 1  # (its layers and the head)
    assert whole == 4 * projections + 2
