"""Gemma's families, read as transformers 5.25 reads them: Gemma (1), Gemma 2 (attention and
final logit softcapping, sliding and full layers alternating, sandwich norms), Gemma 3
(five sliding layers to one full, a rope per layer kind, RMSNorm over each head's q and k)
and the multimodal Gemma 3, whose language model alone runs (its text_config). What all
share: RMSNorm scaling by 1 + w, embeddings scaled by sqrt(hidden), a gelu-tanh gated MLP."""

from __future__ import annotations

from typing import Any

from ipc.arch import (
    STATIC_ROPE,
    ArchSpec,
    AttentionKind,
    UnsupportedModel,
    check_activation,
    effective_window,
    layer_types,
    refuse,
    rope_parameters,
    shapes,
)

# Gemma3TextConfig's defaults: the multimodal checkpoints' text_config leaves most of them out
# (google/gemma-3-4b-it's names six fields), so what transformers fills in is read from here.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma3_text", "vocab_size": 262_208, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "attention_bias": False,
}
# Each family's layer kinds where the config has no layer_types: every n-th layer full.
FULL_EVERY = {"gemma2": 2, "gemma3_text": 6}


def text_config(cfg: dict) -> dict:
    """The language model's config: a multimodal Gemma 3's text_config with its class's
    defaults filled in; any other Gemma's own config as it is."""
    if cfg.get("model_type") != "gemma3":
        return cfg
    return {**GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}


def gemma_spec(cfg: dict, source: str) -> ArchSpec:
    """Gemma 1: Llama's pre-norm layer with Gemma's norms, embedding scale and gelu-tanh MLP
    (configs saying hidden_act "gelu" mean the tanh approximation: transformers converts)."""
    _refuse_common(cfg, source)
    activation = check_activation(cfg, source, {"gelu_pytorch_tanh": "gelu_tanh",
                                                "gelu": "gelu_tanh"})
    if len(set(layer_types(cfg, source, cfg["num_hidden_layers"]))) > 1:
        raise refuse(cfg, source, "layer_types", "Gemma (1) layers all attend alike")
    return ArchSpec(
        **shapes({**cfg, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}),
        layers=(AttentionKind(),) * cfg["num_hidden_layers"],
        ropes={"default": rope_parameters(cfg, source)},
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        activation=activation, norm_offset=True, embed_scale=True)


def gemma2_spec(cfg: dict, source: str) -> ArchSpec:
    """Gemma 2 and 3 (gemma3_text; gemma3: its text_config): sandwich norms, a query scale of
    query_pre_attn_scalar ** -0.5, sliding and full layers by layer_types, softcaps where
    the config names them; Gemma 3 adds a rope per layer kind and per-head q/k norms."""
    text = text_config(cfg)
    where = f"{source}: text_config" if text is not cfg else source
    family = text.get("model_type", cfg["model_type"])
    _refuse_common(text, where)
    activation = check_activation(text, where, {"gelu_pytorch_tanh": "gelu_tanh"},
                                  key="hidden_activation")
    count = text["num_hidden_layers"]
    every = FULL_EVERY.get(family, 2)
    if not text.get("layer_types") and family == "gemma3_text":
        every = int(text.get("sliding_window_pattern", every))
    kinds = layer_types({**text, "layer_types": text.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "sliding_attention"
        for i in range(count)]}, where, count)
    window = effective_window(text, text.get("sliding_window"))
    softcap = text.get("attn_logit_softcapping")
    gemma3 = family == "gemma3_text"
    ropes = gemma3_ropes(text, where) if gemma3 else {"default": rope_parameters(text, where)}
    layers = tuple(AttentionKind(window=window if kind == "sliding_attention" else None,
                                 softcap=None if softcap is None else float(softcap),
                                 rope=kind if gemma3 else "default") for kind in kinds)
    final = text.get("final_logit_softcapping")
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return ArchSpec(
        **{**shapes({**text, "tie_word_embeddings": tie}), "family": cfg["model_type"]},
        layers=layers, ropes=ropes,
        qkv_bias=bool(text.get("attention_bias", False)),
        o_bias=bool(text.get("attention_bias", False)),
        qk_norm="head" if gemma3 else None,
        query_scale=float(text.get("query_pre_attn_scalar", 256)) ** -0.5,
        activation=activation, norms="sandwich", norm_offset=True, embed_scale=True,
        final_softcap=None if final is None else float(final))


def gemma3_ropes(text: dict, source: str) -> dict[str, dict[str, Any]]:
    """Gemma 3's rope of each layer kind, as Gemma3TextConfig makes them: rope_parameters
    keyed by layer type, or the older fields (rope_theta and rope_scaling for full attention,
    rope_local_base_freq for sliding). Each must be a rope the engine implements."""
    given = text.get("rope_parameters") or {}
    if given and not set(given) <= {"full_attention", "sliding_attention"}:
        raise refuse(text, source, "rope_parameters",
                     "Gemma 3's ropes are keyed by layer type (full_attention, "
                     "sliding_attention)")
    full = dict(given.get("full_attention") or {"rope_type": "default"})
    if not given and text.get("rope_scaling"):
        full.update(text["rope_scaling"])
    full.setdefault("rope_theta", text.get("rope_theta", 1_000_000.0))
    sliding = dict(given.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", text.get("rope_local_base_freq", 10_000.0))
    ropes = {"full_attention": full, "sliding_attention": sliding}
    for kind, rope in ropes.items():
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in STATIC_ROPE:
            raise UnsupportedModel(
                f"{source}: rope_parameters[{kind!r}]: RoPE type {rope_type!r} is not "
                f"implemented (only {', '.join(STATIC_ROPE)}: frequencies that do not change "
                "with the length)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModel(f"{source}: rope_parameters[{kind!r}]: "
                                   "partial_rotary_factor: RoPE over part of each head is "
                                   "not implemented")
    return ropes


def _refuse_common(cfg: dict, source: str) -> None:
    if cfg.get("use_bidirectional_attention"):
        raise refuse(cfg, source, "use_bidirectional_attention",
                     "only causal attention is implemented (this is an embedding model)")
