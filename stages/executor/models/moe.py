"""Qwen2-MoE, Qwen3-MoE, OLMoE and Mixtral (ipc/families/moe.py reads their configs): the
pre-norm layer of blocks.py with the MoE block of moe_block.py as its MLP (a dense one in the
layers the spec names); their attention's switches (biases, q/k norms, a window) are in the
spec, as for Llama. Mixtral's checkpoint names its MoE block and experts its own way."""

from __future__ import annotations

import re

from torch import nn

from ipc.arch import ArchSpec
from stages.executor.backends.base import AttentionBackend
from stages.executor.linear.base import LinearMethod
from stages.executor.models.base import CausalLM
from stages.executor.models.blocks import DecoderLayer
from stages.executor.models.moe_block import sparse_mlp
from stages.executor.sharding import Shard


class MoECausalLM(CausalLM):
    """Checkpoint names as transformers saves Qwen-MoE's and OLMoE's: mlp.gate (the router),
    mlp.experts.E.{gate,up,down}_proj, mlp.shared_expert(_gate)."""

    def make_layer(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                   linear: LinearMethod, shard: Shard) -> nn.Module:
        mlp = sparse_mlp(spec, layer_idx, backend.ops, linear, shard)
        return DecoderLayer(spec, layer_idx, backend, linear, shard, mlp)


# Mixtral's expert projections: w1 the gate, w3 the up, w2 the down
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class Mixtral(MoECausalLM):
    def checkpoint_name(self, name: str) -> str | None:
        name = _MIXTRAL_EXPERT.sub(
            lambda m: f".mlp.experts.{m[1]}.{_MIXTRAL_PROJ[m[2]]}.", name)
        return name.replace(".block_sparse_moe.", ".mlp.")
