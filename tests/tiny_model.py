"""A tiny randomly initialised Llama with a tokenizer trained offline, saved as an HF folder.

Lets every correctness test run where the default model is absent, in seconds.
"""

from __future__ import annotations

from pathlib import Path

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


def build_tokenizer(folder: Path, vocab_size: int = 512):  # type: ignore[no-untyped-def]
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


def build_tiny_llama(folder: Path, *, num_layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, max_len: int = 512, seed: int = 0) -> Path:
    """Save a random Llama (GQA, untied head) and its tokenizer into folder; returns folder."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 3,
                      num_hidden_layers=num_layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the default init: peaked, varied logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers generate, greedy, fp32, one prompt at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens,
                               pad_token_id=model.config.pad_token_id)
            outs.append(y[0, len(ids):].tolist())
    return outs
