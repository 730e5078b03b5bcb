"""A tiny randomly initialised Llama with a tokenizer trained offline, saved as an HF folder.

Lets every correctness test run where the default model is absent, in seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_tiny_llama(folder: Path, **kwargs: Any) -> Path:
    """A tiny random Llama (2 layers, hidden 64, GQA) and its offline tokenizer."""
    from pipeline.tools.random_model import build_random_llama

    return build_random_llama(folder, **kwargs)


def hf_greedy(folder: Path, prompts_ids: list[list[int]], max_new_tokens: int,
              dtype: str = "float32") -> list[list[int]]:
    """The oracle: transformers generate, greedy, in `dtype` (fp32 unless asked), one prompt
    at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens,
                               pad_token_id=model.config.pad_token_id)
            outs.append(y[0, len(ids):].tolist())
    return outs
