"""Randomly initialised models (Llama's family, or any family transformers has a config class
for) with a tokenizer trained offline, saved as HF folders.
For tests and benchmarks where no real weights are present (no hub is ever reached).
Runs in the user's process (tests, scripts/bench, scripts/gpu_check)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join at any step.",
    "Héllo wörld, ça va? Grüße aus Köln. 日本語のテキスト。 Emoji: 🚀🔥✨",
    "def main():\n    return 42\n",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(folder: Path, vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer: multi-byte characters split across tokens, as in real ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def _tokenizer_into(folder: Path, tokenizer_from: Path | None) -> Any:
    """The new model folder with its tokenizer: `tokenizer_from`'s, or a small trained one."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        return build_tokenizer(folder)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    tok.save_pretrained(folder)
    return tok


ARCHS = ("llama", "qwen2", "mistral", "llama-bias", "mistral-window", "qwen3", "phi3")


def build_random_llama(folder: Path, *, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                       kv_heads: int = 2, max_len: int = 512, vocab_size: int | None = None,
                       weight_std: float = 0.2, seed: int = 0, arch: str = "llama",
                       intermediate: int | None = None, tokenizer_from: Path | None = None,
                       tie: bool | None = None) -> Path:
    """Save a random Llama-family model (GQA) and a tokenizer into folder; returns folder.
    arch: llama (untied head), qwen2 (q/k/v biases, tied embeddings), mistral (no sliding
    window), llama-bias (attention and MLP biases), mistral-window (a sliding window of 6
    positions), qwen3 (q/k norms, a head_dim of its own) or phi3 (fused checkpoint
    projections, a sliding window of 10). vocab_size pads the embedding beyond the
    tokenizer's (a larger, realistic output layer). intermediate: the MLP's width (3 × hidden
    by default); tokenizer_from: a model folder whose tokenizer the model gets instead of the
    small trained one; tie: whether the head is the embedding (default: tied for qwen2 only)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    tok = _tokenizer_into(folder, tokenizer_from)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "llama-bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "mistral-window": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[arch]
    extra: dict[str, Any] = {"tie_word_embeddings": arch == "qwen2" if tie is None else tie}
    extra.update({
        "mistral": {"sliding_window": None},
        "mistral-window": {"sliding_window": 6},
        "llama-bias": {"attention_bias": True, "mlp_bias": True},
        "qwen3": {"head_dim": 2 * hidden // heads},
        "phi3": {"sliding_window": 10, "original_max_position_embeddings": max_len},
    }.get(arch, {}))
    cfg = config_cls(vocab_size=max(len(tok), vocab_size or 0), hidden_size=hidden,
                     intermediate_size=intermediate or hidden * 3, num_hidden_layers=num_layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads,
                     max_position_embeddings=max_len, eos_token_id=tok.eos_token_id,
                     bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger weights than the default init: peaked, varied logits
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):
                p.normal_(0, weight_std)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(folder)
    return folder


def build_random_model(folder: Path, model_type: str, *, weight_std: float = 0.2,
                       seed: int = 0, tokenizer_from: Path | None = None,
                       dtype: str | None = None, **config: Any) -> Path:
    """Save a random model of any family transformers has a config class for (`model_type`:
    its config's, e.g. "gemma3_text", "qwen3_moe"), `config` its fields, with a tokenizer,
    into folder; returns folder. Matrices, stacked experts and biases are drawn from
    N(0, weight_std) (peaked, varied logits); norms keep their initial values. dtype: the
    saved weights' ("bfloat16" halves a benchmark model's files; None: float32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tok = _tokenizer_into(folder, tokenizer_from)
    ids = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
           "pad_token_id": tok.pad_token_id}
    cfg = AutoConfig.for_model(model_type, **{"vocab_size": len(tok), **ids, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):
                p.normal_(0, weight_std)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    GenerationConfig(**ids).save_pretrained(folder)
    return folder


def add_pooling_modules(folder: Path, mode: str, *, normalize: bool = True) -> Path:
    """Make a model folder a sentence-transformers one too, pooling by `mode` (last, mean or
    cls) and normalising if asked: modules.json, 1_Pooling/config.json, 2_Normalize (what
    ipc/pooling.py reads, and sentence-transformers loads). Returns folder."""
    import json

    key = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
           "cls": "pooling_mode_cls_token"}[mode]
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False,
               "include_prompt": True, key: True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    return folder


# Shapes of real models, for benchmarks on random weights of their size (`--like`).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {"num_layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8,
                     "intermediate": 8192, "tie": True},
}
# Mixtures of experts (`--like`), as config fields of their family: Qwen3-30B-A3B's layer
# (hidden 2048, 32 query heads and 4 KV heads of 128, experts of 768, 8 routed a token) with
# fewer layers and experts, scaled to a 2-core machine: ~1.5 B parameters, ~0.55 B active.
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-moe-mid": {"model_type": "qwen3_moe", "num_hidden_layers": 8, "hidden_size": 2048,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_experts": 32, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "intermediate_size": 6144,
                      "norm_topk_prob": True, "tie_word_embeddings": False},
}

# Windowed layers beside global ones (`--like`), as config fields of their family: Gemma 3's
# pattern (five local layers of window 512 to one global) in six small layers, for the KV
# groups' benchmark at long contexts (docs/BENCHMARKS.md).
WINDOWED_SHAPES: dict[str, dict[str, Any]] = {
    "gemma3-mini": {"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 512,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                    "intermediate_size": 2048, "sliding_window": 512},
}
FAMILY_SHAPES = {**MOE_SHAPES, **WINDOWED_SHAPES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="random_model", description=__doc__)
    p.add_argument("folder", type=Path)
    p.add_argument("--like", choices=sorted(SHAPES) + sorted(FAMILY_SHAPES),
                   help="a real model's shape (the shape options below apply on top)")
    p.add_argument("--layers", type=int, default=None, help="(default 16)")
    p.add_argument("--hidden", type=int, default=None, help="(default 2048)")
    p.add_argument("--heads", type=int, default=None, help="(default 16)")
    p.add_argument("--kv-heads", type=int, default=None, help="(default 8)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="(default 3 x hidden; a mixture of experts': each expert's)")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="the embedding's rows at least (the tokenizer's size where larger)")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--tokenizer", default=None, metavar="FOLDER|default",
                   help="this model folder's tokenizer (`default`: the default model's, "
                        "SmolLM2's) instead of a small trained one")
    a = p.parse_args(argv)
    tokenizer_from = None
    if a.tokenizer == "default":
        from pipeline.tools.model_cache import ensure_default_model

        tokenizer_from = ensure_default_model()
    elif a.tokenizer is not None:
        tokenizer_from = Path(a.tokenizer)
    if a.like in FAMILY_SHAPES:
        fields = dict(FAMILY_SHAPES[a.like])
        given_fields = {"num_hidden_layers": a.layers, "hidden_size": a.hidden,
                        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
                        ("moe_intermediate_size" if a.like in MOE_SHAPES
                         else "intermediate_size"): a.intermediate}
        fields.update({k: v for k, v in given_fields.items() if v is not None})
        model_type = fields.pop("model_type")
        build_random_model(a.folder, model_type, weight_std=0.02, dtype="bfloat16",
                           tokenizer_from=tokenizer_from, max_position_embeddings=a.max_len,
                           **fields)
        print(a.folder)
        return 0
    shape: dict[str, Any] = {"num_layers": 16, "hidden": 2048, "heads": 16, "kv_heads": 8}
    shape.update(SHAPES.get(a.like, {}))
    given = {"num_layers": a.layers, "hidden": a.hidden, "heads": a.heads,
             "kv_heads": a.kv_heads, "intermediate": a.intermediate}
    shape.update({k: v for k, v in given.items() if v is not None})
    build_random_llama(a.folder, max_len=a.max_len, vocab_size=a.vocab_size, weight_std=0.02,
                       tokenizer_from=tokenizer_from, **shape)
    print(a.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
