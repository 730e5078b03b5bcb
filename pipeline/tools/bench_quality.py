"""`scripts/bench quality`: what each weight format and each KV cache format costs in accuracy,
against float32 weights and a KV cache in the activations' dtype on the same model, in one
process (stages/inprocess.py: the scheduler and executor cores):

- |Δ log-prob|: each token of a fixed text scored by the model (prompt logprobs), under the
  format and under float32; the mean and the largest difference over the text's tokens;
- greedy agreement: for a set of chat prompts, the greedy continuation of --output-len tokens
  under each; how many are identical, and the mean length of the part they share before the
  first difference (one different token sends the rest of the continuation elsewhere, so the
  shared prefix says more than the count alone).

The activations are in --dtype in every row, so `--dtype bfloat16` measures what a format
adds to bf16 (against float32 weights, which is what the targets compare with). A KV format's
row (`kv int8`, ...) has float32 weights and only its cache quantized: what it adds to a cache
in --dtype.

With activations narrower than float32 on the CPU, a `floor` row is the reference itself
(same weights, same cache format) run through PyTorch's ops instead of the CPU kernels: two
correct forwards of one dtype that round in another order. A format that changes every value
in the cache moves every later rounding too, so its row does not read much below the floor
(bf16 on the default model: floor 0.040, an int8 cache 0.046; with float32 activations int8
reads 0.018)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

# A fixed English text of a few hundred tokens: explanatory prose, a list, numbers and code.
TEXT = """The water cycle describes how water moves between the oceans, the air and the land.
The sun warms the surface of the sea, and some of the water evaporates into vapour. As the warm,
moist air rises it cools, and the vapour condenses into the tiny droplets that make up clouds.
When the droplets grow heavy enough they fall as rain or snow. Some of that water runs off into
rivers and lakes, some soaks into the ground and becomes groundwater, and some is taken up by
plants, which release it again through their leaves. Over thousands of years a single molecule
may pass through every part of the cycle many times.

Three things to remember:
1. Evaporation needs energy, which is why it is faster on hot days.
2. Condensation releases that energy again, which powers storms.
3. About 97 percent of the water on Earth is salt water in the oceans.

def mean(values):
    total = 0.0
    for v in values:
        total += v
    return total / len(values)

print(mean([1.5, 2.5, 3.0]))  # prints 2.3333333333333335
"""

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Give me a tip for learning a new language.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat to someone who has never seen one.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
    "Name a planet in the solar system and one fact about it.",
    "Why is the sky blue?",
    "Write one sentence about autumn.",
    "How do I boil an egg?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
]


FLOOR = "floor"  # the reference through PyTorch's ops (see the module's docstring)


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {list(known)}")
    return names


def quantization_list(text: str) -> list[str]:
    """A --quantization comma list of ipc.config.QUANTIZATIONS' names (the type of the
    option here and in `bench throughput`)."""
    from ipc.config import QUANTIZATIONS

    return _names(text, QUANTIZATIONS, "formats")


def kv_dtype_list(text: str) -> list[str]:
    """A --kv-cache-dtype comma list of ipc.config.KV_CACHE_DTYPES' names ("" none)."""
    from ipc.config import KV_CACHE_DTYPES

    return _names(text, KV_CACHE_DTYPES, "KV cache formats")


def add_quality_parser(sub: Any, add_common: Any) -> None:
    p = sub.add_parser("quality", help="each --quantization against float32 weights, each "
                                       "--kv-cache-dtype against a cache in --dtype: "
                                       "|Δ log-prob| of a fixed text, greedy agreement")
    add_common(p, kv_cache_memory=1 << 28)
    p.add_argument("--quantization", default="int8,int4",
                   help="comma list of the formats to measure (ipc.config.QUANTIZATIONS)")
    p.add_argument("--kv-cache-dtype", default="int8,fp8_e4m3,fp8_e5m2",
                   help="comma list of the KV cache formats to measure "
                        "(ipc.config.KV_CACHE_DTYPES; \"\" none)")
    p.add_argument("--output-len", type=int, default=32,
                   help="greedy tokens per prompt for the agreement")
    p.set_defaults(func=quality)


def _engine(args: argparse.Namespace, quantization: str | None, kv_cache_dtype: str,
            cpu_kernels: bool | None = None) -> Any:
    import torch

    from stages.inprocess import InProcessEngine

    return InProcessEngine(args.model_dir, max_num_seqs=len(PROMPTS), max_num_batched_tokens=1024,
                           block_size=16, kv_cache_memory=args.kv_cache_memory, depth=2,
                           max_model_len=1024, dtype=getattr(torch, args.dtype),
                           device=args.device, quantization=quantization,
                           kv_cache_dtype=kv_cache_dtype, cpu_kernels=cpu_kernels)


def _measure(args: argparse.Namespace, quantization: str | None, text_ids: list[int],
             prompts: list[list[int]],
             kv_cache_dtype: str = "auto",
             cpu_kernels: bool | None = None) -> tuple[list[float], list[list[int]]]:
    """The text's token logprobs (the first token has none) and each prompt's greedy
    continuation, under one weight format and KV cache format."""
    from ipc.messages import SamplingParams

    engine = _engine(args, quantization, kv_cache_dtype, cpu_kernels)
    scored = engine.run([("text", text_ids, SamplingParams(max_tokens=1, prompt_logprobs=0))])
    plp = scored["text", 0].prompt_logprobs
    assert plp is not None
    logprobs = [t.logprob for t in plp[1:]]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=args.output_len,
                                                     temperature=0.0, ignore_eos=True))
    return logprobs, greedy


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def quality(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pipeline.tools.model_source import resolve_model

    args.model_dir = str(resolve_model(args.model_dir))
    try:
        formats = quantization_list(args.quantization)
        kv_formats = kv_dtype_list(args.kv_cache_dtype)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"bench quality: {e}") from None
    tok: Any = AutoTokenizer.from_pretrained(args.model_dir)
    text_ids = list(tok(TEXT)["input_ids"])
    prompts = [list(tok(tok.apply_chat_template([{"role": "user", "content": p}],
                                                tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    ref_lp, ref_greedy = _measure(args, None, text_ids, prompts)
    report: dict[str, Any] = {
        "config": {"model": args.model_dir, "dtype": args.dtype, "text_tokens": len(text_ids),
                   "prompts": len(prompts), "output_len": args.output_len},
        "float32 weights": {"perplexity": math.exp(-statistics.fmean(ref_lp))}}
    rows: list[tuple[str, str | None, str, bool | None]] = [
        (name, name, "auto", None) for name in formats]
    rows += [(f"kv {name}", None, name, None) for name in kv_formats]
    if args.dtype != "float32" and args.device == "cpu":
        rows.append((FLOOR, None, "auto", False))
    for row, quantization, kv_cache_dtype, cpu_kernels in rows:
        lp, greedy = _measure(args, quantization, text_ids, prompts, kv_cache_dtype,
                              cpu_kernels)
        delta = [abs(a - b) for a, b in zip(lp, ref_lp, strict=True)]
        report[row] = {
            "mean_abs_dlogprob": statistics.fmean(delta), "max_abs_dlogprob": max(delta),
            "perplexity": math.exp(-statistics.fmean(lp)),
            "greedy_identical": sum(g == r for g, r in zip(greedy, ref_greedy, strict=True)),
            "mean_shared_prefix": statistics.fmean(
                _shared_prefix(g, r) for g, r in zip(greedy, ref_greedy, strict=True))}
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"quality: {cfg['text_tokens']} text tokens scored; {cfg['prompts']} prompts × "
          f"{cfg['output_len']} greedy tokens; activations {cfg['dtype']}; against float32 "
          f"weights (perplexity {report['float32 weights']['perplexity']:.3f})")
    print(f"{'format':12}{'mean |Δ lp|':>13}{'max |Δ lp|':>12}{'perplexity':>12}"
          f"{'greedy same':>13}{'shared prefix':>15}")
    for name, r in report.items():
        if name in ("config", "float32 weights"):
            continue
        print(f"{name:12}{r['mean_abs_dlogprob']:>13.4f}{r['max_abs_dlogprob']:>12.4f}"
              f"{r['perplexity']:>12.3f}{r['greedy_identical']:>7}/{cfg['prompts']}"
              f"{r['mean_shared_prefix']:>12.1f}/{cfg['output_len']}")
    if FLOOR in report:
        print(f"({FLOOR}: the reference's weights and cache through PyTorch's ops instead of the "
              f"CPU kernels, what two correct {cfg['dtype']} forwards differ by: a format "
              "that changes every cached value reads no lower)")
