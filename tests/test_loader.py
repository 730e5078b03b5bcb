"""Layers that own their sharding (stages/executor/sharding.py) and the one load path
(loader.py): a fused projection's parts land where the forward reads them, from separate or
fused entries, for one rank or two; a row-parallel bias is added once; vocabulary rows past
the end are zeros; an entry with no place, or a parameter no entry filled, is an error that
names it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ipc.config import EngineLimits
from stages.executor.backends.torch_sdpa import TorchBackend
from stages.executor.linear.dense import DenseMethod
from stages.executor.loader import target_of
from stages.executor.models import load_model
from stages.executor.sharding import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
)

PARTS = (4, 2, 2)  # q, k, v rows


def _entries() -> tuple[list[torch.Tensor], torch.Tensor]:
    parts = [torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 100 * i
             for i, n in enumerate(PARTS)]
    return parts, torch.cat(parts)


@pytest.mark.parametrize("size", [1, 2])
def test_a_fused_projection_loads_alike_from_parts_and_from_a_fused_entry(size: int) -> None:
    parts, fused = _entries()
    for rank in range(size):
        shard = Shard(rank, size)
        separate = ColumnParallelLinear(3, PARTS, False, DenseMethod(), shard)
        whole = ColumnParallelLinear(3, PARTS, False, DenseMethod(), shard)
        for j, part in enumerate(parts):
            separate.load_weight("weight", part, j)
        whole.load_weight("weight", fused, None)
        # this rank's rows of q, then of k, then of v
        want = torch.cat([p[rank * (n // size):(rank + 1) * (n // size)]
                          for p, n in zip(parts, PARTS, strict=True)])
        assert torch.equal(separate.weight, want) and torch.equal(whole.weight, want)


def test_a_part_of_the_wrong_shape_is_refused() -> None:
    layer = ColumnParallelLinear(3, PARTS, False, DenseMethod(), Shard())
    with pytest.raises(ValueError, match=r"have shape \(2, 3\), the model's part \(4, 3\)"):
        layer.load_weight("weight", torch.zeros(2, 3), 0)


def test_row_parallel_splits_columns_and_adds_its_bias_once() -> None:
    weight, bias = torch.arange(12.0).view(2, 6), torch.tensor([1.0, 2.0])
    ranks = [RowParallelLinear(6, 2, True, DenseMethod(), Shard(r, 2)) for r in range(2)]
    for layer in ranks:
        layer.load_weight("weight", weight, None)
        layer.load_weight("bias", bias, None)
    assert torch.equal(torch.cat([r.weight for r in ranks], dim=1), weight)
    assert torch.equal(ranks[0].bias, bias) and torch.equal(ranks[1].bias, torch.zeros(2))
    x = torch.randn(5, 6)
    total = sum(r(x[:, i * 3:(i + 1) * 3]) for i, r in enumerate(ranks))  # (the all-reduce)
    torch.testing.assert_close(total, x @ weight.T + bias)


def test_the_last_ranks_padding_rows_are_zeros() -> None:
    vocab = torch.arange(5 * 2, dtype=torch.float32).view(5, 2) + 1
    heads = [ParallelLMHead(2, 5, DenseMethod(), Shard(r, 2)) for r in range(2)]
    for h in heads:
        h.load_weight("weight", vocab, None)
    assert torch.equal(heads[0].weight, vocab[:3])
    assert torch.equal(heads[1].weight, torch.cat([vocab[3:], torch.zeros(1, 2)]))


def test_checkpoint_names_map_to_the_fused_parameters() -> None:
    assert target_of("model.layers.3.self_attn.k_proj.bias") == (
        "model.layers.3.self_attn.qkv_proj.bias", 1)
    assert target_of("model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.gate_up_proj.weight", 1)
    assert target_of("model.norm.weight") == ("model.norm.weight", None)


def _load(folder: Path) -> torch.nn.Module:
    cpu = torch.device("cpu")
    backend = TorchBackend(EngineLimits(4, 16, 4, 64, 100), cpu)  # (not run)
    return load_model(folder, torch.float32, cpu, 64, backend, DenseMethod())


def test_an_entry_without_a_place_or_a_missing_one_is_named(tmp_path: Path) -> None:
    from pipeline.tools.random_model import build_random_llama

    folder = build_random_llama(tmp_path / "m", heads=4, kv_heads=2, num_layers=1)
    (path,) = folder.glob("*.safetensors")
    state = load_file(str(path))
    model = _load(folder)  # loads as it is, every parameter filled from its entry
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])
    save_file({**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="mlp.extra.weight: the model has no such parameter"):
        _load(folder)
    save_file({k: v for k, v in state.items() if "v_proj.weight" not in k}, str(path))
    with pytest.raises(ValueError, match=r"no model.layers.0.self_attn.qkv_proj.weight "
                                         r"\(parts \[2\] missing\)"):
        _load(folder)
