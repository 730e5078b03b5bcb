"""Every decoder layer in one call into the CPU kernels (csrc/decoder_layers.cpp), in the
executor process: the eager CPU forward's layers without the Python between their kernels.

The call runs the same kernels in the same order as the layers' own forward, so a step's
results are the same bits either way; what goes is ~10 module calls and op dispatches a
layer, which were a third of a one-token decode step of the default model (docs/BENCHMARKS.md
"Single stream"). It runs where the layers are exactly that sequence: the cpu_kernels
attention backend, one rank, every layer the pre-norm layer (blocks.py) or Gemma 2's and 3's
sandwich layer (gemma.py) with a dense SiLU or gelu-tanh MLP, per-head q/k norms or none (not
over the projections), no attention sinks (each layer kind says whether it is: `fast_path`),
every projection oneDNN-, MKL-, AMX- or AVX512-BF16-packed or quantized (plain F.linear
weights keep the Python layers). Layers may attend each their own way (window, softcap, rope
table: Gemma's alternating sliding and global layers); they share the query scale. `build`
decides, and logs why where a model's layers have no fast path; the model keeps the result as
`fused_layers` (None: the Python layers run)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from stages.executor.backends.base import LayerAttention
from stages.executor.linear.base import Linear
from stages.executor.lora import LoraMethod

logger = logging.getLogger(__name__)

(PACKED, QUANTIZED, AMX, AMX_GATED, MKL, VECTOR, VECTOR_GATED, QUANTIZED_AMX,
 QUANTIZED_AMX_GATED) = range(9)
# weights a layer (decoder_layers.cpp's Entry): the norms before attention and before the
# MLP, a weight and a bias a projection; then q and k norms, the sandwich layer's norms after
# attention and after the MLP (None where a layer has none)
PER_LAYER = 14
# ints a layer (after 3 shared): kind, bits, outputs a projection, then (LayerInt) whether
# its norms scale by 1 + w, its activation (ACTIVATIONS), window (0: none), rope table
# (an index into KernelMetadata.ropes, -1: the last, angle 0's) and KV group (an index into
# KernelMetadata.block_tables)
PER_LAYER_INTS = 17
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
QUANTIZED_METHODS = ("int8", "int4", "gguf")


def _projection(layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """(weight, bias, [kind, bits, outputs]) as decoder_layers takes a projection; None for a
    format it does not run. A projection with LoRA adapters gives its base format's weights:
    the call runs the steps without adapted rows (CausalLM.hidden_states)."""
    method = layer.method
    name = (method.base if isinstance(method, LoraMethod) else method).name
    if name == "onednn-packed":
        return layer.packed_weight, layer.bias, [PACKED, 0, layer.out_features]
    if name in QUANTIZED_METHODS and layer.products == "amx":
        kind = QUANTIZED_AMX_GATED if layer.fused_gate else QUANTIZED_AMX
        return layer.panels, layer.bias_f32, [kind, layer.bits, layer.out_features]
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


def _norm_weights(layer: Any) -> tuple[list[torch.Tensor | None], bool] | str:
    """[norm1, norm2, q norm, k norm, post-attention norm, post-MLP norm] (Entry's order, None
    where absent) and whether they scale by 1 + w; or why the layer's norms are not the
    call's (each of the layer's norms scales alike: one flag a layer)."""
    attn = layer.self_attn
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    norms = ([layer.input_layernorm, layer.pre_feedforward_layernorm, attn.q_norm,
              attn.k_norm, layer.post_attention_layernorm, layer.post_feedforward_layernorm]
             if sandwich else [layer.input_layernorm, layer.post_attention_layernorm,
                               attn.q_norm, attn.k_norm, None, None])
    offsets = {n.offset for n in norms if n is not None}
    if len(offsets) > 1:
        return "norms that scale by 1 + w beside norms that scale by w"
    return [None if n is None else n.weight for n in norms], offsets.pop()


class FusedLayers:
    """The arguments of llm_cpu.decoder_layers for one model, gathered once."""

    def __init__(self, weights: list[torch.Tensor | None], ints: list[int], eps: float,
                 kinds: list[LayerAttention]) -> None:
        self.weights, self.ints, self.eps = weights, ints, eps
        self.scale = kinds[0].scale
        self.softcaps = [k.softcap or 0.0 for k in kinds]
        # all but the last layer's (CausalLM.forward runs that one on some rows)
        self.first_weights = weights[:-PER_LAYER]
        self.first_ints = ints[:-PER_LAYER_INTS]
        self.first_softcaps = self.softcaps[:-1]
        self.op = torch.ops.llm_cpu.decoder_layers.default
        self._ropes: tuple[Any, list[torch.Tensor]] = (None, [])  # (meta.ropes, flattened)

    @classmethod
    def build(cls, model: Any) -> FusedLayers | None:
        """The fused call for `model` (a CausalLM, loaded and processed), or None where
        its layers are not the kernels' sequence (see the module's docstring)."""
        if (model.backend.name != "cpu_kernels" or model.tp is not None
                or not hasattr(torch.ops.llm_cpu, "decoder_layers")):
            return None
        layers = model.model.layers
        layer_norms = []
        for i, layer in enumerate(layers):
            fast = getattr(layer, "fast_path", None)
            why = fast() if fast is not None else f"{type(layer).__name__} has no fast path"
            if why is None and layer.self_attn.scale != layers[0].self_attn.scale:
                why = "its query scale differs from layer 0's"
            norms = _norm_weights(layer) if why is None else why
            if isinstance(norms, str):
                logger.info("the CPU's fused decoder layers are off for this model: layer %d: "
                            "%s; its layers run one by one", i, norms)
                return None
            layer_norms.append(norms)
        first = layers[0].self_attn
        ints = [first.num_heads, first.num_kv_heads, first.head_dim]
        weights: list[torch.Tensor | None] = []
        for layer, (norms, offset) in zip(layers, layer_norms, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_projection(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                               mlp.down_proj)]
            if any(p is None for p in parts):
                return None
            (qkv_w, qkv_b, qkv), (o_w, o_b, o), (gu_w, gu_b, gu), (dn_w, dn_b, dn) = parts
            weights += [norms[0], qkv_w, qkv_b, o_w, o_b, norms[1], gu_w, gu_b, dn_w, dn_b,
                        *norms[2:]]
            kind = attn.kind
            ints += qkv + o + gu + dn + [int(offset), ACTIVATIONS[mlp.activation],
                                         kind.window or 0, -1 if kind.rope is None else kind.rope,
                                         kind.table]
        return cls(weights, ints, model.spec.eps, [layer.self_attn.kind for layer in layers])

    def __call__(self, x: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any,
                 all_layers: bool = True) -> torch.Tensor:
        """x [T, hidden] through every layer, or all but the last (in place); meta: the
        cpu_kernels backend's. (Short of the last, the last call's closing add leaves the next
        norm to that layer: the same bits.)"""
        weights, ints, softcaps = ((self.weights, self.ints, self.softcaps) if all_layers
                                   else (self.first_weights, self.first_ints,
                                         self.first_softcaps))
        caches = kv_caches if all_layers else kv_caches[:-1]
        if not caches:
            return x
        if self._ropes[0] is not meta.ropes:  # (the backend's list, the same every step)
            self._ropes = (meta.ropes, [t for pair in meta.ropes for t in pair])
        return self.op(x, weights, ints, self.eps, self.scale, caches, meta.block_tables,
                       meta.token_slots, meta.positions, self._ropes[1], softcaps)
