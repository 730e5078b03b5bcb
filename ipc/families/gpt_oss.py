"""gpt-oss: a mixture of experts with attention sinks (a learned logit per head in each
softmax's denominator), alternating 128-token windows and full layers, YaRN rope, biased
attention, a biased router (softmax over the top k's logits) and biased experts with a clamped
SwiGLU, its experts shipped as MXFP4 blocks."""

from __future__ import annotations

from ipc.arch import (
    ArchSpec,
    AttentionKind,
    MoESpec,
    effective_window,
    layer_types,
    refuse,
    rope_parameters,
    shapes,
)


def gpt_oss_spec(cfg: dict, source: str) -> ArchSpec:
    count = cfg["num_hidden_layers"]
    window = effective_window(cfg, cfg.get("sliding_window"))
    quant = cfg.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise refuse(cfg, source, "quantization_config",
                     "only gpt-oss's own MXFP4 experts (or unquantized weights) load")
    kinds = tuple(AttentionKind(window=window if kind == "sliding_attention" else None,
                                sinks=True) for kind in layer_types(cfg, source, count))
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    return ArchSpec(
        **shapes(cfg), layers=kinds, ropes={"default": rope_parameters(cfg, source)},
        qkv_bias=bool(cfg.get("attention_bias", True)),
        o_bias=bool(cfg.get("attention_bias", True)),
        moe=MoESpec(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                    intermediate=cfg["intermediate_size"], routing="topk_softmax",
                    router_bias=True, expert_bias=True,
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702))))
