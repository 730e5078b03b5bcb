"""What sets a Llama-family model apart, read from its config.json in one place, without
torch: the launcher refuses a model the engine does not implement before anything starts
(ModelInfo.from_dir), and the executor builds the model from the same spec
(stages/executor/model.py), whose forward has no per-family branches, only modules that are
there or not."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ipc.errors import ConfigError


class UnsupportedModel(ConfigError):
    """A model folder the engine does not implement: the message names the config field."""


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# RoPE variants whose frequencies are fixed (the cos/sin tables are computed once).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ArchSpec:
    """A Llama-family model's shape and quirks, as its config.json says them."""

    family: str
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eps: float
    qkv_bias: bool  # Qwen2; Llama's attention_bias
    o_bias: bool  # Llama's attention_bias
    mlp_bias: bool  # Llama's mlp_bias
    qk_norm: bool  # Qwen3: an RMSNorm over each head's q and k, before RoPE
    sliding_window: int | None  # Mistral, Phi-3: a token sees the last this many positions
    tie_word_embeddings: bool


def arch_spec(cfg: dict, source: str = "config.json") -> ArchSpec:
    """The spec of a config, or UnsupportedModel naming the field the engine lacks."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedModel(f"{source}: model_type = {family!r}: this family is not "
                               f"implemented (the engine runs {', '.join(FAMILIES)})")

    def refuse(name: str, why: str) -> None:
        raise UnsupportedModel(f"{source}: {name} = {cfg.get(name)!r}: {why}")

    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only silu (SwiGLU) MLPs are implemented")
    if cfg.get("use_sliding_window"):
        refuse("use_sliding_window", "per-layer sliding windows (Qwen's max_window_layers) "
                                     "are not implemented")
    if len(set(cfg.get("layer_types") or ["full_attention"])) > 1:
        refuse("layer_types", "layers of different attention kinds are not implemented")
    rope_name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(rope_name) or {}
    if cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse("partial_rotary_factor" if "partial_rotary_factor" in cfg else rope_name,
               "RoPE over part of each head is not implemented")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE:
        refuse(rope_name, f"RoPE type {rope_type!r} is not implemented (only "
                          f"{', '.join(STATIC_ROPE)}: frequencies that do not change with the "
                          "length)")
    heads = cfg["num_attention_heads"]
    attention_bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window") if family in ("mistral", "phi3") else None
    if window is not None and window >= cfg.get("max_position_embeddings", window + 1):
        window = None  # a window as long as the context changes nothing
    return ArchSpec(
        family=family, hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"], eps=cfg.get("rms_norm_eps", 1e-6),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family == "llama" and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=family == "qwen3",
        sliding_window=window, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def read_config(model_dir: str | Path) -> tuple[dict, ArchSpec]:
    """A model folder's config.json and what the engine reads of it (the one reader: the
    launcher's checks, ModelInfo and the executor all come here); refuses what the engine
    does not implement before any weight loads."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    return cfg, arch_spec(cfg, str(path))
