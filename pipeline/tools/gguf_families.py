"""GGUF metadata of Gemma 2, Gemma 3 and gpt-oss both ways, in the user's process: what
llama.cpp's loader (src/llama-model.cpp) reads of a file of these architectures, as the
config fields of the model folder made for it (model_source.py), and what its converter
(convert_hf_to_gguf.py) writes of a Hugging Face config, for gguf_export.py. Much is fixed
by llama.cpp rather than said by the file: the layers' pattern (Gemma 2 and gpt-oss
alternate sliding and full layers, Gemma 3 has five sliding to one full), Gemma 3's sliding
layers' rope (base 10000, unscaled), Gemma's query scale (1 / sqrt(head_dim), or
1 / sqrt(hidden / heads) for the 27B models, known by their layer count), Gemma 2's softcaps
where the file has none (50 and 30), gpt-oss's clamped SwiGLU (alpha 1.702, limit 7). A
model that differs where the file cannot say so is refused by the exporter, naming the
field; a file key llama.cpp ignores but that contradicts what it fixes is refused by the
reader."""

from __future__ import annotations

import logging
from typing import Any

from ipc.errors import ConfigError

logger = logging.getLogger(__name__)

GEMMA = ("gemma2", "gemma3")
# Every n-th layer is full attention, the others sliding (llama.cpp's set_swa_pattern(n)).
FULL_EVERY = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
# Layer counts of the 27B models, whose query scale is 1 / sqrt(hidden / heads).
LAYERS_27B = {"gemma2": 46, "gemma3": 62}
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
GEMMA3_SLIDING_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# YaRN keys llama.cpp reads that the engine's rope (transformers' functions) does not take.
_YARN_REFUSED = ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
                 "rope.scaling.attn_factor", "rope.scaling.yarn_log_multiplier")


def layer_types(architecture: str, count: int) -> list[str]:
    """The layer kinds llama.cpp gives a file of `architecture` with a sliding window."""
    every = FULL_EVERY[architecture]
    return ["sliding_attention" if i % every < every - 1 else "full_attention"
            for i in range(count)]


def query_pre_attn_scalar(architecture: str, count: int, hidden: int, heads: int,
                          head_dim: int) -> int:
    """Gemma's query_pre_attn_scalar as llama.cpp derives it (its f_attention_scale)."""
    return hidden // heads if count == LAYERS_27B[architecture] else head_dim


# --- reading: a file's metadata as config fields ---------------------------------------------

# Architectures whose config is made from the metadata here, not by transformers' GGUF
# reading: its gpt-oss reading takes a rope.scaling key's length field for its value (a
# TypeError on every file with a YaRN rope, as llama.cpp writes them all).
OWN_CONFIG = {"gpt-oss": "gpt_oss"}
_GENERAL = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
            "attention.head_count": "num_attention_heads",
            "attention.head_count_kv": "num_key_value_heads",
            "attention.key_length": "head_dim", "context_length": "max_position_embeddings",
            "vocab_size": "vocab_size"}
_TOKEN_IDS = {"tokenizer.ggml.bos_token_id": "bos_token_id",
              "tokenizer.ggml.eos_token_id": "eos_token_id",
              "tokenizer.ggml.padding_token_id": "pad_token_id"}


def general_fields(meta: dict[str, Any], tokenizer: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The shapes, eps, token ids and tying every architecture's file says alike, as config
    fields (`tokenizer`: the file's tokenizer.ggml.* keys, full names)."""
    fields: dict[str, Any] = {ours: int(meta[key]) for key, ours in _GENERAL.items()
                              if key in meta}
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(tokenizer["tokenizer.ggml.tokens"])
    fields["rms_norm_eps"] = float(meta["attention.layer_norm_rms_epsilon"])
    ids = {ours: int(tokenizer[key]) for key, ours in _TOKEN_IDS.items() if key in tokenizer}
    return {**fields, **ids, "tie_word_embeddings": tied}


def read_fields(meta: dict[str, Any], architecture: str, file: str) -> dict[str, Any]:
    """The config fields llama.cpp reads or fixes for a file of `architecture` (`meta`: the
    file's `{architecture}.*` keys without that prefix); {} for the other architectures."""
    if architecture not in (*GEMMA, "gpt-oss"):
        return {}
    count = int(meta["block_count"])
    hidden, heads = int(meta["embedding_length"]), int(meta["attention.head_count"])
    head_dim = int(meta.get("attention.key_length", hidden // heads))
    if architecture == "gpt-oss":
        return _gpt_oss_fields(meta, count, file)
    scalar = query_pre_attn_scalar(architecture, count, hidden, heads, head_dim)
    if architecture == "gemma2":
        return {"head_dim": head_dim, "query_pre_attn_scalar": scalar,
                "sliding_window": int(meta.get("attention.sliding_window", 4096)),
                "layer_types": layer_types("gemma2", count),
                **{k: float(meta.get(k, v)) for k, v in GEMMA2_SOFTCAPS.items()}}
    return {"head_dim": head_dim, "query_pre_attn_scalar": scalar,
            **_gemma3_layers(meta, count, file), "attn_logit_softcapping": None,
            "final_logit_softcapping": float(meta["final_logit_softcapping"])
            if meta.get("final_logit_softcapping") else None}


def _gemma3_layers(meta: dict[str, Any], count: int, file: str) -> dict[str, Any]:
    """Gemma 3's windows and ropes: five sliding layers to one full where the file has a
    sliding window (every layer full where it has none), the sliding ones' rope fixed."""
    fixed = {"attention.sliding_window_pattern": FULL_EVERY["gemma3"],
             "rope.freq_base_swa": GEMMA3_SLIDING_ROPE["rope_theta"]}
    for key, value in fixed.items():
        if key in meta and float(meta[key]) != value:
            raise ConfigError(f"{file}: gemma3.{key} = {meta[key]}: llama.cpp takes {value} "
                              "whatever the file says, so the file's model is not the one "
                              "it runs; the engine loads neither")
    window = int(meta.get("attention.sliding_window", 0))
    full = {**_rope(meta, file, ("linear",)), "rope_theta": float(meta.get("rope.freq_base",
                                                                           10000.0))}
    return {"sliding_window": window or None,
            "layer_types": layer_types("gemma3", count) if window
            else ["full_attention"] * count,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": dict(GEMMA3_SLIDING_ROPE)}}


def _gpt_oss_fields(meta: dict[str, Any], count: int, file: str) -> dict[str, Any]:
    for key in _YARN_REFUSED:
        if key in meta:
            raise ConfigError(f"{file}: gpt-oss.{key}: this YaRN parameter is not "
                              "implemented")
    rope = {**_rope(meta, file, ("yarn",)), "rope_theta": float(meta.get("rope.freq_base",
                                                                         10000.0))}
    return {"sliding_window": int(meta["attention.sliding_window"]),
            "layer_types": layer_types("gpt-oss", count),
            "intermediate_size": int(meta["expert_feed_forward_length"]),
            "num_local_experts": int(meta["expert_count"]),
            "num_experts_per_tok": int(meta["expert_used_count"]),
            "rope_parameters": rope, **SWIGLU}


def _rope(meta: dict[str, Any], file: str, scalings: tuple[str, ...]) -> dict[str, Any]:
    """The file's rope scaling as transformers' rope parameters (without the theta): none,
    or one of `scalings` (linear: rope.scaling.factor, or the older rope.scale_linear;
    yarn: its factor, original context and betas, llama.cpp's defaults for those absent;
    a YaRN ramp whose ends are rounded, as ggml's always are)."""
    kind = str(meta.get("rope.scaling.type", "none"))
    factor = float(meta.get("rope.scaling.factor", meta.get("rope.scale_linear")) or 0)
    if kind == "none" or (kind == "linear" and factor in (0, 1)):
        return {"rope_type": "default"}
    if kind not in scalings or not factor:
        raise ConfigError(f"{file}: rope.scaling.type = {kind!r}" + (
            " without rope.scaling.factor" if kind in scalings else
            f": not a rope this architecture has in llama.cpp's converter "
            f"({', '.join(scalings)})"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    return {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": int(meta["rope.scaling.original_context_length"]),
            "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0))}


# --- writing: a config as a file's metadata --------------------------------------------------

def rope_theta(config: dict) -> float:
    """The rope base llama.cpp's rope.freq_base holds: Gemma 3's full layers'."""
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def add_metadata(writer: Any, config: dict, architecture: str) -> None:
    """The family's own keys, or ValueError naming a field llama.cpp cannot be told."""
    count = config["num_hidden_layers"]
    if architecture in GEMMA:
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        head_dim = config.get("head_dim") or hidden // heads
        _expect(config, "query_pre_attn_scalar",
                query_pre_attn_scalar(architecture, count, hidden, heads, head_dim))
    if architecture == "gemma2":
        _expect_layers(config, layer_types("gemma2", count))
        for key in GEMMA2_SOFTCAPS:
            if config.get(key) is None:
                raise ValueError(f"{key} = None: llama.cpp's gemma2 caps at "
                                 f"{GEMMA2_SOFTCAPS[key]} where the file has no cap")
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        writer.add_sliding_window(int(config["sliding_window"]))
    elif architecture == "gemma3":
        _add_gemma3(writer, config, count)
    elif architecture == "gpt-oss":
        _add_gpt_oss(writer, config, count)


def _add_gemma3(writer: Any, config: dict, count: int) -> None:
    import gguf

    _expect(config, "attn_logit_softcapping", None)
    kinds = config.get("layer_types") or layer_types("gemma3", count)
    windowed = "sliding_attention" in kinds
    _expect_layers(config, layer_types("gemma3", count) if windowed
                   else ["full_attention"] * count)
    ropes = config.get("rope_parameters") or {}
    sliding: dict[str, Any] = ropes.get("sliding_attention") or GEMMA3_SLIDING_ROPE
    if windowed and (sliding.get("rope_type", "default") != "default"
                     or float(sliding.get("rope_theta", 10000.0)) != 10000.0):
        raise ValueError(f"rope_parameters['sliding_attention'] = {sliding}: llama.cpp's "
                         f"gemma3 has {GEMMA3_SLIDING_ROPE}")
    full = ropes.get("full_attention") or {}
    if full.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    elif full.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters['full_attention'] = {full}: a gemma3 file holds "
                         "a default or linear rope")
    if windowed:
        writer.add_sliding_window(int(config["sliding_window"]))
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def _add_gpt_oss(writer: Any, config: dict, count: int) -> None:
    import gguf

    _expect_layers(config, layer_types("gpt-oss", count))
    for key, value in SWIGLU.items():
        _expect({key: value, **config}, key, value)
    writer.add_sliding_window(int(config["sliding_window"]))
    writer.add_expert_feed_forward_length(int(config["intermediate_size"]))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") == "default":
        return
    if rope.get("rope_type") != "yarn":
        raise ValueError(f"rope_parameters = {rope}: a gpt-oss file holds a YaRN rope")
    unsaid = sorted(set(rope) - {"rope_type", "rope_theta", "factor", "beta_fast",
                                 "beta_slow", "original_max_position_embeddings", "truncate"})
    if unsaid:
        raise ValueError(f"rope_parameters: {', '.join(unsaid)}: not exported")
    if rope.get("truncate", True) is False:  # (the released gpt-oss's, which llama.cpp's
        # converter writes all the same: its ramp's ends are rounded, ~1 dimension apart)
        logger.warning("rope_parameters: truncate = false: a GGUF file cannot say so; "
                       "llama.cpp (and the engine reading the file) round the YaRN ramp's "
                       "ends")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
    writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))


def _expect_layers(config: dict, kinds: list[str]) -> None:
    """(A config without layer_types has its family's pattern, which is llama.cpp's.)"""
    _expect({"layer_types": kinds, **{k: v for k, v in config.items() if v}}, "layer_types",
            kinds)


def _expect(config: dict, key: str, value: Any) -> None:
    if config.get(key) != value:
        raise ValueError(f"{key} = {config.get(key)!r}: llama.cpp's architecture has "
                         f"{value!r} and its files cannot say otherwise")


# --- writing: gpt-oss's experts --------------------------------------------------------------

def gpt_oss_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fused experts as llama.cpp's converter writes them, by GGUF name: each
    layer's gate and up apart (the checkpoint interleaves their rows: even gate, odd up),
    blk.N.ffn_{gate,up,down}_exps.{weight,bias}, weights [experts, rows, inputs] as floats, or
    MXFP4 blocks where the checkpoint ships them (ggml's block bytes, uint8
    [experts, rows, inputs / 32 * 17]: repacked, not requantized); the other weights as they
    are."""
    import re

    out: dict[str, Any] = {}
    pairs: dict[str, dict[str, Any]] = {}
    fused = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                       r"(|_bias|_blocks|_scales)")
    for name, tensor in weights.items():
        m = fused.fullmatch(name)
        if m is None:
            out[name] = tensor
            continue
        layer, proj, what = m.groups()
        if what in ("_blocks", "_scales"):
            pairs.setdefault(f"{layer}.{proj}", {})[what] = tensor.numpy()
            continue
        value = tensor.float().numpy()  # weights [E, in, out], biases [E, out]
        if what == "":
            value = value.swapaxes(1, 2)  # [E, out, in]
        leaf = "bias" if what else "weight"
        for kind, part in _split_gate_up(proj, value).items():
            out[f"blk.{layer}.ffn_{kind}_exps.{leaf}"] = part
    for key, got in pairs.items():
        layer, proj = key.split(".")
        if set(got) != {"_blocks", "_scales"}:
            raise ValueError(f"model.layers.{layer}.mlp.experts.{proj}: MXFP4 blocks without "
                             "their scales, or scales without their blocks")
        for kind, blocks in _split_gate_up(proj, got["_blocks"]).items():
            scales = _split_gate_up(proj, got["_scales"])[kind]
            out[f"blk.{layer}.ffn_{kind}_exps.weight"] = Mxfp4Rows(ggml_mxfp4(blocks, scales))
    return out


def _split_gate_up(proj: str, value: Any) -> dict[str, Any]:
    """[E, rows, ...] of one fused projection as its parts (gate: even rows, up: odd)."""
    if proj == "down_proj":
        return {"down": value}
    return {"gate": value[:, 0::2], "up": value[:, 1::2]}


class Mxfp4Rows:
    """ggml MXFP4 block bytes, written as they are."""

    def __init__(self, data: Any) -> None:
        self.data = data


def ggml_mxfp4(blocks: Any, scales: Any) -> Any:
    """MXFP4 in the safetensors layout (blocks uint8 [..., G, 16]: byte j holds elements 2j
    and 2j + 1 in its low and high nibble; scales uint8 [..., G]) as ggml's blocks, uint8
    [..., G * 17]: the scale byte, then 16 bytes whose low nibbles are elements 0..15 and
    high nibbles 16..31 (convert_hf_to_gguf's transform_nibble_layout)."""
    import numpy as np

    elements = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = elements[..., :16] | (elements[..., 16:] << 4)
    packed = np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8)
    return packed.reshape(*blocks.shape[:-2], -1)
