"""`scripts/bench dp`: data-parallel engines. Output tok/s of D engines against one at the
same per-engine batch (the same prompts, interleaved runs), and the prefix-cache hit rate of
a prefix-heavy load with prefix routing against load-only routing. Runs in the CLI process."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.messages import SamplingParams
from ipc.model_info import ModelInfo


def dp_config(args: argparse.Namespace, num_engines: int, router: str = "prefix"
              ) -> PipelineConfig:
    prompt_room = args.batch * max(args.input_len, args.prefix_len + 16)
    return PipelineConfig(
        model=ModelInfo.from_dir(args.model_dir, args.max_model_len),
        scheduler=SchedulerConfig(max_num_seqs=args.batch,
                                  max_num_batched_tokens=max(
                                      SchedulerConfig.max_num_batched_tokens, prompt_room)),
        executor=ExecutorConfig.for_device(args.device, dtype=args.dtype,
                                           kv_cache_memory=args.kv_cache_memory,
                                           compile=args.compile),
        num_tokenizers=args.tokenizer_workers, num_detokenizers=args.detokenizer_workers,
        data_parallel_size=num_engines, router=router)


def throughput_once(args: argparse.Namespace, num_engines: int) -> tuple[float, list[list[int]]]:
    """Output tok/s of batch × D prompts (D: the larger side's engines), and their tokens."""
    from pipeline.runtime.launcher import Pipeline

    vocab = ModelInfo.from_dir(args.model_dir).vocab_size
    count = args.batch * args.data_parallel_size
    prompts = [[(7 + 31 * i + 17 * j) % (vocab - 10) + 5 for j in range(args.input_len)]
               for i in range(count)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with Pipeline(dp_config(args, num_engines)) as pipe:
        client = pipe.client()
        client.generate([prompts[0][:4]], dataclasses.replace(params, max_tokens=2))
        start = time.perf_counter()
        outs = client.generate(prompts, params)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"benchmark requests failed: {errors[0]}")
    return sum(o.num_output_tokens for o in outs) / seconds, [o.token_ids for o in outs]


def prefix_once(args: argparse.Namespace, router: str) -> tuple[float, float]:
    """A prefix-heavy load on D engines: --groups conversations, each a shared prefix of
    --prefix-len tokens, asked --rounds times (one request of each group at once, round
    after round, each round's arrivals in another order). Returns (prefix-cache hit rate
    of the prompt tokens, seconds)."""
    from pipeline.runtime.launcher import Pipeline

    vocab = ModelInfo.from_dir(args.model_dir).vocab_size
    prefixes = [[(11 + 37 * g + 13 * j) % (vocab - 10) + 5 for j in range(args.prefix_len)]
                for g in range(args.groups)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with Pipeline(dp_config(args, args.data_parallel_size, router)) as pipe:
        client = pipe.client()
        start = time.perf_counter()
        for r in range(args.rounds):
            order = [(r + g) % args.groups for g in range(args.groups)]  # arrivals vary
            prompts = [prefixes[g] + [5 + r, 6 + g % 7] for g in order]
            outs = client.generate(prompts, params)  # type: ignore[arg-type]
            if any(o.error for o in outs):
                raise RuntimeError(f"benchmark requests failed: {outs[0].error}")
        seconds = time.perf_counter() - start
        stats = pipe.idle_stats()
    return stats.prefix_cache_hits / max(1, stats.prefix_cache_queries), seconds


def dp(args: argparse.Namespace) -> int:
    from pipeline.tools.model_source import resolve_model

    args.model_dir = str(resolve_model(args.model_dir))
    one, many, same = [], [], True
    for _ in range(args.repeat):  # interleaved, so slow drifts of a shared machine cancel out
        a, ids_a = throughput_once(args, 1)
        b, ids_b = throughput_once(args, args.data_parallel_size)
        one.append(a)
        many.append(b)
        same = same and ids_a == ids_b
    ratio = statistics.median(b / a for a, b in zip(one, many, strict=True))
    d = args.data_parallel_size
    print(f"dp: device={args.device} engines={d} batch per engine={args.batch} prompts="
          f"{args.batch * d} input_len={args.input_len} output_len={args.output_len} "
          f"repeats={args.repeat} cpus={os.cpu_count()} (medians; ratio = median of pairs)")
    print(f"{'output tok/s, 1 engine':34}{statistics.median(one):>12.1f}")
    print(f"{f'output tok/s, {d} engines':34}{statistics.median(many):>12.1f}")
    print(f"{'ratio':34}{ratio:>11.2f}x   identical outputs: {same}")
    hits = {router: [prefix_once(args, router)[0] for _ in range(args.repeat)]
            for router in ("load", "prefix")}
    print(f"prefix-heavy load: {args.groups} groups x {args.rounds} rounds, prefix "
          f"{args.prefix_len} tokens, {d} engines")
    for router, rates in hits.items():
        print(f"{f'prefix-cache hit rate, --router {router}':34}{statistics.median(rates):>12.1%}")
    report: dict[str, Any] = {
        "one_engine_tok_s": one, "engines_tok_s": many, "ratio": ratio,
        "identical_outputs": same, "prefix_hit_rate": hits,
        "config": {k: v for k, v in vars(args).items() if k != "func"}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if same else 1


def add_dp_parser(sub: Any, add_common: Any) -> None:
    p = sub.add_parser("dp", help="data-parallel engines: D against one, prefix routing")
    add_common(p, kv_cache_memory=256 << 20)
    p.add_argument("--data-parallel-size", type=int, default=2, metavar="D")
    p.add_argument("--batch", type=int, default=128, help="max_num_seqs of each engine")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tokenizer-workers", type=int, default=PipelineConfig.num_tokenizers)
    p.add_argument("--detokenizer-workers", type=int, default=PipelineConfig.num_detokenizers)
    p.add_argument("--groups", type=int, default=16, help="prefix-heavy load: conversations")
    p.add_argument("--rounds", type=int, default=6, help="prefix-heavy load: turns of each")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens each group shares")
    p.add_argument("--repeat", type=int, default=1)
    p.set_defaults(func=dp)
