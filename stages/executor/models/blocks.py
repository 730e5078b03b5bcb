"""The parts every family's model is built from, in the executor process: norms, attention
over the backend's paged cache, the gated MLP, the pre-norm decoder layer and the backbone
that stacks a family's layers. Parameter names match Hugging Face's except where projections
are fused: q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` per layer (one
matrix product each instead of three and two), which the loader fills from the checkpoint's
parts (loader.py). The layers own their tensor-parallel sharding (sharding.py). Each layer's
elementwise work goes through its backend's ops (backends/base.py), each projection through
its linear method (linear/)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ipc.arch import ArchSpec
from stages.executor.backends.base import (
    TORCH_OPS,
    AttentionBackend,
    ForwardOps,
    scale_by_rms,
)
from stages.executor.linear.base import LinearMethod
from stages.executor.sharding import (
    WHOLE,
    ColumnParallelLinear,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    copy_rows,
)


class RMSNorm(nn.Module):
    """offset: Gemma's, the weight stored as w - 1 (scaling by 1 + w, ForwardOps.rms_norm).
    shard: the ranks its width is split across, as a projection's heads are (a q/k norm over
    the whole projection: this rank's `size` rows of the weight); WHOLE: whole on every
    rank."""

    def __init__(self, size: int, eps: float, ops: ForwardOps = TORCH_OPS,
                 offset: bool = False, shard: Shard = WHOLE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.ops, self.offset, self.shard = eps, ops, offset, shard

    def load_weight(self, name: str, loaded: Any, part: int | None) -> None:
        copy_rows(self.weight, loaded, self.shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.offset)

    def normalize(self, x: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        """x [T, size], this rank's slice, scaled by the whole width's mean_square [T, 1]
        (float32), rounded as `forward` in PyTorch's ops."""
        return scale_by_rms(x, mean_square, self.weight, self.eps, self.offset)


class Attention(nn.Module):
    """This rank's heads: q/k/v column-parallel by head, o row-parallel. How it attends
    (window, softcap, rope table) is its layer's AttentionKind, handed to the backend.
    `make_norm`: the family's RMSNorm for its q/k norms (spec.qk_norm), by size, eps and the
    ranks its width is split across (RMSNorm's `shard`)."""

    def __init__(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 linear: LinearMethod, shard: Shard,
                 make_norm: Callable[[int, float, Shard], RMSNorm] | None = None) -> None:
        super().__init__()
        d = self.head_dim = spec.head_dim
        self.num_heads, self.num_kv_heads = shard.local(spec.num_heads), shard.local(
            spec.num_kv_heads)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden, (spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d),
            spec.qkv_bias, linear, shard)
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden, spec.o_bias, linear,
                                        shard)
        # Norms of the queries and keys (PyTorch's ops): each head's ("head", Qwen3 and
        # Gemma 3: [T, heads, D]; whole on every rank) or the whole projections' ("proj",
        # OLMo 2, OLMoE: [T, heads * D], before the split into heads; split across the ranks
        # as the heads are, `_norm_projections`)
        self.qk_norm = spec.qk_norm
        norm = make_norm or (lambda size, eps, split: RMSNorm(
            size, eps, offset=spec.norm_offset, shard=split))
        q_size, k_size, split = ((d, d, WHOLE) if spec.qk_norm == "head"
                                 else (self.q_size, self.kv_size, shard))
        self.q_norm = norm(q_size, spec.eps, split) if spec.qk_norm is not None else None
        self.k_norm = norm(k_size, spec.eps, split) if spec.qk_norm is not None else None
        self.layer_idx, self.backend, self.shard = layer_idx, backend, shard
        self.kind = backend.layer_attention(spec, layer_idx)
        self.scale = self.kind.scale
        # Each of this rank's heads' sink logit (gpt-oss; AttentionKind.sinks)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if self.kind.sinks else None

    def load_weight(self, name: str, loaded: Any, part: int | None) -> None:
        """The sinks: this rank's heads' (the attention's only parameter of its own)."""
        whole = loaded[:]  # [heads] (a few bytes: read whole)
        if tuple(whole.shape) != (self.num_heads * self.shard.size,):
            raise ValueError(f"{name} of shape {tuple(whole.shape)} where the model has "
                             f"{self.num_heads * self.shard.size} heads")
        start = self.shard.rank * self.num_heads
        getattr(self, name).data.copy_(whole[start:start + self.num_heads])

    def _norm_projections(self, q: torch.Tensor, k: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The RMSNorms of the whole q [T, H * D] and k [T, KVH * D] projections. Across
        ranks each holds its heads' slice: their sums of squares are added (one all-reduce of
        [T, 2], q's and k's together) and divided by the whole width, as one rank's mean
        would (the same sum, in another order), and each rank scales its slice by its rows
        of the weights."""
        q_norm, k_norm = self.q_norm, self.k_norm
        assert q_norm is not None and k_norm is not None
        if self.shard.size == 1:
            return q_norm(q), k_norm(k)
        sums = torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)], dim=-1)
        sums = self.shard.reduce(sums)  # [T, 2]: over every rank's heads
        size = self.shard.size
        return (q_norm.normalize(q, sums[:, :1] / (self.q_size * size)),
                k_norm.normalize(k, sums[:, 1:] / (self.kv_size * size)))

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Every row's keys and values go into the cache; the output is of every row, or of
        the rows `keep` only (CausalLM.forward's last layer)."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "proj":
            q, k = self._norm_projections(q, k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head" and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.backend.attend(q, k, v, kv_cache, meta, self.kind,  # ropes q and k
                                  self.sinks)
        if keep is not None:
            out = out[keep]
        return self.o_proj(out.flatten(1))  # (summed over the ranks)


class GatedMLP(nn.Module):
    """act(x W_gate) * (x W_up) W_down over this rank's intermediate rows: gate/up
    column-parallel, down row-parallel. `act_and_mul`: the backend's op for the family's
    activation (its `activation` names which)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, activation: str,
                 ops: ForwardOps, linear: LinearMethod, shard: Shard) -> None:
        super().__init__()
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] = ops.act_and_mul(activation)
        self.activation = activation
        self.gate_up_proj = ColumnParallelLinear(hidden, (intermediate, intermediate), bias,
                                                 linear, shard)
        self.gate_up_proj.gated = activation == "silu"  # (AMX fuses SiLU-and-mul)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, linear, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated_forward(x, self.act_and_mul))


def dense_mlp(spec: ArchSpec, ops: ForwardOps, linear: LinearMethod, shard: Shard) -> GatedMLP:
    return GatedMLP(spec.hidden, spec.intermediate, spec.mlp_bias, spec.activation, ops,
                    linear, shard)


class DecoderLayer(nn.Module):
    """A pre-norm layer (Llama's): x + attn(norm(x)), then + mlp(norm(...)). `mlp`: the
    family's (dense_mlp, or a mixture of experts)."""

    def __init__(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 linear: LinearMethod, shard: Shard, mlp: nn.Module | None = None) -> None:
        super().__init__()
        ops = backend.ops
        self.self_attn = Attention(spec, layer_idx, backend, linear, shard)
        self.mlp = mlp if mlp is not None else dense_mlp(spec, ops, linear, shard)
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps, ops, spec.norm_offset)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps, ops, spec.norm_offset)
        self.ops = ops

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], or the rows `keep` [S] of it (their order)."""
        h = self.self_attn(self.input_layernorm(x), kv_cache, meta, keep)
        if keep is not None:
            x = x[keep]
        norm = self.post_attention_layernorm
        # (the add and the norm fused where they can be)
        x, h = self.ops.add_rms_norm(x, h, norm.weight, norm.eps, norm.offset)
        return self.ops.add(x, self.mlp(h))

    def fast_path(self) -> str | None:
        """Why this layer is not the sequence the fused CPU call runs (fused.py), or None
        where it is: the pre-norm layer with a dense SiLU or gelu-tanh MLP (an MLP that is
        never that sequence says why itself: its `fast_path`), per-head q/k norms or none."""
        return attention_fast_path(self.self_attn) or mlp_fast_path(self.mlp)


def attention_fast_path(attn: Attention) -> str | None:
    """Why `attn` is not the fused CPU call's attention (fused.py, csrc/decoder_layers.cpp),
    or None: no sinks, and per-head q/k norms in PyTorch's ops (RMSNorm's: the call runs
    them as their forward does) or none."""
    if attn.sinks is not None:
        return "attention sinks (gpt-oss)"
    if attn.qk_norm == "proj":
        return "q/k norms over the whole projections (OLMoE)"
    for norm in (attn.q_norm, attn.k_norm):
        if norm is not None and (type(norm) is not RMSNorm or norm.ops is not TORCH_OPS):
            return f"q/k norms of their own ({type(norm).__name__})"
    return None


def mlp_fast_path(mlp: nn.Module) -> str | None:
    """Why `mlp` is not the fused CPU call's MLP, or None: a dense gated MLP of an activation
    the call runs (SiLU, gelu-tanh)."""
    own = getattr(mlp, "fast_path", None)
    if own is not None:
        return own()  # type: ignore[no-any-return]
    if not isinstance(mlp, GatedMLP) or mlp.activation not in ("silu", "gelu_tanh"):
        return f"its MLP ({type(mlp).__name__}, {getattr(mlp, 'activation', '')})"
    return None


LayerFactory = Callable[[ArchSpec, int, AttentionBackend, LinearMethod, Shard], nn.Module]


class Backbone(nn.Module):
    """The embedding, the family's layers (`make_layer`) and the final norm (`norm`: the
    family's RMSNorm of the hidden size). A pipeline stage's holds `layers` only (indexed from
    0 here, built as the model's layers of those indices) and the embedding or the norm only
    where it runs them (`embed`, `final_norm`)."""

    def __init__(self, spec: ArchSpec, backend: AttentionBackend, linear: LinearMethod,
                 shard: Shard, make_layer: LayerFactory,
                 norm: nn.Module | None = None, layers: range | None = None,
                 embed: bool = True, final_norm: bool = True) -> None:
        super().__init__()
        # Built on the meta device, given memory and filled by the loader: no initial values.
        # (nn.Embedding, initialising itself on meta, would go through torch._refs, which
        # imports torch._dynamo: 1.5 s of every executor's start.)
        self.embed_tokens = (VocabParallelEmbedding(spec.vocab_size, spec.hidden, shard)
                             if embed else None)
        self.layers = nn.ModuleList(make_layer(spec, i, backend, linear, shard)
                                    for i in (layers or range(spec.num_layers)))
        self.norm = ((norm if norm is not None else RMSNorm(spec.hidden, spec.eps, backend.ops,
                                                             spec.norm_offset))
                     if final_norm else None)
