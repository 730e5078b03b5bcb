"""Deterministic benchmark workloads (no data set is downloaded). Runs in the benchmark process.

synthetic-chat: chat prompts whose lengths follow a long-tailed log-normal law shaped like public
conversation data sets (ShareGPT-like): input median about 120 tokens, 90th percentile about
600, clipped to [16, 2048]; output median about 100 tokens, 90th percentile about 300, clipped
to [16, 512]. Contents are built from a fixed vocabulary of English words, so they tokenize to
ordinary text; everything follows from the seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = (
    "the model answers questions about history science cooking travel music code and "
    "mathematics with care while users ask for summaries translations stories lists plans "
    "recipes explanations examples comparisons reasons steps ideas and short poems about "
    "rivers mountains cities machines language learning memory time light water energy"
).split()

INPUT_LAW = (math.log(120), 1.25, 16, 2048)  # log-normal (mu, sigma), clipped to [lo, hi]
OUTPUT_LAW = (math.log(100), 0.85, 16, 512)


@dataclass(frozen=True)
class ChatSample:
    text: str  # the user message
    target_input_tokens: int  # its approximate length in tokens (about one token a word)
    output_tokens: int


def _draw(rng: random.Random, law: tuple[float, float, int, int]) -> int:
    mu, sigma, lo, hi = law
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


def synthetic_chat(num: int, seed: int = 0) -> list[ChatSample]:
    rng = random.Random(seed)
    samples = []
    for i in range(num):
        n_in, n_out = _draw(rng, INPUT_LAW), _draw(rng, OUTPUT_LAW)
        words = [rng.choice(WORDS) for _ in range(max(1, n_in - 8))]
        text = f"Request {i}: " + " ".join(words) + ". Please answer in detail."
        samples.append(ChatSample(text, n_in, n_out))
    return samples


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of a fixed length, avoiding the first ids (often special tokens)."""
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


# The project's own source: a text every checkout has, that a model can be asked to copy.
COPY_SOURCES = ("stages/scheduler/stopping.py", "stages/scheduler/block_allocator.py",
                "stages/executor/staging.py", "ipc/codec.py", "stages/detokenizer.py")
COPY_CHARS = 900


def copy_prompts(num: int, seed: int = 0) -> list[str]:
    """Input-grounded prompts (the kind speculative decoding is for): a piece of this
    project's source, ~300 tokens, then a request to write it out again. Completion
    prompts (no chat template): a small model copies from them most faithfully."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    texts = [(root / f).read_text(encoding="utf-8") for f in COPY_SOURCES]
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        text = texts[i % len(texts)]
        start = rng.randrange(0, max(1, len(text) - COPY_CHARS))
        start = text.rfind("\n", 0, start) + 1  # from the start of a line
        piece = text[start:start + COPY_CHARS]
        prompts.append("Here is a piece of a Python file, and then the same piece copied out "
                       f"again.\n\nPiece:\n{piece}\n\nThe same piece, copied:\n")
    return prompts
