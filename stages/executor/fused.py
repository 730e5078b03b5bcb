"""Every decoder layer in one call into the CPU kernels (csrc/decoder_layers.cpp), in the
executor process: the eager CPU forward's layers without the Python between their kernels.

The call runs the same kernels in the same order as the layers' own forward, so a step's
results are the same bits either way; what goes is ~10 module calls and op dispatches a
layer, which were a third of a one-token decode step of the default model (docs/BENCHMARKS.md
"Single stream"). It runs where the layers are exactly that sequence: the cpu_kernels
attention backend, one rank, every layer the pre-norm layer with a dense SiLU MLP and no
q/k norms, per head or over the projections (each layer kind says whether it is:
`fast_path`), attending alike, and every projection oneDNN-, MKL-, AMX- or AVX512-BF16-packed
or quantized (plain F.linear weights keep the Python layers). `build` decides, and logs why
where a model's layers have no fast path; the model keeps the result as `fused_layers` (None:
the Python layers run)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from stages.executor.backends.base import LayerAttention
from stages.executor.linear.base import Linear

logger = logging.getLogger(__name__)

PACKED, QUANTIZED, AMX, AMX_GATED, MKL, VECTOR, VECTOR_GATED = 0, 1, 2, 3, 4, 5, 6
PER_LAYER = 10  # weights a layer: two norms, and a weight and a bias a projection
PER_LAYER_INTS = 12  # ints a layer: kind, bits, outputs a projection (after 3 shared)
QUANTIZED_METHODS = ("int8", "int4", "gguf")


def _projection(layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """(weight, bias, [kind, bits, outputs]) as decoder_layers takes a projection; None for a
    format it does not run."""
    name = layer.method.name
    if name == "onednn-packed":
        return layer.packed_weight, layer.bias, [PACKED, 0, layer.out_features]
    if name in QUANTIZED_METHODS:
        return layer.tiles, layer.bias_f32, [QUANTIZED, layer.bits, layer.out_features]
    if name == "mkl-packed":
        return layer.mkl_weight, layer.bias, [MKL, layer.mkl_one_row, layer.out_features]
    if name == "amx-bf16":
        kind = AMX_GATED if layer.fused_gate else AMX
        return layer.amx_weight, layer.bias_f32, [kind, 0, layer.out_features]
    if name == "avx512-bf16":
        kind = VECTOR_GATED if layer.fused_gate else VECTOR
        return layer.amx_weight, layer.bias_f32, [kind, 0, layer.out_features]
    return None


class FusedLayers:
    """The arguments of llm_cpu.decoder_layers for one model, gathered once."""

    def __init__(self, weights: list[torch.Tensor | None], ints: list[int], eps: float,
                 layer: LayerAttention) -> None:
        self.weights, self.ints, self.eps, self.layer = weights, ints, eps, layer
        # all but the last layer's (CausalLM.forward runs that one on some rows)
        self.first_weights = weights[:-PER_LAYER]
        self.first_ints = ints[:-PER_LAYER_INTS]
        self.op = torch.ops.llm_cpu.decoder_layers.default

    @classmethod
    def build(cls, model: Any) -> FusedLayers | None:
        """The fused call for `model` (a CausalLM, loaded and processed), or None where
        its layers are not the kernels' sequence (see the module's docstring)."""
        if (model.backend.name != "cpu_kernels" or model.tp is not None
                or not hasattr(torch.ops.llm_cpu, "decoder_layers")):
            return None
        for i, layer in enumerate(model.model.layers):
            fast = getattr(layer, "fast_path", None)
            why = fast() if fast is not None else f"{type(layer).__name__} has no fast path"
            if why is None and layer.self_attn.kind != model.model.layers[0].self_attn.kind:
                why = "its attention differs from layer 0's"
            if why is not None:
                logger.info("the CPU's fused decoder layers are off for this model: layer %d: "
                            "%s; its layers run one by one", i, why)
                return None
        first = model.model.layers[0].self_attn
        ints = [first.num_heads, first.num_kv_heads, first.head_dim]
        weights: list[torch.Tensor | None] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_projection(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                               mlp.down_proj)]
            if any(p is None for p in parts):
                return None
            (qkv_w, qkv_b, qkv), (o_w, o_b, o), (gu_w, gu_b, gu), (dn_w, dn_b, dn) = parts
            weights += [layer.input_layernorm.weight, qkv_w, qkv_b, o_w, o_b,
                        layer.post_attention_layernorm.weight, gu_w, gu_b, dn_w, dn_b]
            ints += qkv + o + gu + dn
        return cls(weights, ints, model.spec.eps, first.kind)

    def __call__(self, x: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any,
                 all_layers: bool = True) -> torch.Tensor:
        """x [T, hidden] through every layer, or all but the last (in place); meta: the
        cpu_kernels backend's. (Short of the last, the last call's closing add leaves the next
        norm to that layer: the same bits.)"""
        weights, ints = ((self.weights, self.ints) if all_layers
                         else (self.first_weights, self.first_ints))
        caches = kv_caches if all_layers else kv_caches[:-1]
        if not caches:
            return x
        cos, sin = meta.rope(self.layer)
        return self.op(x, weights, ints, self.eps, self.layer.scale, caches, meta.block_table,
                       meta.token_slots, meta.positions, cos, sin, self.layer.window or 0)
