"""Gemma, Gemma 2 and Gemma 3 (ipc/families/gemma.py reads their configs), in the executor
process: embeddings scaled by sqrt(hidden), norms scaling by 1 + w (blocks.RMSNorm's offset),
the final logits softcapped where the config says; Gemma (1) stacks Llama's pre-norm layer,
Gemma 2 and 3 the sandwich layer here (a norm before and after attention and MLP each). How
each layer attends (its window, its softcap, its rope) is in the spec, for the backend. The
multimodal Gemma 3 runs its language model: the vision tower's entries are not loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ipc.arch import ArchSpec
from ipc.families.gemma import text_config
from stages.executor.backends.base import AttentionBackend
from stages.executor.linear.base import LinearMethod
from stages.executor.models.base import CausalLM
from stages.executor.models.blocks import (
    Attention,
    DecoderLayer,
    RMSNorm,
    attention_fast_path,
    dense_mlp,
    mlp_fast_path,
)
from stages.executor.sharding import Shard

if TYPE_CHECKING:
    from stages.executor.parallel import PipelineParallel, TensorParallel

# A multimodal checkpoint's prefixes: its language model's (as transformers 5.25 saves them,
# and as it loads them), the model's names for them; None: entries not loaded (the vision
# tower and its projector).
MULTIMODAL_PREFIXES: dict[str, str | None] = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "vision_tower.": None,
    "model.vision_tower.": None,
    "multi_modal_projector.": None,
    "model.multi_modal_projector.": None,
}


class SandwichLayer(nn.Module):
    """Gemma 2's and 3's layer: x + post_attention_norm(attn(input_norm(x))), then
    + post_feedforward_norm(mlp(pre_feedforward_norm(...))), rounded as transformers'."""

    def __init__(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                 linear: LinearMethod, shard: Shard) -> None:
        super().__init__()
        ops = self.ops = backend.ops
        self.self_attn = Attention(spec, layer_idx, backend, linear, shard)
        self.mlp = dense_mlp(spec, ops, linear, shard)
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps, ops, offset=True)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps, ops, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden, spec.eps, ops, offset=True)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden, spec.eps, ops, offset=True)

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], or the rows `keep` [S] of it (their order)."""
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), kv_cache,
                                                         meta, keep))
        if keep is not None:
            x = x[keep]
        norm = self.pre_feedforward_layernorm
        x, h = self.ops.add_rms_norm(x, h, norm.weight, norm.eps, offset=True)
        return self.ops.add(x, self.post_feedforward_layernorm(self.mlp(h)))

    def fast_path(self) -> str | None:
        """(fused.py runs this layer's sequence: its norms are entries of the call's per-layer
        record.)"""
        return attention_fast_path(self.self_attn) or mlp_fast_path(self.mlp)


class Gemma(CausalLM):
    def __init__(self, cfg: dict, spec: ArchSpec, backend: AttentionBackend,
                 linear: LinearMethod, tp: TensorParallel | None = None,
                 stage: PipelineParallel | None = None) -> None:
        # (the rope tables read the language model's config: a multimodal one's text_config)
        super().__init__(text_config(cfg), spec, backend, linear, tp, stage)
        self.multimodal = cfg.get("model_type") == "gemma3"

    def make_layer(self, spec: ArchSpec, layer_idx: int, backend: AttentionBackend,
                   linear: LinearMethod, shard: Shard) -> nn.Module:
        if spec.norms == "sandwich":
            return SandwichLayer(spec, layer_idx, backend, linear, shard)
        return DecoderLayer(spec, layer_idx, backend, linear, shard)

    def checkpoint_name(self, name: str) -> str | None:
        if not self.multimodal:
            return name
        for prefix, ours in MULTIMODAL_PREFIXES.items():
            if name.startswith(prefix):
                return None if ours is None else ours + name[len(prefix):]
        return name

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.model.embed_tokens is not None  # (a pipeline's first stage embeds)
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        # sqrt(hidden) as transformers keeps it: a float32 tensor, rounded to the dtype
        return x * torch.tensor(self.spec.hidden**0.5).to(x.dtype)  # type: ignore[no-any-return]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None  # (the last stage's)
        logits = self.lm_head(x)
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits  # type: ignore[no-any-return]
