"""OLMo 2 and OLMo 3 (ipc/families/olmo.py reads their configs), in the executor process: a
post-norm layer, x + norm(attn(x)) then + norm(mlp(...)), over attention whose q and k are
normed across every head before the split into heads (blocks.Attention, qk_norm "proj";
across tensor-parallel ranks too);
OLMo 3's sliding and full layers differ only in their AttentionKind."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ipc.arch import ArchSpec
from stages.executor.backends.base import AttentionBackend
from stages.executor.linear.base import LinearMethod
from stages.executor.models.base import CausalLM
from stages.executor.models.blocks import Attention, RMSNorm, dense_mlp
from stages.executor.sharding import WHOLE, Shard


class OlmoRMSNorm(RMSNorm):
    """Olmo2RMSNorm: as Llama's, but the weight multiplies in float32 before the cast back
    (in bfloat16 the other order rounds differently); in PyTorch's ops. `shard` as
    RMSNorm's (the q/k norms split across ranks)."""

    def __init__(self, size: int, eps: float, shard: Shard = WHOLE) -> None:
        super().__init__(size, eps, shard=shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, x.float().pow(2).mean(-1, keepdim=True))

    def normalize(self, x: torch.Tensor, mean_square: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * torch.rsqrt(mean_square + self.eps)
        return (self.weight * x).to(dtype)


class OlmoDecoderLayer(nn.Module):
    """x + post_attention_layernorm(attn(x)), then + post_feedforward_layernorm(mlp(...)):
    no norm before either."""

    def __init__(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 linear: LinearMethod, shard: Shard) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, backend, linear, shard, OlmoRMSNorm)
        self.mlp = dense_mlp(spec, backend.ops, linear, shard)
        self.post_attention_layernorm = OlmoRMSNorm(spec.hidden, spec.eps)
        self.post_feedforward_layernorm = OlmoRMSNorm(spec.hidden, spec.eps)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], or the rows `keep` [S] of it (their order). New
        tensors, never x in place (a compiled layer must not mutate its input)."""
        h = self.self_attn(x, kv_cache, meta, keep)
        if keep is not None:
            x = x[keep]
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(x))

    def fast_path(self) -> str | None:
        """The fused CPU call runs pre-norm layers only."""
        return "post-norm layers (OLMo 2)"


class Olmo(CausalLM):
    def make_final_norm(self, spec: ArchSpec) -> nn.Module:
        return OlmoRMSNorm(spec.hidden, spec.eps)  # (its rounding, as the layers')

    def make_layer(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                   linear: LinearMethod, shard: Shard) -> nn.Module:
        return OlmoDecoderLayer(spec, layer_idx, backend, linear, shard)
