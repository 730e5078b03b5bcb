"""OLMo 2 and OLMo 3: norms after attention and after the MLP instead of before, RMSNorm
over the whole q and k projections (qk_norm "proj"); OLMo 3 adds sliding-window layers
(layer_types), each kind of layer with its own rope (rope_parameters by layer type)."""

from __future__ import annotations

from typing import Any

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

SLIDING, FULL = "sliding_attention", "full_attention"


def olmo_spec(cfg: dict, source: str) -> ArchSpec:
    check_activation(cfg, source, {"silu": "silu"})
    count = cfg["num_hidden_layers"]
    if cfg["model_type"] == "olmo3":
        layers, ropes = _olmo3_layers(cfg, source, count)
    else:
        if len(set(layer_types(cfg, source, count))) > 1:
            raise refuse(cfg, source, "layer_types", "OLMo 2's layers all attend alike")
        layers = (AttentionKind(),) * count
        ropes = {"default": rope_parameters(cfg, source)}
    attention_bias = bool(cfg.get("attention_bias", False))
    return ArchSpec(
        **shapes(cfg), layers=layers, ropes=ropes, qkv_bias=attention_bias,
        o_bias=attention_bias, qk_norm="proj", norms="post")


def _olmo3_layers(cfg: dict, source: str,
                  count: int) -> tuple[tuple[AttentionKind, ...], dict[str, dict[str, Any]]]:
    """Olmo3Config's layers: by default three sliding layers, then a full one; the window
    `sliding_window` (4096 by default); each layer type's rope its own (the config's
    rope_scaling, where it has one, is the full layers')."""
    kinds = (layer_types(cfg, source, count) if cfg.get("layer_types") else
             [SLIDING if (i + 1) % 4 else FULL for i in range(count)])
    window = cfg.get("sliding_window", 4096)
    if SLIDING in kinds and window is None:
        raise refuse(cfg, source, "sliding_window", "sliding layers need a window")
    ropes = {kind: _layer_rope(cfg, source, kind) for kind in sorted(set(kinds))}
    layers = tuple(AttentionKind(window=effective_window(cfg, window) if kind == SLIDING
                                 else None, rope=kind) for kind in kinds)
    return layers, ropes


def _layer_rope(cfg: dict, source: str, kind: str) -> dict[str, Any]:
    """A layer type's rope parameters (what stages/executor/models/base.py rope_tables reads
    by that key), refused where the engine does not implement them."""
    by_type = cfg.get("rope_parameters") or {}
    if kind in by_type:
        params = by_type[kind] or {}
    else:  # (an older config: rope_theta for both, rope_scaling for the full layers)
        params = dict(cfg.get("rope_scaling") or {}) if kind == FULL else {}
    keep = {k: cfg[k] for k in ("partial_rotary_factor",) if k in cfg}
    return rope_parameters({"rope_parameters": params, **keep}, source)
