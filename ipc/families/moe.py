"""Mixtures of experts whose attention is Llama's with switches: Qwen2-MoE (q/k/v biases, a
shared expert scaled by a sigmoid gate), Qwen3-MoE (RMSNorm over each head's q and k), Mixtral
(a sliding window, the router's weights kept in float32) and OLMoE (RMSNorm over the whole q
and k projections). Each reads its experts into a MoESpec (ipc/arch.py); the executor's MoE
block is stages/executor/models/moe_block.py."""

from __future__ import annotations

from ipc.arch import (
    ArchSpec,
    AttentionKind,
    MoESpec,
    check_activation,
    effective_window,
    layer_types,
    refuse,
    rope_parameters,
    shapes,
)


def _attention_layers(cfg: dict, source: str, window: int | None) -> tuple[AttentionKind, ...]:
    if cfg.get("use_sliding_window"):
        raise refuse(cfg, source, "use_sliding_window",
                     "per-layer sliding windows (Qwen's max_window_layers) are not implemented")
    if len(set(layer_types(cfg, source, cfg["num_hidden_layers"]))) > 1:
        raise refuse(cfg, source, "layer_types",
                     "layers of different attention kinds are not implemented for this family")
    return (AttentionKind(window=window),) * cfg["num_hidden_layers"]


def _num_experts(cfg: dict) -> int:
    # (Qwen3-MoE's config class saves num_experts as num_local_experts; real ones say either)
    return int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)


def qwen_moe_spec(cfg: dict, source: str) -> ArchSpec:
    """Qwen2-MoE and Qwen3-MoE: layer i's MLP is sparse unless i is in mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step (transformers' Qwen*MoeDecoderLayer)."""
    family = cfg["model_type"]
    check_activation(cfg, source, {"silu": "silu"})
    num_layers, num_experts = cfg["num_hidden_layers"], _num_experts(cfg)
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise refuse(cfg, source, "decoder_sparse_step", "must be at least 1")
    only_dense = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers)
                  if i in only_dense or num_experts == 0 or (i + 1) % step)
    qwen2 = family == "qwen2_moe"
    shared = int(cfg.get("shared_expert_intermediate_size", 0) or 0) if qwen2 else 0
    moe = MoESpec(
        num_experts=num_experts, top_k=int(cfg.get("num_experts_per_tok", 1)),
        intermediate=int(cfg.get("moe_intermediate_size", 0)),
        norm_topk=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate=shared, shared_gate=shared > 0, dense_layers=dense)
    attention_bias = bool(cfg.get("attention_bias", False))
    return ArchSpec(
        **shapes(cfg), layers=_attention_layers(cfg, source, None),
        ropes={"default": rope_parameters(cfg, source)},
        qkv_bias=bool(cfg.get("qkv_bias", True)) if qwen2 else attention_bias,
        o_bias=not qwen2 and attention_bias,
        qk_norm=None if qwen2 else "head",
        moe=moe if len(dense) < num_layers else None)


def mixtral_spec(cfg: dict, source: str) -> ArchSpec:
    """Mixtral: every layer sparse; transformers renormalises the top k of a softmax over every
    expert (the same as a softmax over the top k's logits, but rounded as that) and scales the
    experts' outputs by those float32 weights."""
    check_activation(cfg, source, {"silu": "silu"})
    moe = MoESpec(num_experts=_num_experts(cfg), top_k=int(cfg.get("num_experts_per_tok", 2)),
                  intermediate=int(cfg["intermediate_size"]), norm_topk=True,
                  float_weights=True, intermediate_key="intermediate_size")
    window = effective_window(cfg, cfg.get("sliding_window"))
    return ArchSpec(**shapes(cfg), layers=_attention_layers(cfg, source, window),
                    ropes={"default": rope_parameters(cfg, source)}, moe=moe)


def olmoe_spec(cfg: dict, source: str) -> ArchSpec:
    """OLMoE: every layer sparse; RMSNorm over the whole q and k projections before they are
    split into heads (sized hidden_size and its key/value share, as transformers builds it)."""
    check_activation(cfg, source, {"silu": "silu"})
    if cfg.get("clip_qkv") is not None:
        raise refuse(cfg, source, "clip_qkv", "clamping q, k and v is not implemented")
    spec = shapes(cfg)
    if spec["num_heads"] * spec["head_dim"] != spec["hidden"]:
        raise refuse(cfg, source, "head_dim", "OLMoE's q norm is hidden_size wide: heads × "
                                              "head_dim must be hidden_size")
    moe = MoESpec(num_experts=_num_experts(cfg), top_k=int(cfg.get("num_experts_per_tok", 1)),
                  intermediate=int(cfg["intermediate_size"]),
                  norm_topk=bool(cfg.get("norm_topk_prob", False)),
                  intermediate_key="intermediate_size")
    attention_bias = bool(cfg.get("attention_bias", False))
    return ArchSpec(**spec, layers=_attention_layers(cfg, source, None),
                    ropes={"default": rope_parameters(cfg, source)}, qkv_bias=attention_bias,
                    o_bias=attention_bias, qk_norm="proj", moe=moe)
