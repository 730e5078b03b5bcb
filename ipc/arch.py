"""What sets a model apart, read from its config.json in one place, without torch: the
launcher refuses a model the engine does not implement before anything starts
(ModelInfo.from_dir), and the executor builds the model from the same spec
(stages/executor/models/). Each family's reading of its config is a module of
ipc/families/, registered there by `model_type` beside the executor module that builds it
(where `read_config` is); this module holds what they share: the spec (`ArchSpec`, per layer
`AttentionKind`, the mixture of experts' `MoESpec`) and the checks every family makes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ipc.errors import ConfigError


class UnsupportedModel(ConfigError):
    """A model folder the engine does not implement: the message names the config field."""


# RoPE variants whose frequencies are fixed (the cos/sin tables are computed once).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class AttentionKind:
    """How one layer attends, beyond its shapes: what the attention backends take per layer
    (stages/executor/backends/base.py LayerAttention)."""

    window: int | None = None  # a token sees the last this many positions
    softcap: float | None = None  # scores through cap * tanh(score / cap) (Gemma 2)
    rope: str | None = "default"  # a key of ArchSpec.ropes; None: no rope (SmolLM3's NoPE)
    sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)


@dataclass(frozen=True)
class MoESpec:
    """A sparse MLP: each token's `top_k` experts of `num_experts` by its router."""

    num_experts: int
    top_k: int
    intermediate: int  # each expert's
    # How the router's weights are made: "softmax_topk" (softmax over every expert, then the
    # top k), renormalised over those k with `norm_topk`; "topk_softmax": softmax over the
    # top k's logits (Mixtral and gpt-oss; the same as softmax_topk renormalised).
    routing: str = "softmax_topk"
    norm_topk: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    shared_intermediate: int = 0  # a dense expert every token takes (Qwen2-MoE); 0: none
    shared_gate: bool = False  # the shared expert scaled by sigmoid(x . w) (Qwen2-MoE)
    # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit,
    # (up + 1) * gate * sigmoid(alpha * gate), gate and up interleaved in its checkpoint
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Layers whose MLP is dense (ArchSpec.intermediate wide) instead: Qwen-MoE's
    # mlp_only_layers and the layers decoder_sparse_step skips
    dense_layers: tuple[int, ...] = ()
    # The router's weights stay float32 when they scale the experts' outputs (Mixtral's);
    # otherwise they are rounded to the model's dtype first (Qwen-MoE's, OLMoE's)
    float_weights: bool = False
    intermediate_key: str = "moe_intermediate_size"  # the config's name of `intermediate`


@dataclass(frozen=True)
class ArchSpec:
    """A model's shape and quirks, as its config.json says them (one family's reading,
    ipc/families/)."""

    family: str  # the config's model_type
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eps: float
    tie_word_embeddings: bool
    # how each layer attends (one per layer)
    layers: tuple[AttentionKind, ...]
    # the rope parameters of each AttentionKind.rope key (transformers' rope_parameters)
    ropes: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias
    mlp_bias: bool = False  # Llama's mlp_bias
    # RMSNorm over each head's q and k before rope ("head", Qwen3), over the whole
    # projections ("proj", OLMo 2), or none
    qk_norm: str | None = None
    query_scale: float | None = None  # None: head_dim ** -0.5
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    # where a layer's norms are: "pre" (before attention and MLP), "sandwich" (before and
    # after each, Gemma 2/3), "post" (after each, OLMo 2)
    norms: str = "pre"
    norm_offset: bool = False  # weights stored as w - 1: RMSNorm scales by 1 + w (Gemma)
    embed_scale: bool = False  # embeddings scaled by sqrt(hidden) (Gemma)
    final_softcap: float | None = None  # logits through cap * tanh(logit / cap)
    moe: MoESpec | None = None  # the layers' MLPs sparse, but moe.dense_layers (None: dense)
    # the language model's max_position_embeddings (None: the config names none)
    max_positions: int | None = None

    def sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s MLP is a mixture of experts."""
        return self.moe is not None and layer_idx not in self.moe.dense_layers

    @property
    def sliding_window(self) -> int | None:
        """The longest window of any layer (None: none has one): what a forward without
        windows refuses."""
        windows = [k.window for k in self.layers if k.window is not None]
        return max(windows) if windows else None

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct windows of the layers, ascending."""
        return tuple(sorted({k.window for k in self.layers if k.window is not None}))

    @property
    def kv_windows(self) -> tuple[int | None, ...]:
        """The window of each group of layers whose KV blocks the scheduler keeps apart, in one
        pool (vLLM's hybrid cache manager's layer groups): a block table each, a block id
        naming the same memory in every group, held by one group at a time (kv_places).
        (w,) where every layer has a window (w: the longest), so a sequence holds only the
        blocks w spans; (None,) without windows. Where windowed layers (w: their longest
        window) sit beside layers that read every key (Gemma 2/3, gpt-oss, OLMo 3), groups
        of the same size (the fewer kind's count of layers, vLLM's choice):
        the latter's (None) first, then the windowed layers' (w), whose blocks go back as
        they fall out of w while the others' stay."""
        full, size = self._kv_kinds
        if full == 0 or size == 0:
            return (self.sliding_window,)
        return ((None,) * -(-full // size)
                + (self.sliding_window,) * -(-(self.num_layers - full) // size))

    @property
    def _kv_kinds(self) -> tuple[int, int]:
        """(layers that read every key, layers a KV group holds: the fewer kind's count)."""
        full = sum(k.window is None for k in self.layers)
        return full, min(full, self.num_layers - full)

    def kv_places(self, grouped: bool) -> list[tuple[int, int]]:
        """Where each layer's KV lives: (its group in kv_windows, its place in the group),
        the place being which of the pool's caches it reads: one a place, shared by the
        groups (their blocks never the same at once). Not `grouped` (every layer in one
        group, as a run beside a draft model keeps them): (0, the layer's index)."""
        windows = self.kv_windows
        if not grouped or len(windows) == 1:
            return [(0, i) for i in range(self.num_layers)]
        num_full, size = windows.count(None), self._kv_kinds[1]
        places, seen = [], [0, 0]  # layers of each kind so far
        for kind in self.layers:
            windowed = kind.window is not None
            k = seen[windowed]
            seen[windowed] += 1
            places.append((num_full * windowed + k // size, k % size))
        return places

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5


def refuse(cfg: dict, source: str, name: str, why: str) -> UnsupportedModel:
    """The error for config field `name` the engine does not implement."""
    return UnsupportedModel(f"{source}: {name} = {cfg.get(name)!r}: {why}")


def rope_parameters(cfg: dict, source: str) -> dict[str, Any]:
    """The config's rope parameters (rope_scaling, or transformers' rope_parameters), refused
    where the engine does not implement them."""
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(name) or {}
    if cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(cfg, source, "partial_rotary_factor" if "partial_rotary_factor" in cfg
                     else name, "RoPE over part of each head is not implemented")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE:
        raise refuse(cfg, source, name, f"RoPE type {rope_type!r} is not implemented (only "
                                        f"{', '.join(STATIC_ROPE)}: frequencies that do not "
                                        "change with the length)")
    return dict(rope)


def check_activation(cfg: dict, source: str, allowed: dict[str, str],
                     key: str = "hidden_act") -> str:
    """The engine's name for the config's MLP activation (`allowed`: the config's names to
    ours), or UnsupportedModel."""
    act = cfg.get(key, next(iter(allowed)))
    if act not in allowed:
        raise refuse(cfg, source, key, f"only {', '.join(allowed)} MLPs are implemented "
                                       "for this family")
    return allowed[act]


def layer_types(cfg: dict, source: str, count: int) -> list[str]:
    """The config's layer_types (every layer full attention where it has none)."""
    kinds = cfg.get("layer_types") or ["full_attention"] * count
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown or len(kinds) != count:
        raise refuse(cfg, source, "layer_types",
                     f"{sorted(unknown)} are not attention kinds the engine implements"
                     if unknown else f"{len(kinds)} kinds for {count} layers")
    return list(kinds)


def shapes(cfg: dict) -> dict[str, Any]:
    """The fields every family reads alike, as ArchSpec's keywords."""
    heads = cfg["num_attention_heads"]
    return dict(
        family=cfg["model_type"], hidden=cfg["hidden_size"],
        intermediate=cfg.get("intermediate_size", 0), num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"], eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_positions=cfg.get("max_position_embeddings"))


def effective_window(cfg: dict, window: int | None) -> int | None:
    """A window as long as the context changes nothing: None."""
    if window is not None and window >= cfg.get("max_position_embeddings", window + 1):
        return None
    return window
