"""Llama and the families that are Llama with switches: Mistral and Phi-3 (a sliding
window), Qwen2 (q/k/v biases), Qwen3 (RMSNorm over each head's q and k)."""

from __future__ import annotations

from ipc.arch import (
    ArchSpec,
    AttentionKind,
    check_activation,
    effective_window,
    layer_types,
    refuse,
    rope_parameters,
    shapes,
)


def llama_spec(cfg: dict, source: str) -> ArchSpec:
    family = cfg["model_type"]
    check_activation(cfg, source, {"silu": "silu"})
    if cfg.get("use_sliding_window"):
        raise refuse(cfg, source, "use_sliding_window",
                     "per-layer sliding windows (Qwen's max_window_layers) are not implemented")
    if len(set(layer_types(cfg, source, cfg["num_hidden_layers"]))) > 1:
        raise refuse(cfg, source, "layer_types",
                     "layers of different attention kinds are not implemented for this family")
    rope = rope_parameters(cfg, source)
    window = effective_window(cfg, cfg.get("sliding_window")
                              if family in ("mistral", "phi3") else None)
    attention_bias = bool(cfg.get("attention_bias", False))
    return ArchSpec(
        **shapes(cfg),
        layers=(AttentionKind(window=window),) * cfg["num_hidden_layers"],
        ropes={"default": rope},
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family == "llama" and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm="head" if family == "qwen3" else None)
