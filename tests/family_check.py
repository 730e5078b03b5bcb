"""What every model family is held to against transformers (tests/test_family_*.py): greedy
tokens of a tiny random model (fp32) equal transformers' generate, prompt by prompt; the
same tokens from a batch of mixed lengths in chunked prefill, from prefix-cache hits, and on
PyTorch's ops as on the CPU kernels."""

from __future__ import annotations

from pathlib import Path

from tiny_model import hf_greedy

from ipc.messages import SamplingParams
from stages.executor import kernels
from stages.inprocess import InProcessEngine

TEXTS = ["The quick brown fox", "Paged attention stores keys", "Héllo wörld 🚀",
         "def main():", "Continuous batching lets new requests join at any step. " * 3, "a",
         "日本語のテキスト", "Grüße aus Köln. The lazy dog."]


def prompts_of(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [tok(t)["input_ids"] for t in TEXTS]


def eos_of(folder: Path) -> tuple[int, ...]:
    import json

    eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


def check_against_transformers(folder: Path, max_new_tokens: int = 32,
                               cpu_kernels: tuple[bool, ...] = (True, False),
                               **engine: object) -> list[list[int]]:
    """The engine's greedy tokens equal transformers' for every prompt: batched in chunks of
    16 tokens, run-ahead on, then each prompt with its output as a chat's next turn, from the
    prefix cache (a model with windowed layers finds there the pages their windows read at
    the end of the first turn: the earlier ones went back as the window passed them); on the
    CPU kernels and on PyTorch's ops (those of `cpu_kernels` this machine has). Returns the
    tokens."""
    prompts = prompts_of(folder)
    want = hf_greedy(folder, prompts, max_new_tokens=max_new_tokens)
    turns = [p + w for p, w in zip(prompts, want, strict=True)]
    want_next = hf_greedy(folder, turns, max_new_tokens=8)
    greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    for on_kernels in cpu_kernels:
        if on_kernels and not kernels.available():
            continue
        eng = InProcessEngine(str(folder), depth=2, max_num_batched_tokens=16,
                              max_num_seqs=4, eos_token_ids=eos_of(folder),
                              cpu_kernels=on_kernels, **engine)  # type: ignore[arg-type]
        assert eng.runner.cpu_kernels == on_kernels
        got = eng.generate(prompts, greedy)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"prompt {i} ({'kernels' if on_kernels else 'torch'}): {g} != {w}"
        hits = eng.scheduler.prefix_cache_hits
        again = SamplingParams(max_tokens=8, temperature=0.0)
        assert eng.generate(turns, again) == want_next  # (from the prefix cache)
        assert eng.scheduler.prefix_cache_hits > hits
    return want
