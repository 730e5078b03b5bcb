"""Layers that own their tensor-parallel sharding (Megatron-style, as nano-vllm's), in the
executor process. Each is built with this rank's shapes and loads its own part of a
checkpoint tensor (`load_weight`, from a lazily sliced safetensors entry, so no rank reads
the whole), the same code for one rank (size 1: the whole tensor) or many:

- ColumnParallelLinear: output rows split; a fused projection (q/k/v, gate/up) splits each of
  its parts, and loads them from the parts' own tensors or from a fused one;
- a q/k norm over a whole projection (blocks.RMSNorm with a shard): its weight's rows split
  as the projection's heads are (copy_rows);
- RowParallelLinear: input columns split, the ranks' partial outputs summed (one all-reduce);
  a bias is added once (rank 0's, zeros elsewhere);
- VocabParallelEmbedding / ParallelLMHead: rows of the vocabulary split (padded to a multiple
  of the size with zero rows); a token outside a rank's range looks up zeros, an all-reduce
  sums; the logits are gathered on rank 0 by the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from stages.executor.linear.base import Linear, LinearMethod


class Collectives(Protocol):
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`; `comm` sums across them (None when size is 1)."""

    rank: int = 0
    size: int = 1
    comm: Collectives | None = None

    def local(self, n: int) -> int:
        return n // self.size

    def vocab_rows(self, vocab: int) -> int:
        """Rows per rank of a vocabulary padded to a multiple of the size."""
        return -(-vocab // self.size)

    def vocab_part(self, vocab: int) -> tuple[int, int]:
        """This rank's rows of the vocabulary."""
        start = self.rank * self.vocab_rows(vocab)
        return start, min(start + self.vocab_rows(vocab), vocab)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.comm is None else self.comm.all_reduce(x)


WHOLE = Shard()  # one rank: every tensor whole (a default for layers that may be split)

Loaded = Any  # a checkpoint entry, sliceable (safetensors' lazy slice, or a tensor)


def copy_whole(param: torch.Tensor, loaded: Loaded) -> None:
    """A replicated parameter (norms): the whole entry."""
    value = loaded[:]
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(value.shape)} where the model has {tuple(param.shape)}")
    param.data.copy_(value)


def copy_rows(param: torch.Tensor, loaded: Loaded, shard: Shard) -> None:
    """A vector split across the ranks as a projection's outputs are (the q/k norms over the
    whole projections: each rank's heads' rows); the whole entry read (a few bytes) to check
    its size, this rank's rows kept (size 1: all of them)."""
    whole = loaded[:]
    rows = param.shape[0]
    if tuple(whole.shape) != (rows * shard.size,):
        raise ValueError(f"shape {tuple(whole.shape)} where the model has "
                         f"{(rows * shard.size,)} ({shard.size} ranks of {rows})")
    param.data.copy_(whole[shard.rank * rows:(shard.rank + 1) * rows])


class ColumnParallelLinear(Linear):
    """y[:, this rank's rows] = x W_part^T; `parts`: the global sizes of the fused
    projections' outputs (one part: a plain column-parallel layer)."""

    def __init__(self, in_features: int, parts: Sequence[int], bias: bool,
                 method: LinearMethod, shard: Shard) -> None:
        self.parts, self.shard = tuple(parts), shard
        super().__init__(in_features, sum(shard.local(p) for p in parts), bias, method)

    def load_weight(self, name: str, loaded: Loaded, part: int | None) -> None:
        """Part `part` of the fused output from its own entry, or (None) every part from a
        fused entry."""
        param = getattr(self, name)
        which = range(len(self.parts)) if part is None else [part]
        for j in which:
            local = self.shard.local(self.parts[j])
            dst = sum(self.shard.local(p) for p in self.parts[:j])  # this rank's layout
            src = (sum(self.parts[:j]) if part is None else 0) + self.shard.rank * local
            value = loaded[src:src + local]
            want = (local, *param.shape[1:])
            if tuple(value.shape) != want:
                raise ValueError(f"rows {src}:{src + local} of the entry have shape "
                                 f"{tuple(value.shape)}, the model's part {want}")
            param.data[dst:dst + local].copy_(value)


class RowParallelLinear(Linear):
    """y = sum over ranks of x[:, rank's columns] W[:, rank's columns]^T (+ b, once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 method: LinearMethod, shard: Shard) -> None:
        self.shard = shard
        super().__init__(shard.local(in_features), out_features, bias, method)

    def load_weight(self, name: str, loaded: Loaded, part: int | None) -> None:
        param = getattr(self, name)
        if name == "bias":  # added once: rank 0's, zeros elsewhere (the all-reduce sums)
            if self.shard.rank == 0:
                copy_whole(param, loaded)
            else:
                param.data.zero_()
            return
        start = self.shard.rank * self.in_features
        param.data.copy_(loaded[:, start:start + self.in_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard.reduce(super().forward(x))


def _load_vocab_rows(param: torch.Tensor, loaded: Loaded, shard: Shard, vocab: int) -> None:
    """This rank's vocabulary rows; rows past the vocabulary (the last rank's padding) are
    zeros: their logits are dropped."""
    start, end = shard.vocab_part(vocab)
    param.data.zero_()
    param.data[:end - start].copy_(loaded[start:end])


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, shard: Shard) -> None:
        super().__init__()
        self.vocab_size, self.shard = vocab_size, shard
        self.weight = nn.Parameter(torch.empty(shard.vocab_rows(vocab_size), hidden),
                                   requires_grad=False)

    def load_weight(self, name: str, loaded: Loaded, part: int | None) -> None:
        _load_vocab_rows(self.weight, loaded, self.shard, self.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return nn.functional.embedding(ids, self.weight)
        start, end = self.shard.vocab_part(self.vocab_size)
        local = ids - start
        outside = (local < 0) | (local >= end - start)
        x = nn.functional.embedding(torch.where(outside, 0, local), self.weight)
        return self.shard.reduce(x.masked_fill(outside.unsqueeze(1), 0))


class ParallelLMHead(Linear):
    """This rank's vocabulary rows of the logits ([S, V / size]; the model gathers them)."""

    def __init__(self, hidden: int, vocab_size: int, method: LinearMethod,
                 shard: Shard) -> None:
        self.vocab_size, self.shard = vocab_size, shard
        super().__init__(hidden, shard.vocab_rows(vocab_size), False, method)

    def load_weight(self, name: str, loaded: Loaded, part: int | None) -> None:
        _load_vocab_rows(self.weight, loaded, self.shard, self.vocab_size)
