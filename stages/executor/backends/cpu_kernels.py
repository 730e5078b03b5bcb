"""Attention and a layer's elementwise work through the C++ CPU kernels (kernels.py,
csrc/cpu_kernels.cpp), in the executor process: the eager default on the CPU. One attention
call per layer over the whole flattened batch ropes this step's keys and queries, writes the
cache and reads it in place (nothing gathered or padded), softcapping the scores where the
layer says and a head's sink logit joining its softmax where the layer has them; RMSNorm with
the residual add fused into each layer's second norm; SiLU- and gelu-tanh-and-mul."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stages.executor.backends.base import (
    AttentionBackend,
    ForwardOps,
    ForwardTables,
    LayerAttention,
)
from stages.executor.staging import DeviceStep


class KernelOps(ForwardOps):
    """torch.ops.llm_cpu's norms (2-D contiguous inputs), SiLU- and gelu-tanh-and-mul; the
    residual stream is updated in place (the eager forward owns it)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: bool = False) -> torch.Tensor:
        if offset:  # (Gemma's: x / rms(x) * (1 + w) in float32, rounded once)
            return torch.ops.llm_cpu.rms_norm_offset(x, weight, eps)
        return torch.ops.llm_cpu.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                     eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if offset:
            return x, torch.ops.llm_cpu.add_rms_norm_offset(x, h, weight, eps)
        return x, torch.ops.llm_cpu.add_rms_norm(x, h, weight, eps)  # x += h, in place

    def add(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x.add_(h)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.llm_cpu.silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.llm_cpu.gelu_tanh_and_mul(gate_up)


@dataclass
class KernelMetadata:
    block_tables: Sequence[torch.Tensor]  # per KV group: [slots, max_blocks] int32
    token_slots: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    # (cos, sin) [max_len, D] float32 per rope kind: the model's tables (rounded to its
    # dtype); the last pair: a rope of angle 0 (cos 1, sin 0), for layers without rope
    ropes: list[tuple[torch.Tensor, torch.Tensor]]

    def rope(self, layer: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables `layer` ropes by (angle 0 for a layer without rope)."""
        return self.ropes[-1 if layer.rope is None else layer.rope]


def kernel_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, meta: KernelMetadata,
                           layer: LayerAttention,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's, before rope), kv_cache
    [2, NB, BS, KVH, D] -> [T, H, D]. One call: rope, the cache write, attention (sinks
    [H]: each head's logit in its softmax's denominator, read in float32)."""
    cos, sin = meta.rope(layer)
    return torch.ops.llm_cpu.paged_attention(
        q, k, v, kv_cache, meta.block_tables[layer.table], meta.token_slots, meta.positions,
        cos, sin,
        layer.scale, layer.window or 0, layer.softcap or 0.0,
        None if sinks is None else sinks.float().contiguous())


class CpuKernelBackend(AttentionBackend):
    """The eager CPU forward on torch.ops.llm_cpu (loaded by select.py before this is made).
    Needs no staging fields of its own: the block table, each token's slot and position."""

    name = "cpu_kernels"
    ops = KernelOps()
    softcap = True
    sinks = True

    def bind(self, tables: ForwardTables) -> None:
        super().bind(tables)
        # The kernel reads the tables in float32, holding the values of the model's dtype;
        # a layer without rope takes one of angle 0 (its keys and queries as they are).
        self._ropes = [(cos.float().contiguous(), sin.float().contiguous())
                       for cos, sin in tables.ropes]
        if self._ropes:
            cos = self._ropes[0][0]
            self._ropes.append((torch.ones_like(cos), torch.zeros_like(cos)))

    def metadata(self, v: DeviceStep, plan: Any) -> KernelMetadata:
        return KernelMetadata(self.tables.block_tables, v.token_slots, v.positions,
                              self._ropes)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, meta: KernelMetadata,
               layer: LayerAttention, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return kernel_paged_attention(q, k, v, kv_cache, meta, layer, sinks)
