"""Tensor parallelism (stages/executor/parallel.py): two executor ranks over gloo give the
greedy tokens of one, through the live pipeline, on Llama, Qwen2 (attention biases, tied
embeddings), Qwen3 (per-head q/k norms), OLMo 2/3 and OLMoE (q/k norms over the whole
projections, their squares summed across the ranks) shapes with GQA, with chunked prefill
and preemption;
each rank loads only its slices; a model the ranks cannot split is refused before anything
starts; every rank ends with the pipeline, also when one of them dies."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import live
import pytest
import torch
from kernel_marks import needs_kernels
from live import kill_and_serve_again, stop_under_load

from ipc.arch import UnsupportedModel
from ipc.config import EngineLimits, PipelineConfig
from pipeline.runtime.launcher import Pipeline
from pipeline.tools.random_model import build_random_llama
from stages.executor.backends.torch_sdpa import TorchBackend
from stages.executor.linear.dense import DenseMethod
from stages.executor.models import load_model
from stages.executor.parallel import TensorParallel

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5 + i, 9, 13 + 2 * i] * (1 + 3 * i) for i in range(6)]  # 3 to 48 tokens


def tp_config(folder: Path, size: int, kv_cache_memory: int = 1 << 22,
              kv_cache_dtype: str = "auto") -> PipelineConfig:
    return live.ranks_config(folder, kv_cache_memory, tensor_parallel_size=size,
                             kv_cache_dtype=kv_cache_dtype)


def one_rank(folder: Path, max_tokens: int = 12, **engine: Any) -> list[list[int]]:
    """The greedy tokens of one rank on PROMPTS (tests/live.py)."""
    return live.one_rank(folder, PROMPTS, max_tokens, **engine)


def generate(cfg: PipelineConfig, max_tokens: int = 12) -> tuple[list[list[int]], int]:
    """Greedy outputs and the number of preemptions (tests/live.py generate_on_ranks)."""
    got, stats = live.generate_on_ranks(cfg, PROMPTS, max_tokens)
    return got, stats.num_preemptions


@pytest.mark.parametrize(("arch", "vocab"), [
    ("qwen2", None), ("qwen3", None),  # (Llama: test_two_ranks_through_preemption)
    ("llama-bias", None),  # o_proj and down_proj biases: added once
    ("phi3", None),  # fused checkpoint projections, sliced per part
    ("llama", 515),  # a vocabulary the ranks split unevenly: the last one's rows padded
])
@pytest.mark.live
def test_two_ranks_give_the_tokens_of_one(tmp_path: Path, arch: str, vocab: int | None
                                          ) -> None:
    folder = build_random_llama(tmp_path / arch, arch=arch, heads=4, kv_heads=2, num_layers=2,
                                vocab_size=vocab)
    two, _ = generate(tp_config(folder, 2))
    assert two == one_rank(folder)


@pytest.mark.live
@needs_kernels  # (an 8-bit cache is the CPU kernels' format)
def test_two_ranks_over_an_int8_cache_give_the_tokens_of_one(tmp_path: Path) -> None:
    """Each rank's KV pool holds its own KV heads in the format (a row's scale is per token
    and KV head, so splitting the heads splits nothing of it)."""
    folder = build_random_llama(tmp_path / "llama", heads=4, kv_heads=2, num_layers=2)
    two, _ = generate(tp_config(folder, 2, kv_cache_dtype="int8"))
    assert two == one_rank(folder, kv_cache_dtype="int8")


@pytest.mark.parametrize(("model_type", "fields"), [
    ("qwen2_moe", {"shared_expert_intermediate_size": 64}),  # a gated shared expert too
    ("gpt_oss", {"head_dim": 16, "sliding_window": 6,  # sinks sliced per rank, biases once
                 "layer_types": ["sliding_attention", "full_attention"]}),
])
@pytest.mark.live
def test_two_ranks_split_every_expert_and_give_the_tokens_of_one(
        tmp_path: Path, model_type: str, fields: dict) -> None:
    """A mixture of experts over two gloo ranks: each rank runs every routed expert on its
    half of the expert's intermediate, one all-reduce a layer (moe_block.py); the greedy
    tokens are one rank's."""
    from pipeline.tools.random_model import build_random_model

    experts = ({"num_local_experts": 5} if model_type == "gpt_oss" else
               {"num_experts": 5, "moe_intermediate_size": 32})
    folder = build_random_model(
        tmp_path / model_type, model_type, hidden_size=64, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts_per_tok=2, max_position_embeddings=128, **experts, **fields)
    two, _ = generate(tp_config(folder, 2))
    assert two == one_rank(folder)


OLMO_FIELDS: dict[str, dict] = {
    "olmo2": {}, "olmo3": {"sliding_window": 6},  # (two sliding layers)
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2}}


def _olmo(folder: Path, model_type: str) -> Path:
    """A tiny OLMo 2, OLMo 3 or OLMoE whose q/k norm weights are 1 + N(0, 0.5) (a random
    model's are ones, where a rank that loaded another rank's rows, or all of them, would go
    unseen)."""
    from safetensors.torch import load_file, save_file

    from pipeline.tools.random_model import build_random_model

    build_random_model(folder, model_type, hidden_size=64, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, **OLMO_FIELDS[model_type])
    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = 1 + torch.randn(t.shape, generator=gen) * 0.5
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3", "olmoe"])
@pytest.mark.live
def test_two_ranks_norm_q_and_k_over_every_head(tmp_path: Path, model_type: str) -> None:
    """OLMo 2's, OLMo 3's (windowed) and OLMoE's q/k RMSNorms span the whole projections,
    every rank's heads: each rank sums its slice's squares, one all-reduce a layer adds them,
    and each scales its slice by its rows of the norm weights; the greedy tokens are one
    rank's."""
    folder = _olmo(tmp_path / model_type, model_type)
    two, _ = generate(tp_config(folder, 2))
    assert two == one_rank(folder)


class _ThreadRanks(TensorParallel):
    """Ranks as threads of this process: all_reduce sums every rank's tensor (rank 0's
    first, as gloo's two-rank sum), so two shards' layers run side by side without a
    process group."""

    def __init__(self, rank: int, size: int, vocab_size: int,
                 parts: list[torch.Tensor | None], barrier: threading.Barrier) -> None:
        super().__init__(rank, size, vocab_size)
        self.parts, self.barrier = parts, barrier

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.parts[self.rank] = x.clone()
        self.barrier.wait()
        total = self.parts[0]
        for part in self.parts[1:]:
            total = total + part  # type: ignore[operator]
        self.barrier.wait()  # (every rank has read the parts before the next call)
        return x.copy_(total)  # type: ignore[arg-type]


@pytest.mark.parametrize("model_type", ["olmo2", "olmoe"])
def test_q_and_k_norms_split_as_the_heads_and_sum_across_ranks(tmp_path: Path,
                                                               model_type: str) -> None:
    """Each rank holds its heads' rows of the q and k norm weights; normalising its slices,
    with the squares summed across ranks and divided by the whole width, gives one rank's
    norms of the whole projections to float32 rounding (the same sum in another order)."""
    folder = _olmo(tmp_path / model_type, model_type)
    cpu = torch.device("cpu")
    backend = TorchBackend(EngineLimits(4, 16, 4, 64, 100), cpu)  # (not run)
    full = load_model(folder, torch.float32, cpu, 64, backend, DenseMethod())
    vocab = full.spec.vocab_size
    parts: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2, timeout=30)
    shards = [load_model(folder, torch.float32, cpu, 64, backend, DenseMethod(),
                         _ThreadRanks(r, 2, vocab, parts, barrier)) for r in range(2)]
    whole = full.model.layers[1].self_attn
    attn = [s.model.layers[1].self_attn for s in shards]
    q_width, k_width = whole.q_size, whole.kv_size  # (4 and 2 heads of 16)
    for r, a in enumerate(attn):
        assert (a.q_size, a.kv_size) == (q_width // 2, k_width // 2)
        q_rows = slice(r * a.q_size, (r + 1) * a.q_size)
        k_rows = slice(r * a.kv_size, (r + 1) * a.kv_size)
        assert torch.equal(a.q_norm.weight, whole.q_norm.weight[q_rows])
        assert torch.equal(a.k_norm.weight, whole.k_norm.weight[k_rows])
    assert not torch.equal(attn[0].q_norm.weight, attn[1].q_norm.weight)  # (not all ones)

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(7, q_width, generator=gen) * torch.linspace(0.1, 3.0, q_width)
    k = torch.randn(7, k_width, generator=gen) * torch.linspace(3.0, 0.1, k_width)
    want_q, want_k = whole._norm_projections(q, k)
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(r: int) -> None:
        a = attn[r]
        got[r] = a._norm_projections(q[:, r * a.q_size:(r + 1) * a.q_size],
                                     k[:, r * a.kv_size:(r + 1) * a.kv_size])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    torch.testing.assert_close(torch.cat([got[0][0], got[1][0]], dim=1), want_q,
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([got[0][1], got[1][1]], dim=1), want_k,
                               rtol=1e-6, atol=1e-6)
    # A rank's own slice alone is not the norm: the sum across ranks is what makes it so.
    alone = attn[0].q_norm(q[:, :attn[0].q_size])
    assert not torch.allclose(alone, want_q[:, :attn[0].q_size], atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "olmo3"])
@pytest.mark.live
@pytest.mark.slow
def test_two_compiled_ranks_give_the_tokens_of_one(tmp_path: Path, arch: str) -> None:
    """The ranks' all-reduces traced into the compiled layers (gloo; OLMo 3's q/k sums of
    squares too): the greedy tokens of one eager rank, through chunked prefill and mixed
    steps."""
    folder = (_olmo(tmp_path / arch, arch) if arch == "olmo3" else
              build_random_llama(tmp_path / arch, heads=4, kv_heads=2, num_layers=2))
    cfg = tp_config(folder, 2)
    cfg = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, compile=True))
    two, _ = generate(cfg)
    assert two == one_rank(folder)


@pytest.mark.live
def test_two_ranks_through_preemption(tmp_path: Path) -> None:
    """Llama's shapes: two ranks give the tokens of one, through preemption."""
    folder = build_random_llama(tmp_path / "llama", heads=4, kv_heads=2, num_layers=2)
    one = one_rank(folder, max_tokens=30)
    # A cache of 30 blocks of 4 tokens per rank for 4 sequences of up to 78 tokens.
    per_block = 2 * 2 * 4 * 1 * 16 * 4  # layers, K and V, positions, a rank's kv head, dim
    small = tp_config(folder, 2, kv_cache_memory=30 * per_block)
    two, preemptions = generate(small, max_tokens=30)
    assert two == one
    assert preemptions > 0


@pytest.mark.live
def test_a_killed_rank_restarts_its_engine_as_a_group(tmp_path: Path) -> None:
    """kill -9 of rank 1: both ranks and the scheduler are started again (a new process
    group, a new store), and the engine gives the tokens of one rank again."""
    folder = build_random_llama(tmp_path / "llama", heads=4, kv_heads=2, num_layers=2)
    assert kill_and_serve_again(tp_config(folder, 2), "executor:1", PROMPTS) == one_rank(folder)


@pytest.mark.live
def test_a_stop_under_load_lets_every_rank_finish_its_steps(tmp_path: Path) -> None:
    """SIGTERM to every process while two ranks stream: the first rank announces the last
    step it forwarded (LastStep) and each rank runs up to it, so none waits in a collective
    for one that left; every executor exits 0 (not killed past the stop timeout)."""
    folder = build_random_llama(tmp_path / "llama", heads=8, kv_heads=4, num_layers=4,
                                hidden=256)
    codes, took = stop_under_load(tp_config(folder, 2), PROMPTS)
    assert codes == {"executor:0": 0, "executor:1": 0}, codes
    assert took < 8, took


def test_each_rank_loads_only_its_slices(tmp_path: Path) -> None:
    folder = build_random_llama(tmp_path / "qwen2", arch="qwen2", heads=4, kv_heads=2)
    cpu = torch.device("cpu")
    backend = TorchBackend(EngineLimits(4, 16, 4, 64, 100), cpu)  # (not run)
    full = load_model(folder, torch.float32, cpu, 64, backend, DenseMethod())
    vocab = full.spec.vocab_size
    shards = [load_model(folder, torch.float32, cpu, 64, backend, DenseMethod(),
                         TensorParallel(r, 2, vocab)) for r in range(2)]
    attn = [s.model.layers[0].self_attn for s in shards]
    d, q, kv = full.spec.head_dim, 2 * full.spec.head_dim, full.spec.head_dim  # per rank
    whole = full.model.layers[0].self_attn.qkv_proj.weight
    q_full, k_full, v_full = whole.split([4 * d, 2 * d, 2 * d])
    for r, a in enumerate(attn):
        qr, kr, vr = a.qkv_proj.weight.split([q, kv, kv])
        assert torch.equal(qr, q_full[r * q:(r + 1) * q])
        assert torch.equal(kr, k_full[r * kv:(r + 1) * kv])
        assert torch.equal(vr, v_full[r * kv:(r + 1) * kv])
        assert a.qkv_proj.weight.numel() * 2 == whole.numel()
    o = full.model.layers[0].self_attn.o_proj.weight
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), o)
    embed = torch.cat([s.model.embed_tokens.weight for s in shards])[:vocab]
    assert torch.equal(embed, full.model.embed_tokens.weight)
    assert shards[0].lm_head.weight is shards[0].model.embed_tokens.weight  # still tied


def test_a_model_the_ranks_cannot_split_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    folder = build_random_llama(tmp_path / "odd", heads=4, kv_heads=1)
    pipe = Pipeline(tp_config(folder, 2))
    with pytest.raises(UnsupportedModel, match="num_key_value_heads = 1 is not divisible"):
        pipe.start()
    assert pipe.stage_pids == {}


def test_devices_the_ranks_cannot_have_are_refused() -> None:
    from ipc.errors import ConfigError
    from stages.executor.preflight import check_devices

    check_devices("cpu", 2)
    with pytest.raises(ConfigError, match="pass --device cuda"):
        check_devices("cuda:1", 2)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ConfigError, match="need 64 CUDA devices"):
            check_devices("cuda", 64)
