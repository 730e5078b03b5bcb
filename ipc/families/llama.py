"""Llama and the families that are Llama with switches: Mistral and Phi-3 (a sliding
window), Qwen2 (q/k/v biases), Qwen3 (RMSNorm over each head's q and k), both Qwens with
sliding windows on their last layers (use_sliding_window, max_window_layers), SmolLM3
(layers without rope, no_rope_layers, and windows on some of those)."""

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

SLIDING = "sliding_attention"


def llama_spec(cfg: dict, source: str) -> ArchSpec:
    family = cfg["model_type"]
    check_activation(cfg, source, {"silu": "silu"})
    count = cfg["num_hidden_layers"]
    rope = rope_parameters(cfg, source)
    if family in ("qwen2", "qwen3"):
        windows = _qwen_windows(cfg, source, count)
    elif family == "smollm3":
        windows = _smollm3_windows(cfg, source, count)
    else:
        if len(set(layer_types(cfg, source, count))) > 1:
            raise refuse(cfg, source, "layer_types", "layers of different attention kinds are "
                                                     "not implemented for this family")
        window = (cfg.get("sliding_window") if family in ("mistral", "phi3") else None)
        windows = [effective_window(cfg, window)] * count
    has_rope = _smollm3_ropes(cfg, source, count) if family == "smollm3" else [True] * count
    attention_bias = bool(cfg.get("attention_bias", False))
    fields = shapes(cfg)
    if family == "smollm3":  # (its config class ties the head by default)
        fields["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    return ArchSpec(
        **fields,
        layers=tuple(AttentionKind(window=w, rope="default" if r else None)
                     for w, r in zip(windows, has_rope, strict=True)),
        ropes={"default": rope},
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family in ("llama", "smollm3") and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm="head" if family == "qwen3" else None)


def _qwen_windows(cfg: dict, source: str, count: int) -> list[int | None]:
    """Each layer's window, as Qwen2Config/Qwen3Config lay them out: with use_sliding_window,
    `sliding_window` on the layers from max_window_layers on (or those layer_types names
    sliding); without, none (transformers sets sliding_window to None)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if cfg.get("layer_types"):
        kinds = layer_types(cfg, source, count)
    else:
        first = cfg.get("max_window_layers", 28)
        kinds = [SLIDING if window is not None and i >= first else "full_attention"
                 for i in range(count)]
    if SLIDING in kinds and window is None:
        raise refuse(cfg, source, "layer_types", "sliding layers without use_sliding_window "
                                                 "and a sliding_window (transformers cannot "
                                                 "mask them either)")
    return [effective_window(cfg, window) if kind == SLIDING else None for kind in kinds]


def _smollm3_ropes(cfg: dict, source: str, count: int) -> list[bool]:
    """Which layers rope (SmolLM3Config's no_rope_layers: 1 ropes, 0 does not; by default
    every no_rope_layer_interval-th layer has none)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(count)]
    if len(flags) != count or set(flags) - {0, 1}:
        raise refuse(cfg, source, "no_rope_layers", f"expected a 0 or 1 for each of the "
                                                    f"{count} layers")
    if not any(flags):
        # (the CPU kernels' table of angle 0 for layers without rope takes its width from a
        # rope table: a model with none has no such table)
        raise refuse(cfg, source, "no_rope_layers", "a model without rope on any layer is "
                                                    "not implemented")
    return [bool(f) for f in flags]


def _smollm3_windows(cfg: dict, source: str, count: int) -> list[int | None]:
    """SmolLM3Config's windows: with use_sliding_window and a sliding_window, on the layers
    layer_types names sliding (by default those without rope)."""
    window = cfg.get("sliding_window")
    on = bool(cfg.get("use_sliding_window")) and window is not None
    if cfg.get("layer_types"):
        kinds = layer_types(cfg, source, count)
    else:
        has_rope = _smollm3_ropes(cfg, source, count)
        kinds = [SLIDING if on and not r else "full_attention" for r in has_rope]
    if SLIDING in kinds and not on:
        raise refuse(cfg, source, "layer_types", "sliding layers without use_sliding_window "
                                                 "and a sliding_window (transformers' masks "
                                                 "window them, its flash attention not)")
    return [effective_window(cfg, window) if kind == SLIDING else None for kind in kinds]
