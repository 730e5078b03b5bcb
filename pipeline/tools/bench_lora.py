"""`scripts/bench lora`: what LoRA adapters cost a batch, in process (the scheduler and
executor cores, stages/inprocess.py): the same prompts, greedy, decoded to the same length,
by the model alone (its own forward, the CPU's fused layers where they run), then on an
engine with two adapters: every row the base model's, the rows split between the base model
and both adapters, and every row an adapter's. Adapters not given are made at random with
peft (rank 16 on every q/k/v/o and gate/up/down projection, lora_B non-zero)."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from ipc.lora import LoraConfig, parse_lora_module
from ipc.messages import SamplingParams
from ipc.model_info import ModelInfo
from pipeline.tools.datasets import random_prompts

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"]


def random_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter over the model with random A and B (peft: the test extras)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = PeftLoraConfig(r=rank, lora_alpha=rank, target_modules=ALL_PROJECTIONS,
                         init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(str(out))
    return out


def _timed(engine: Any, prompts: list[list[int]], names: list[str], output_len: int) -> float:
    """Output tokens a second of one batch (every prompt at once, names[i] its adapter)."""
    requests = [(str(i), ids, SamplingParams(max_tokens=output_len, temperature=0.0,
                                             ignore_eos=True, lora_name=name))
                for i, (ids, name) in enumerate(zip(prompts, names, strict=True))]
    began = time.perf_counter()
    results = engine.run(requests)
    took = time.perf_counter() - began
    assert all(len(r.token_ids) == output_len for r in results.values())
    return len(prompts) * output_len / took


def lora(args: argparse.Namespace) -> int:
    import torch

    from pipeline.tools.model_source import resolve_model
    from stages.inprocess import InProcessEngine

    model_dir = resolve_model(args.model_dir)
    info = ModelInfo.from_dir(str(model_dir))
    with tempfile.TemporaryDirectory() as tmp:
        modules = list(args.lora_modules)
        for i in range(len(modules), 2):
            name = f"random{i}"
            modules.append((name, str(random_adapter(model_dir, Path(tmp) / name, 16, i))))
        cfg = LoraConfig(modules=tuple(modules[:2]), max_loras=2,
                         max_lora_rank=max(16, args.max_lora_rank))
        engine = dict(max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.input_len,
                      block_size=16, kv_cache_memory=args.kv_cache_memory,
                      max_model_len=args.input_len + args.output_len + 16,
                      dtype=getattr(torch, args.dtype))
        a, b = cfg.names
        split = [("", a, b)[i % 3] for i in range(args.batch)]
        base = InProcessEngine(str(model_dir), **engine)  # type: ignore[arg-type]
        eng = InProcessEngine(str(model_dir), lora=cfg, **engine)  # type: ignore[arg-type]
        runs = {"base alone": (base, [""] * args.batch),
                "base, adapters loaded": (eng, [""] * args.batch),
                "base + 2 adapters mixed": (eng, split),
                "one adapter every row": (eng, [a] * args.batch)}
        rows: dict[str, float] = {}
        seeds = iter(range(1, 1 + args.rounds * len(runs)))
        for _ in range(args.rounds):  # (interleaved, the best of each: the cores are shared)
            for name, (which, names) in runs.items():
                # (prompts of their own each time: none is found in a prefix cache)
                prompts = random_prompts(args.batch, args.input_len, info.vocab_size,
                                         seed=next(seeds))
                rate = _timed(which, prompts, names, args.output_len)
                rows[name] = max(rows.get(name, 0.0), rate)
    first = rows["base alone"]
    print(f"batch {args.batch}, {args.input_len} prompt + {args.output_len} output tokens, "
          f"{model_dir.name} in {args.dtype}, adapters {', '.join(cfg.names)}:")
    for name, rate in rows.items():
        print(f"  {name:26s} {rate:8.1f} tok/s  {rate / first:6.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "batch": args.batch}, indent=1))
    return 0


def add_lora_parser(sub: Any) -> None:
    p = sub.add_parser("lora", help="batch throughput with LoRA adapters against the model")
    p.add_argument("--model", dest="model_dir", default=None,
                   help="local HF folder; default: the converted SmolLM2")
    p.add_argument("--lora-modules", nargs="+", type=parse_lora_module, metavar="NAME=PATH",
                   default=LoraConfig.modules,
                   help="two adapters to run (default: random ones of rank 16)")
    p.add_argument("--max-lora-rank", type=int, default=LoraConfig.max_lora_rank)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--rounds", type=int, default=3,
                   help="each row this many times, interleaved; the best is reported")
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=lora)
