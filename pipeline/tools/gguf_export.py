"""A Hugging Face folder (Llama, Qwen2, Qwen3, Gemma 2, Gemma 3's language model, and the
mixtures of experts Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss; a byte-level BPE tokenizer)
written as a GGUF file, as llama.cpp's converter writes one: its metadata keys
(gguf_families.py for Gemma's and gpt-oss's), the tokenizer as tokens and merges, the q and k
rows of a "llama" file permuted for llama.cpp's rope, Gemma's norm weights as 1 + w, each
layer's experts stacked into one tensor per projection ([experts, rows, inputs]; gpt-oss's
gate and up apart, its MXFP4 experts repacked as ggml's MXFP4 blocks, the same values), the
projections in one of the block types the `gguf` package can quantize. For tests of
`--model FILE.gguf` and for the llama.cpp peer's files of the same weights (random models
included). Runs in the user's process:

    python -m pipeline.tools.gguf_export FOLDER OUT.gguf --type Q8_0
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ipc.gguf_source import NORM_PLUS_ONE, PERMUTED_QK
from pipeline.tools.gguf_families import (
    Mxfp4Rows,
    add_metadata,
    gpt_oss_experts,
    rope_theta,
)

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama",
             "gemma2": "gemma2", "gemma3_text": "gemma3", "gpt_oss": "gpt-oss"}
_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
          "q_norm": "attn_q_norm", "k_norm": "attn_k_norm", "gate_proj": "ffn_gate",
          "up_proj": "ffn_up", "down_proj": "ffn_down", "gate": "ffn_gate_inp",
          "shared_expert_gate": "ffn_gate_inp_shexp"}
# Where an architecture's names differ (gguf's tensor_mapping.py): Gemma's sandwich norms,
# gpt-oss's norm before its MLP and its router.
_ARCH_NAMES = {"gemma2": {"pre_feedforward_layernorm": "ffn_norm",
                          "post_attention_layernorm": "post_attention_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"},
               "gpt-oss": {"post_attention_layernorm": "post_attention_norm",
                           "router": "ffn_gate_inp"}}
_ARCH_NAMES["gemma3"] = _ARCH_NAMES["gemma2"]
# A mixture of experts' names: Mixtral's module and projections, a shared expert's.
_MOE_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


def gguf_name(name: str, architecture: str = "llama") -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight (a shared expert's
    projections: ffn_gate_shexp, ...; gpt-oss's self_attn.sinks: attn_sinks.weight)."""
    parts = [_MOE_NAMES.get(p, p) for p in name.split(".")]
    if parts[:2] == ["model", "layers"] and parts[-1] == "sinks":
        return f"blk.{parts[2]}.attn_sinks.weight"
    if parts[:2] == ["model", "layers"]:
        kind = _ARCH_NAMES.get(architecture, {}).get(parts[-2]) or _NAMES[parts[-2]]
        if "shared_expert" in parts[:-2]:
            kind += "_shexp"
        return f"blk.{parts[2]}.{kind}.{parts[-1]}"
    return f"{_NAMES[parts[-2]]}.{parts[-1]}"


def stack_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """Every expert's projection of a layer as one [experts, rows, inputs] tensor, named
    blk.N.ffn_{gate,up,down}_exps.weight; the other weights as they are (Mixtral's names as
    Qwen's)."""
    import torch

    out: dict[str, Any] = {}
    experts: dict[tuple[str, str], dict[int, Any]] = {}
    for name, tensor in weights.items():
        name = ".".join(_MOE_NAMES.get(p, p) for p in name.split("."))
        if m := _EXPERT.fullmatch(name):
            experts.setdefault((m[1], _NAMES[m[3]]), {})[int(m[2])] = tensor
        else:
            out[name] = tensor
    for (layer, kind), parts in experts.items():
        out[f"blk.{layer}.{kind}_exps.weight"] = torch.stack([parts[e]
                                                             for e in range(len(parts))])
    return out


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a q or k projection's rows (convert_hf_to_gguf's)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def export(folder: Path, out: Path, kind: str = "F32",
           overrides: dict[str, str] | None = None) -> Path:
    """Write `folder` as a GGUF at `out`: the projections, embedding and head as `kind`,
    norms in F32; `overrides`: a type per tensor kind (e.g. {"attn_v": "Q8_0"})."""
    import gguf
    import torch
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    arch = _FAMILIES.get(config["model_type"])
    if arch is None:
        raise ValueError(f"{folder}: model_type {config['model_type']!r} is not exported "
                         f"(only {', '.join(_FAMILIES)})")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
    kv_heads = kv_heads or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])
    _add_experts(writer, config)
    add_metadata(writer, config, arch)
    _add_tokenizer(writer, folder, config)
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(path))
    tied = config.get("tie_word_embeddings", arch in NORM_PLUS_ONE)
    for name, tensor in _by_gguf_name(weights, arch).items():
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        if isinstance(tensor, Mxfp4Rows):  # (experts' MXFP4 blocks, as they are)
            writer.add_tensor(name, tensor.data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            continue
        data = tensor.float().numpy() if isinstance(tensor, torch.Tensor) else tensor
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute_rows(data, heads)
        elif arch in PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute_rows(data, kv_heads)
        target = name if name.startswith("blk.") else gguf_name(name, arch)
        what = target.split(".")[-2]
        wanted = (overrides or {}).get(what, kind)
        if what == "ffn_gate_inp_shexp":
            data = data.reshape(-1)  # (a vector in llama.cpp's files: [hidden])
        if arch in NORM_PLUS_ONE and target.endswith("norm.weight"):
            data = data + np.float32(1)  # (llama.cpp's norm scales by the weight alone)
        if (data.ndim == 1 or target.endswith(".bias") or what.endswith("norm")
                or what.startswith("ffn_gate_inp")):
            wanted = "F32"  # (routers stay float, as llama.cpp's converter leaves them)
        _add(writer, target, data, wanted)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _by_gguf_name(weights: dict[str, Any], arch: str) -> dict[str, Any]:
    """The checkpoint's tensors, each layer's experts already under their GGUF names."""
    return gpt_oss_experts(weights) if arch == "gpt-oss" else stack_experts(weights)


def _add_experts(writer: Any, config: dict) -> None:
    """A mixture of experts' counts and widths, as llama.cpp reads them."""
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None:
        return
    # llama.cpp renormalises the top k's weights of qwen3moe and never qwen2moe's (as the
    # released models do), whatever a key says: a model of the other kind has no GGUF form.
    normalised = {"qwen3_moe": True, "qwen2_moe": False}.get(config["model_type"])
    if normalised is not None and bool(config.get("norm_topk_prob", False)) != normalised:
        raise ValueError(f"{config['model_type']} with norm_topk_prob = "
                         f"{config.get('norm_topk_prob', False)}: llama.cpp's "
                         f"{_FAMILIES[config['model_type']]} always has {normalised}")
    writer.add_expert_count(int(experts))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(
            int(config["shared_expert_intermediate_size"]))


def _add(writer: Any, name: str, data: np.ndarray, kind: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, data.astype(np.float32))
    elif kind == "F16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype),
                          raw_dtype=qtype)


def _add_tokenizer(w: Any, folder: Path, config: dict) -> None:
    """The folder's byte-level BPE tokenizer as GGUF's "gpt2" tokenizer (tokens, their types,
    merges), its special ids and chat template."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"{folder}: a {tok['model']['type']} tokenizer is not exported")
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", "add_bos_token_id"), ("eos_token", "add_eos_token_id"),
                     ("pad_token", "add_pad_token_id"), ("unk_token", "add_unk_token_id")):
        value = tok_config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value in vocab:
            getattr(w, add)(vocab[value])
    template = tok_config.get("chat_template")
    if template:
        w.add_chat_template(template)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gguf_export", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--type", default="F32", choices=TYPES)
    args = p.parse_args(argv)
    print(export(args.folder, args.out, args.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
