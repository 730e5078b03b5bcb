"""`scripts/bench embed`: embeddings (pooling requests) through the pipeline, in texts a second,
alone and sharing the batch with generations, against sentence-transformers pooling the same
folder the same way (the reference row, and the cosine similarity of every vector to its)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.messages import SamplingParams
from ipc.model_info import ModelInfo
from ipc.pooling import PoolingConfig
from pipeline.tools.datasets import random_prompts


def add_embed_parser(sub: Any, add_common: Any) -> None:
    p = sub.add_parser("embed", help="embeddings: texts/s alone, beside generations, and "
                                     "sentence-transformers'")
    add_common(p, kv_cache_memory=ExecutorConfig.kv_cache_memory)
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="max_num_seqs; ST's batch")
    p.add_argument("--num-generations", type=int, default=32,
                   help="generation requests of the mixed row")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--no-reference", action="store_true",
                   help="skip the sentence-transformers row")
    p.set_defaults(func=embed_bench)


def _pipeline_rows(args: argparse.Namespace, texts: list[list[int]], pooling: PoolingConfig
                   ) -> tuple[dict[str, float], np.ndarray]:
    """(seconds of each pipeline row, the vectors [N, hidden] of the embeddings alone)."""
    from pipeline.runtime.launcher import Pipeline

    info = ModelInfo.from_dir(args.model_dir)
    cfg = PipelineConfig(
        model=ModelInfo.from_dir(args.model_dir, min(info.max_model_len,
                                                     max(1024, args.input_len + 1
                                                         + args.output_len))),
        scheduler=SchedulerConfig(max_num_seqs=args.batch_size),
        executor=ExecutorConfig.for_device(args.device, dtype=args.dtype,
                                           kv_cache_memory=args.kv_cache_memory,
                                           compile=args.compile))
    embed = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling.mode, speculate=False)
    gen = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    gens = random_prompts(args.num_generations, args.input_len, info.vocab_size, seed=2)
    seconds = {}
    with Pipeline(cfg) as pipe:
        client = pipe.client()
        client.generate(texts[:2], embed)  # (warm up)

        def timed(name: str, prompts: list[list[int]], params: list[SamplingParams]) -> Any:
            start = time.perf_counter()
            outs = client.generate(prompts, params)  # type: ignore[arg-type]
            seconds[name] = time.perf_counter() - start
            errors = [o.error for o in outs if o.error]
            if errors:
                raise RuntimeError(f"{name}: requests failed: {errors[0]}")
            return outs

        outs = timed("embed", texts, [embed] * len(texts))
        timed("generate", gens, [gen] * len(gens))
        timed("mixed", gens + texts, [gen] * len(gens) + [embed] * len(texts))
    vectors = np.stack([pooling.finish(o.samples[0].embedding) for o in outs])
    return seconds, vectors


def _reference(args: argparse.Namespace, texts: list[list[int]], pooling: PoolingConfig
               ) -> tuple[float, np.ndarray]:
    """sentence-transformers on the same folder, pooled as the pipeline pools it, fed the
    same token ids (every text is input_len long: no padding); (seconds, vectors)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    word = models.Transformer(args.model_dir, model_kwargs={"torch_dtype": getattr(
        torch, args.dtype)})
    mode = {"last": "lasttoken", "mean": "mean", "cls": "cls"}[pooling.mode]
    modules = [word, models.Pooling(word.get_embedding_dimension(), mode)]
    if pooling.normalize:
        modules.append(models.Normalize())
    model = SentenceTransformer(modules=modules, device="cpu").eval()
    out = []
    with torch.inference_mode():
        ids = torch.tensor(texts[:2])  # (warm up, as the pipeline's row is)
        model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        start = time.perf_counter()
        for i in range(0, len(texts), args.batch_size):
            ids = torch.tensor(texts[i:i + args.batch_size])
            features = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            out.append(model(features)["sentence_embedding"].float().numpy())
    return time.perf_counter() - start, np.concatenate(out)


def embed_bench(args: argparse.Namespace) -> int:
    from pipeline.tools.model_source import resolve_model

    args.model_dir = str(resolve_model(args.model_dir))
    pooling = PoolingConfig.from_dir(args.model_dir)
    vocab = ModelInfo.from_dir(args.model_dir).vocab_size
    texts = random_prompts(args.num_texts, args.input_len, vocab, seed=1)
    seconds, vectors = _pipeline_rows(args, texts, pooling)
    n, g = args.num_texts, args.num_generations * args.output_len
    print(f"embed: {n} texts of {args.input_len} tokens, pooling {pooling.mode} "
          f"(normalize {pooling.normalize}; {pooling.source}), batch {args.batch_size}, "
          f"device={args.device} dtype={args.dtype} cpus={os.cpu_count()}")
    print(f"{'pipeline':28}{n / seconds['embed']:>10.1f} texts/s")
    print(f"{'pipeline generate alone':28}{g / seconds['generate']:>10.1f} output tok/s")
    print(f"{'pipeline mixed':28}{seconds['mixed']:>10.2f} s  (alone, one after the other: "
          f"{seconds['embed'] + seconds['generate']:.2f} s)")
    report: dict[str, Any] = {"seconds": seconds, "texts_per_s": n / seconds["embed"],
                              "pooling": pooling.mode,
                              "config": {k: v for k, v in vars(args).items() if k != "func"}}
    if not args.no_reference:
        ref_s, ref = _reference(args, texts, pooling)
        cosine = np.sum(vectors * ref, axis=1) / (np.linalg.norm(vectors, axis=1)
                                                  * np.linalg.norm(ref, axis=1))
        print(f"{'sentence-transformers':28}{n / ref_s:>10.1f} texts/s")
        print(f"cosine similarity to sentence-transformers: min {cosine.min():.6f}")
        report |= {"reference_texts_per_s": n / ref_s, "min_cosine": float(cosine.min())}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
